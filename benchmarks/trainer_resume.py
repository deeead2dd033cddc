"""Hugging Face Trainer + megatrain at scale: train, checkpoint, resume in a fresh process, compare.

What it does (each run in its own, fresh Python process):

* run A: ``MegatrainTrainer`` trains a Llama for ``--steps`` N optimizer steps (AdamW, cosine
  schedule with warmup, ``max_grad_norm``, gradient accumulation, a log record every step) and
  writes the Trainer checkpoint ``checkpoint-{N/2}`` (``save_steps = N/2``; the end-of-run
  checkpoint is skipped: the final weights are compared through ``save_model()``), then
  ``trainer.save_model()``;
* run B: a new process builds the same model class (its weights are not initialised: every value
  must come from the checkpoint), and ``trainer.train(resume_from_checkpoint=A/checkpoint-{N/2})``
  trains steps N/2+1..N, then ``trainer.save_model()``;
* run A also loads its saved model back with ``AutoModelForCausalLM.from_pretrained`` (CPU) and
  checks the parameter count;
* this process compares the losses of steps N/2+1..N (the logged per-step loss and every
  micro-batch loss) and the two saved models (safetensors, one tensor at a time), and writes
  everything to ``--out`` (JSON): losses, differences, checkpoint save time and size, resume time, peak host RSS
  and GPU memory of each process, megatrain's logged figures (tokens/s, H2D GB/s, host store) and
  the model TFLOP/s computed from tokens/s.

Data: the Python standard library's own sources, byte tokenizer, packed rows (learnable: the loss
falls visibly within a few steps). Model: fp32 master weights, seeded init (Llama's init: normal
with ``initializer_range`` for every matrix, ones for norm weights).

On the CPU with fp32 compute (``--tiny``) the resumed run must equal the uninterrupted one bit for
bit; the script exits with status 1 when it does not. On CUDA (bf16 compute) the differences are
reported, not asserted (e.g. the attention backward accumulates with atomics).

    python benchmarks/trainer_resume.py --out trainer_resume_h200.json    # 1.1B Llama, GPU (~3 min)
    python benchmarks/trainer_resume.py --tiny --out /tmp/tiny.json       # CPU smoke test (~40 s)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))

PRESETS = {
    # ~1.10B parameters (TinyLlama's shape): 22 x 44.0M layer parameters + 2 x 65.5M embedding / LM head.
    "1b": dict(hidden=2048, layers=22, intermediate=5632, heads=32, kv_heads=4, vocab=32000,
               batch=4, seq=1024, grad_accum=2, steps=30, lr=3e-4, warmup=3),
    # CPU smoke test: seconds per process.
    "tiny": dict(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2, vocab=320,
                 batch=2, seq=64, grad_accum=2, steps=8, lr=3e-3, warmup=2),
}


def _ensure_megatrain_importable() -> str:
    """Imports megatrain (from the repository's python/ when it is not installed); returns its parent dir."""
    try:
        import megatrain  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.join(REPO, "python"))
        import megatrain  # noqa: F401
    return os.path.dirname(os.path.dirname(os.path.abspath(megatrain.__file__)))


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


# ============================================================================ worker (one run)
def _init_weights_fast(model, std: float) -> None:
    """Llama's own init (``LlamaPreTrainedModel._init_weights``), seeded: N(0, std) matrices, ones norms."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.zero_()


def _no_init():
    """transformers' context manager that skips weight init (the values come from a checkpoint)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights
        except ImportError:
            return contextlib.nullcontext()
    return no_init_weights()


def _worker(spec_path: str) -> None:
    t_start = time.perf_counter()
    with open(spec_path) as f:
        spec = json.load(f)
    role = spec["role"]  # "A" (uninterrupted) or "B" (resumed)
    timings = {}

    import torch
    _ensure_megatrain_importable()
    import megatrain
    import transformers
    from megatrain.integrations import MegatrainTrainer
    from megatrain.train.config import DataConfig
    from megatrain.train.data import load_text_data
    from megatrain.train.metrics import count_params, flops_per_token
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    timings["import_s"] = time.perf_counter() - t_start
    device = torch.device(spec["device"])
    compute_dtype = torch.bfloat16 if spec["compute_dtype"] == "bf16" else torch.float32
    n, half, ga, bs, seq = spec["steps"], spec["steps"] // 2, spec["grad_accum"], spec["batch"], spec["seq"]

    # -- data: stdlib sources, byte tokenizer, one epoch of exactly the rows the run needs
    t = time.perf_counter()
    need = n * ga * bs
    docs = 200
    while True:
        data = load_text_data(DataConfig(path="stdlib", seq_len=seq, max_documents=docs), spec["seed"])
        if len(data.train) >= need:
            break
        docs *= 4
    rows = torch.from_numpy(data.train[:need]).long()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            return {"input_ids": rows[i], "labels": rows[i]}

    timings["data_s"] = time.perf_counter() - t

    # -- model: fp32, seeded (A); B's values all come from the checkpoint
    t = time.perf_counter()
    cfg = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                      num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                      num_key_value_heads=spec["kv_heads"], max_position_embeddings=max(seq, 2048),
                      tie_word_embeddings=False, bos_token_id=data.tokenizer.eos_token_id,
                      eos_token_id=data.tokenizer.eos_token_id)
    torch.manual_seed(spec["seed"] if role == "A" else spec["seed"] + 1)
    if role == "A" and spec["hf_init"]:
        model = LlamaForCausalLM(cfg)
    else:
        with _no_init():
            model = LlamaForCausalLM(cfg)
        if role == "A" or spec["b_init"] == "random":  # B: a different seed; the checkpoint must win
            _init_weights_fast(model, cfg.initializer_range)
    model = model.float()
    timings["model_init_s"] = time.perf_counter() - t
    params = count_params(model)
    flops = flops_per_token(cfg, params, seq, "recompute")

    t = time.perf_counter()
    model = megatrain.wrap(model, device=device, compute_dtype=compute_dtype)
    timings["wrap_s"] = time.perf_counter() - t

    # -- exact per-micro-batch losses (the logged loss is their Trainer-side reduction)
    micro = []

    def record(module, args, out):
        if module.training and getattr(out, "loss", None) is not None:
            micro.append(out.loss.detach())

    model.register_forward_hook(record)

    class Clock(TrainerCallback):
        def __init__(self):
            self.step_begin = []
            self.train_begin = None

        def on_train_begin(self, args, state, control, **kw):
            self.train_begin = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            self.step_begin.append(time.perf_counter())

    class SaveOnlyAt(TrainerCallback):
        """save_steps = N/2 would also save checkpoint-N: keep only checkpoint-N/2 (disk, time)."""

        def on_step_end(self, args, state, control, **kw):
            if control.should_save and state.global_step != half:
                control.should_save = False

    class Timed(MegatrainTrainer):
        def _save_checkpoint(self, model, trial):
            t0 = time.perf_counter()
            super()._save_checkpoint(model, trial)
            timings["checkpoint_save_s"] = time.perf_counter() - t0

        def _save(self, output_dir=None, state_dict=None):
            t0 = time.perf_counter()
            super()._save(output_dir, state_dict)
            timings.setdefault("hf_model_save_s", []).append(time.perf_counter() - t0)

        def _save_optimizer_and_scheduler(self, output_dir):
            t0 = time.perf_counter()
            super()._save_optimizer_and_scheduler(output_dir)
            timings["megatrain_state_save_s"] = time.perf_counter() - t0

        def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
            t0 = time.perf_counter()
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            timings["resume_check_s"] = time.perf_counter() - t0

        def _load_optimizer_and_scheduler(self, checkpoint):
            t0 = time.perf_counter()
            super()._load_optimizer_and_scheduler(checkpoint)
            if checkpoint is not None:
                timings["resume_megatrain_load_s"] = time.perf_counter() - t0

        def _load_rng_state(self, checkpoint):
            t0 = time.perf_counter()
            super()._load_rng_state(checkpoint)
            if checkpoint is not None:
                timings["resume_rng_load_s"] = time.perf_counter() - t0

    args = TrainingArguments(
        output_dir=spec["run_dir"], per_device_train_batch_size=bs, gradient_accumulation_steps=ga, max_steps=n,
        learning_rate=spec["lr"], warmup_steps=spec["warmup"], lr_scheduler_type="cosine", weight_decay=0.1,
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0, logging_steps=1,
        save_strategy="steps", save_steps=half, report_to=[], use_cpu=device.type == "cpu", seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True)
    clock = Clock()
    t = time.perf_counter()
    trainer = Timed(model=model, args=args, train_dataset=Rows(), callbacks=[clock, SaveOnlyAt()])
    timings["trainer_init_s"] = time.perf_counter() - t

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_train = time.perf_counter()
    if role == "A":
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=spec["resume_from"])
    timings["train_call_s"] = time.perf_counter() - t_train
    timings["train_call_to_first_step_s"] = clock.step_begin[0] - t_train if clock.step_begin else None
    gpu_peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None

    t = time.perf_counter()
    trainer.save_model(spec["final_dir"])
    timings["save_model_s"] = time.perf_counter() - t
    peak_rss_training = _peak_rss_gib()  # before the reload below adds a CPU copy of the model
    reload = None
    if role == "A":  # the saved model is a standard HF model: load it back on the CPU
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        t = time.perf_counter()
        reloaded = AutoModelForCausalLM.from_pretrained(spec["final_dir"], dtype=torch.float32)
        n_reloaded = sum(p.numel() for p in reloaded.parameters())
        reload = {"load_s": time.perf_counter() - t, "class": type(reloaded).__name__, "params": n_reloaded,
                  "dtype": str(next(reloaded.parameters()).dtype), "params_match": n_reloaded == params["total"]}
        del reloaded

    starts = clock.step_begin
    result = {
        "role": role,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compute_dtype": spec["compute_dtype"],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "params": params,
        "flops_per_token": {"model": flops.model, "recompute": flops.recompute},
        "tokens_per_step": bs * seq * ga,
        "rows_used": need,
        "timings": timings,
        "step_intervals_s": [b - a for a, b in zip(starts, starts[1:])],
        "global_steps_run": len(starts),
        "micro_losses": [float(x) for x in micro],
        "log_history": trainer.state.log_history,
        "from_pretrained_check": reload,
        "peak_rss_gib": peak_rss_training,
        "peak_rss_gib_incl_reload": _peak_rss_gib(),
        "gpu_peak_gib": gpu_peak,
        "process_wall_s": time.perf_counter() - t_start,
    }
    ck = os.path.join(spec["run_dir"], f"checkpoint-{half}")
    if role == "A" and os.path.isdir(ck):
        result["checkpoint"] = {
            "path": ck,
            "bytes_total": _dir_bytes(ck),
            "bytes_megatrain_state": _dir_bytes(os.path.join(ck, "megatrain")),
            "bytes_hf_model": os.path.getsize(os.path.join(ck, "model.safetensors")),
            "files": sorted(os.listdir(ck)),
        }
    with open(spec["result"], "w") as f:
        json.dump(result, f, indent=1, default=str)


# ============================================================================ driver
def _median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _figures(res: dict, first_step: int) -> dict:
    """Medians of megatrain's per-step log figures (steps > first_step: warm-up excluded)."""
    logs = [h for h in res["log_history"] if "loss" in h and h.get("step", 0) > first_step]
    out = {}
    for key in ("megatrain/tokens_per_s", "megatrain/h2d_gbps", "megatrain/h2d_gbps_wall", "megatrain/h2d_gb",
                "megatrain/d2h_gb", "megatrain/adam_exposed_s", "megatrain/host_store_gib", "megatrain/host_rss_gib",
                "grad_norm"):
        out[key] = _median([h.get(key) for h in logs])
    tps = out["megatrain/tokens_per_s"]
    if tps:
        out["model_tflops"] = tps * res["flops_per_token"]["model"] / 1e12
        out["hardware_tflops_incl_recompute"] = tps * (res["flops_per_token"]["model"]
                                                        + res["flops_per_token"]["recompute"]) / 1e12
    out["step_s_median"] = _median(res["step_intervals_s"][1:])
    return out


def _diff(a: list, b: list) -> dict:
    if len(a) != len(b) or not a:
        return {"n": [len(a), len(b)], "bit_identical": False, "max_abs": None, "max_rel": None}
    absd = [abs(x - y) for x, y in zip(a, b)]
    rel = [d / max(abs(x), 1e-30) for d, x in zip(absd, a)]
    return {"n": len(a), "bit_identical": all(x == y for x, y in zip(a, b)), "max_abs": max(absd), "max_rel": max(rel)}


def _compare_models(path_a: str, path_b: str) -> dict:
    """Per-tensor comparison of two model.safetensors files, one tensor at a time."""
    from safetensors import safe_open

    import torch

    out = {"tensors": 0, "tensors_equal": 0, "max_abs": 0.0, "max_rel_of_tensor_max": 0.0, "worst_tensor": None,
           "keys_match": True}
    with safe_open(path_a, "pt") as fa, safe_open(path_b, "pt") as fb:
        ka, kb = set(fa.keys()), set(fb.keys())
        out["keys_match"] = ka == kb
        for k in sorted(ka & kb):
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            out["tensors"] += 1
            if torch.equal(x, y):
                out["tensors_equal"] += 1
                continue
            d = (x.double() - y.double()).abs().max().item()
            scale = x.double().abs().max().item()
            if d > out["max_abs"]:
                out["max_abs"], out["worst_tensor"] = d, k
            out["max_rel_of_tensor_max"] = max(out["max_rel_of_tensor_max"], d / max(scale, 1e-30))
            del x, y
    out["bit_identical"] = out["keys_match"] and out["tensors"] == out["tensors_equal"]
    return out


def _run_worker(spec: dict, workdir: str, env: dict) -> dict:
    path = os.path.join(workdir, f"spec_{spec['role']}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    print(f"\n=== run {spec['role']} ({'uninterrupted' if spec['role'] == 'A' else 'resumed from ' + spec['resume_from']})",
          flush=True)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, HERE, "--_worker", path], env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"trainer_resume: run {spec['role']} failed with exit status {p.returncode}")
    with open(spec["result"]) as f:
        res = json.load(f)
    res["subprocess_wall_s"] = wall
    return res


def _fmt(x, spec=".4g"):
    return "n/a" if x is None else format(x, spec)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU, fp32 (test of the script)")
    for k in ("hidden", "layers", "intermediate", "heads", "kv_heads", "vocab", "batch", "seq", "grad_accum", "steps",
              "warmup"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default: preset's {k}")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    ap.add_argument("--compute-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="auto: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--hf-init", action="store_true",
                    help="run A: transformers' own init (slower: a serial kaiming pass first) instead of the same "
                         "Llama init done directly")
    ap.add_argument("--b-init", default="skip", choices=["skip", "random"],
                    help="run B's weights before resuming: skip (uninitialised) or random (another seed)")
    ap.add_argument("--workdir", default=None, help="where runs and checkpoints go (default: a new temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (checkpoint, saved models)")
    ap.add_argument("--out", default=None, help="write the results JSON here")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        _worker(a._worker)
        return 0

    cfg = dict(PRESETS["tiny" if a.tiny else "1b"])
    for k in cfg:
        v = getattr(a, k)
        if v is not None:
            cfg[k] = v
    if cfg["steps"] < 2 or cfg["steps"] % 2:
        ap.error("--steps must be even and >= 2 (the checkpoint is at steps/2)")
    if cfg["vocab"] < 257:
        ap.error("--vocab must be >= 257 (the byte tokenizer's 256 bytes + end-of-text)")
    pkg_parent = _ensure_megatrain_importable()
    import torch

    device = a.device
    if device == "auto":
        device = "cpu" if a.tiny or not torch.cuda.is_available() else "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device")
    if device.startswith("cuda") and ":" not in device:
        device = "cuda:0"
    compute = a.compute_dtype if a.compute_dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")

    created = a.workdir is None
    workdir = a.workdir or tempfile.mkdtemp(prefix="megatrain_trainer_resume_")
    os.makedirs(workdir, exist_ok=True)
    # Rough disk need: checkpoint (HF model 4 B/param + megatrain state 12 B/param) + two saved models.
    est_params = (cfg["layers"] * (2 * cfg["hidden"] ** 2 + 2 * cfg["hidden"] * cfg["hidden"] // cfg["heads"]
                                   * cfg["kv_heads"] + 3 * cfg["hidden"] * cfg["intermediate"])
                  + 2 * cfg["vocab"] * cfg["hidden"])
    need = est_params * 24
    free = shutil.disk_usage(workdir).free
    print(f"trainer_resume: ~{est_params / 1e9:.3f}B parameters, device {device}, compute {compute}, "
          f"{cfg['steps']} steps x {cfg['batch']} x {cfg['seq']} tokens x {cfg['grad_accum']} micro-batches; "
          f"workdir {workdir} ({free / 2**30:.0f} GiB free, ~{need / 2**30:.1f} GiB needed)", flush=True)
    if free < need * 1.05:
        raise SystemExit(f"trainer_resume: {workdir} has {free / 2**30:.1f} GiB free, ~{need / 2**30:.1f} GiB needed; "
                         "pass --workdir on a bigger disk")

    env = dict(os.environ)
    env["PYTHONPATH"] = pkg_parent + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.tiny:
        # A tiny model gains nothing from threads, and OpenMP spinning on a busy small machine made
        # a 0.2 s step take 4 s. (Same in both runs: bit-identity does not depend on it.)
        env.setdefault("OMP_NUM_THREADS", "1")
    half = cfg["steps"] // 2
    base = dict(cfg, device=device, compute_dtype=compute, seed=a.seed, hf_init=a.hf_init, b_init=a.b_init)
    t_all = time.perf_counter()
    try:
        ra = _run_worker(dict(base, role="A", run_dir=os.path.join(workdir, "A"),
                              final_dir=os.path.join(workdir, "A_final"),
                              result=os.path.join(workdir, "A.json")), workdir, env)
        ckpt = os.path.join(workdir, "A", f"checkpoint-{half}")
        rb = _run_worker(dict(base, role="B", run_dir=os.path.join(workdir, "B"), resume_from=ckpt,
                              final_dir=os.path.join(workdir, "B_final"),
                              result=os.path.join(workdir, "B.json")), workdir, env)

        print("\n=== comparing", flush=True)
        ga = cfg["grad_accum"]
        step_a = {h["step"]: h["loss"] for h in ra["log_history"] if "loss" in h}
        step_b = {h["step"]: h["loss"] for h in rb["log_history"] if "loss" in h and h["step"] > half}
        steps = list(range(half + 1, cfg["steps"] + 1))
        la = [step_a.get(s) for s in steps]
        lb = [step_b.get(s) for s in steps]
        step_diff = _diff(la, lb) if None not in la + lb else {"bit_identical": False, "missing_steps": True}
        micro_diff = _diff(ra["micro_losses"][half * ga:], rb["micro_losses"])
        t = time.perf_counter()
        params_diff = _compare_models(os.path.join(workdir, "A_final", "model.safetensors"),
                                      os.path.join(workdir, "B_final", "model.safetensors"))
        params_diff["compare_s"] = time.perf_counter() - t
        reload = ra["from_pretrained_check"]

        first = [h["loss"] for h in ra["log_history"] if "loss" in h]
        ck = ra.get("checkpoint", {})
        bit = bool(step_diff.get("bit_identical") and micro_diff["bit_identical"] and params_diff["bit_identical"])
        out = {
            "config": dict(cfg, device=device, compute_dtype=compute, seed=a.seed, save_steps=half,
                           max_grad_norm=1.0, lr_scheduler="cosine", weight_decay=0.1, betas=[0.9, 0.95],
                           data="python stdlib *.py, byte tokenizer"),
            "device_name": ra["device_name"],
            "versions": ra["versions"],
            "params": ra["params"]["total"],
            "params_detail": ra["params"],
            "tokens_per_step": ra["tokens_per_step"],
            "losses_A_all_steps": first,
            "steps_compared": steps,
            "losses_A": la,
            "losses_B_resumed": lb,
            "step_loss_diff": step_diff,
            "micro_batch_loss_diff": micro_diff,
            "final_params_diff": params_diff,
            "bit_identical": bit,
            "checkpoint": {
                "step": half,
                "save_s": ra["timings"].get("checkpoint_save_s"),
                "save_hf_model_s": (ra["timings"].get("hf_model_save_s") or [None])[0],
                "save_megatrain_state_s": ra["timings"].get("megatrain_state_save_s"),
                "bytes_total": ck.get("bytes_total"),
                "gib_total": ck["bytes_total"] / 2**30 if ck.get("bytes_total") else None,
                "bytes_megatrain_state": ck.get("bytes_megatrain_state"),
                "bytes_hf_model": ck.get("bytes_hf_model"),
                "files": ck.get("files"),
            },
            "resume": {
                "megatrain_load_s": rb["timings"].get("resume_megatrain_load_s"),
                "rng_load_s": rb["timings"].get("resume_rng_load_s"),
                "train_call_to_first_step_s": rb["timings"].get("train_call_to_first_step_s"),
                "b_init": a.b_init,
            },
            "save_model": {"A_s": ra["timings"].get("save_model_s"), "B_s": rb["timings"].get("save_model_s"),
                           "from_pretrained_check": reload},
            "processes": {
                r["role"]: {"peak_rss_gib": r["peak_rss_gib"], "gpu_peak_gib": r["gpu_peak_gib"],
                            "wall_s": r["subprocess_wall_s"], "timings": r["timings"],
                            "steps_run": r["global_steps_run"], "figures": _figures(r, half + 1 if r["role"] == "B"
                                                                                     else 1)}
                for r in (ra, rb)
            },
            "log_history_A": ra["log_history"],
            "log_history_B": [h for h in rb["log_history"] if h.get("step", 0) > half],
            "total_wall_s": time.perf_counter() - t_all,
        }
    finally:
        if not a.keep:
            if created:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                for sub in ("A", "B", "A_final", "B_final"):
                    shutil.rmtree(os.path.join(workdir, sub), ignore_errors=True)

    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)

    # -- summary
    fa, fb = out["processes"]["A"]["figures"], out["processes"]["B"]["figures"]
    print(f"\nmodel: {out['params'] / 1e9:.3f}B parameters ({out['params']:,}), {out['device_name']}, compute "
          f"{compute}; {cfg['steps']} steps x {out['tokens_per_step']} tokens; checkpoint at step {half}")
    print(f"loss (A): step 1 {_fmt(first[0])} -> step {len(first)} {_fmt(first[-1])}")
    print("step   A loss        B loss (resumed)   |diff|")
    for s, x, y in zip(steps, la, lb):
        print(f"{s:4d}   {_fmt(x, '.8f'):>12}  {_fmt(y, '.8f'):>12}       "
              f"{_fmt(abs(x - y) if None not in (x, y) else None, '.3g')}")
    print(f"per-step loss: max abs diff {_fmt(step_diff.get('max_abs'), '.3g')}, max rel {_fmt(step_diff.get('max_rel'), '.3g')}; "
          f"micro-batch losses: max rel {_fmt(micro_diff['max_rel'], '.3g')}")
    print(f"final parameters: {params_diff['tensors_equal']}/{params_diff['tensors']} tensors equal, max abs diff "
          f"{params_diff['max_abs']:.3g} ({params_diff['worst_tensor']}), max rel (to tensor max) "
          f"{params_diff['max_rel_of_tensor_max']:.3g}")
    print(f"bit-identical: {bit}")
    c = out["checkpoint"]
    print(f"checkpoint-{half}: {_fmt(c['gib_total'], '.2f')} GiB (megatrain state "
          f"{_fmt((c['bytes_megatrain_state'] or 0) / 2**30, '.2f')} GiB, HF model {_fmt((c['bytes_hf_model'] or 0) / 2**30, '.2f')} "
          f"GiB), saved in {_fmt(c['save_s'], '.1f')} s (HF model {_fmt(c['save_hf_model_s'], '.1f')} s, megatrain state "
          f"{_fmt(c['save_megatrain_state_s'], '.1f')} s)")
    r = out["resume"]
    print(f"resume: megatrain checkpoint load {_fmt(r['megatrain_load_s'], '.1f')} s; train() call to first step "
          f"{_fmt(r['train_call_to_first_step_s'], '.1f')} s")
    print(f"save_model: A {_fmt(out['save_model']['A_s'], '.1f')} s; from_pretrained (CPU) {reload['load_s']:.1f} s, "
          f"{reload['params']:,} params, match: {reload['params_match']}")
    for name, f in (("A", fa), ("B", fb)):
        p = out["processes"][name]
        print(f"run {name}: wall {p['wall_s']:.0f} s (model init {p['timings']['model_init_s']:.1f} s, wrap "
              f"{p['timings']['wrap_s']:.1f} s, train() {p['timings']['train_call_s']:.1f} s); step {_fmt(f['step_s_median'], '.3f')} s, "
              f"{_fmt(f['megatrain/tokens_per_s'], '.0f')} tokens/s, {_fmt(f.get('model_tflops'), '.1f')} model TFLOP/s, "
              f"H2D {_fmt(f['megatrain/h2d_gbps'], '.1f')} GB/s, host store {_fmt(f['megatrain/host_store_gib'], '.2f')} GiB, "
              f"peak RSS {p['peak_rss_gib']:.2f} GiB, GPU peak {_fmt(p['gpu_peak_gib'], '.2f')} GiB")
    print(f"total {out['total_wall_s']:.0f} s" + (f"; results in {a.out}" if a.out else ""))

    if not reload["params_match"]:
        print("trainer_resume: FAIL: the saved model's parameter count differs", file=sys.stderr)
        return 1
    if device == "cpu" and compute == "fp32" and not bit:
        print("trainer_resume: FAIL: on the CPU with fp32 the resumed run must equal the uninterrupted one bit for bit",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
