"""End-to-end training benchmark: megatrain vs GPU-resident PyTorch, FSDP2 CPU offload, DeepSpeed ZeRO-2/3.

Every system trains the same Llama-architecture model (same seeded init, same seeded random token
batches) in its OWN subprocess, so the GPU and host memory of one run cannot pollute the next. The
parent never touches CUDA: the bf16 matmul rate (the MFU denominator) is measured in a child too.
A child prints one line ``BENCH_RESULT {json}``; a child that dies without it becomes a row with
status ``error: <its last output line>``.

Systems (all: SDPA attention, AdamW lr 1e-4, betas (0.9, 0.95), weight decay 0.1; ``--max-grad-norm``
(default: none) clips the global gradient norm and ``--grad-accum`` (default 1) accumulates that many
micro-batches per optimizer step in every system, each the way its users do it):

* ``megatrain``       megatrain.wrap(bf16 compute, --mt-policy recompute | block:K) + CPUAdamW;
                      fp32 master weights and Adam state in host memory, layers streamed.
                      ``megatrain:policy=default``: ``megatrain.wrap(model)`` as a user gets it, no
                      placement option passed (``auto`` on CUDA: the planner; Liger-Kernel when
                      installed); ``,liger=0`` / ``,liger=1`` turns Liger off / requires it.
* ``torch_ckpt``      fp32 master weights on the GPU, torch.autocast(bf16), AdamW(fused=True),
                      HF gradient checkpointing (non-reentrant).
* ``torch_nockpt``    the same without gradient checkpointing (CUDA OOM -> status "oom").
                      ``torch_ckpt:liger=1`` / ``torch_nockpt:liger=1``: Liger-Kernel applied to the model
                      first, as ``Trainer(use_liger_kernel=True)`` does (its defaults: RoPE, RMSNorm,
                      SwiGLU, fused linear cross-entropy).
* ``fsdp2_offload``   FSDP2 world size 1: fully_shard(each decoder layer, then root) with
                      CPUOffloadPolicy(pin_memory=True), MixedPrecisionPolicy(bf16 params,
                      fp32 reduce), AdamW(fused=True) on the CPU params (foreach if fused fails),
                      HF gradient checkpointing on.
* ``deepspeed_zero3`` ZeRO-3, offload_param + offload_optimizer to pinned CPU, DeepSpeedCPUAdam,
                      bf16, HF gradient checkpointing on. "unavailable" when deepspeed is missing.
* ``deepspeed_zero2`` ZeRO-Offload: ZeRO-2 with offload_optimizer to pinned CPU (bf16 weights stay on
                      the GPU), DeepSpeedCPUAdam, bf16, HF gradient checkpointing on.

Peers whose code is not in this repository (benchmarks/peers/; never in the default list; each needs
its public source checked out at ``$MEGATRAIN_PEERS_DIR/<name>`` (default ``.peers/<name>``), else its row
is "skipped: ... source not found"; CUDA only). Their rows add ``precision`` (master-weight dtype),
``clips`` and ``clip_support``, read from their code (cited in benchmarks/peers/*.py):

* ``megatrain_official`` github.com/DLYuanGod/MegaTrain: CPUMasterModel as its examples/sft/train.py
                      drives it; bf16 master weights on the CPU, clip_grad_norm_ when --max-grad-norm is
                      given (its trainer always clips at 1.0); DeepSpeedCPUAdam if importable, else
                      torch AdamW (its fallback).
* ``slideformer``     github.com/RegiaYoung/SlideFormer: SlideFormerOffloader as its scripts/main_bench.py
                      drives it; fp32 master weights, per-layer CPU Adam inside backward: it cannot clip
                      (runs unclipped, clips=false) nor accumulate (--grad-accum > 1: skipped).

Clipping: megatrain ``CPUAdamW(max_grad_norm=...)``; torch_* ``clip_grad_norm_`` before ``step()``;
FSDP2 ``clip_grad_norm_`` on the DTensor parameters; DeepSpeed ``gradient_clipping`` in its config.
Accumulation: the loss of each micro-batch is scaled by 1 / grad_accum (DeepSpeed scales it itself).

Timing: ``--warmup`` untimed steps, then ``--steps`` timed steps; each step ends with a device
synchronize. step_mean = wall time of the whole timed window / steps, where the window also
includes draining queued work at its end (megatrain: ``opt.wait()``, so CPU Adam that would spill
past the last step is charged); step_min = fastest single step.

FLOPs (multiply-add = 2 FLOPs), per optimizer step of B sequences of S tokens, T = B*S:

    model_flops = 6 * N * T  +  6 * L * B * S^2 * (H * D)

N = all parameters (input embedding and LM head included), L = decoder
layers, H * D = attention heads x head dim (= hidden size here). The attention term is
QK^T and A.V, 2 matmuls x 2 FLOPs x S^2 x H*D per layer forward = 4*L*B*S^2*H*D, halved for the causal
mask, x3 for forward + backward. Recompute (gradient checkpointing, megatrain's recompute) is NOT
counted: TFLOP/s is model FLOPs / step_mean, MFU = that / measured bf16 matmul rate (8192^3, mean of
10 after 3 warm-ups). Note docs/metrics.md (the trainer's metrics) counts 6 * N_dense, i.e. without
the input embedding; at the 3b preset that is ~3% less.

    python benchmarks/bench_train.py --out docs/benchmarks/train_3b.json          # all systems, 3b
    python benchmarks/bench_train.py --systems megatrain torch_ckpt --mt-policy block:2
    python benchmarks/bench_train.py --systems megatrain:policy=default torch_ckpt torch_ckpt:liger=1 \
        --max-grad-norm 1.0 --out docs/benchmarks/train_3b_clip_defaults_h200.json   # defaults vs PyTorch (+Liger)
    python benchmarks/bench_train.py --sweep tokens --out docs/benchmarks/sweep_tokens.json
    python benchmarks/bench_train.py --sweep depth --out docs/benchmarks/sweep_depth.json
    python benchmarks/bench_train.py --sweep size --out docs/benchmarks/sweep_size.json
    python benchmarks/bench_train.py --preset tiny --device cpu --systems megatrain torch_ckpt \\
        --steps 2 --warmup 1 --out /tmp/b.json                                     # CPU smoke test
    MEGATRAIN_PEERS_DIR=.peers python benchmarks/bench_train.py --systems megatrain torch_ckpt \\
        megatrain_official slideformer --max-grad-norm 1.0 --steps 3 --warmup 1    # with the peers
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time

from bench_common import git_commit, report_child

# peers run from their own public source (benchmarks/peers/, $MEGATRAIN_PEERS_DIR): only when named in --systems
PEER_SYSTEMS = ["megatrain_official", "slideformer"]
DEFAULT_SYSTEMS = ["megatrain", "torch_ckpt", "torch_nockpt", "fsdp2_offload", "deepspeed_zero3", "deepspeed_zero2"]
SYSTEMS = DEFAULT_SYSTEMS + PEER_SYSTEMS
CUDA_ONLY = {"fsdp2_offload", "deepspeed_zero3", "deepspeed_zero2", *PEER_SYSTEMS}
RESULT_TAG = "BENCH_RESULT "

# hidden, layers, intermediate, vocab, heads, kv heads; default batch, seq
PRESETS = {
    # 3.37B params. With --kv-heads 8 (GQA) it is 3.02B.
    "3b": dict(hidden=3072, layers=28, inter=8192, vocab=32000, heads=24, kv_heads=24, batch=4, seq=4096),
    # TinyLlama-1.1B shape; also the width of --sweep depth.
    "1b": dict(hidden=2048, layers=22, inter=5632, vocab=32000, heads=32, kv_heads=4, batch=4, seq=4096),
    # 6.74B params (Llama-2-7B shape).
    "7b": dict(hidden=4096, layers=32, inter=11008, vocab=32000, heads=32, kv_heads=32, batch=4, seq=4096),
    # 8.47B params: the Llama-3-8B shape with 34 decoder layers (GQA, vocab 128256); its fp32 copy beside the host
    # store would not fit a 125 GiB host, so megatrain builds it straight into the store (--mt-build from_config).
    "8b": dict(hidden=4096, layers=34, inter=14336, vocab=128256, heads=32, kv_heads=8, batch=4, seq=4096),
    # ~4M params: CPU smoke test.
    "tiny": dict(hidden=256, layers=4, inter=704, vocab=2048, heads=4, kv_heads=2, batch=2, seq=128),
}
OPT = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
SWEEP_TOKENS = [2048, 4096, 8192, 16384, 32768, 65536]
SWEEP_DEPTHS = [16, 32, 64, 128]
# --sweep size: Llama shapes (vocab 32000, untied); the largest that fits the host runs.
SIZE_SHAPES = {
    "tiny": PRESETS["tiny"],
    "1b": PRESETS["1b"],
    "3b": PRESETS["3b"],
    "7b": {k: v for k, v in PRESETS["7b"].items() if k not in ("batch", "seq")},   # 6.74B
    "13b": dict(hidden=5120, layers=40, inter=13824, vocab=32000, heads=40, kv_heads=40),  # 13.0B
}
SWEEP_SIZES = ["1b", "3b", "7b", "13b"]
# Host bytes per parameter a megatrain child needs at its peak: the host store (fp32 master,
# exp_avg, exp_avg_sq, fp32 gradient accumulator, bf16 compute copy: 18 B; 14 B with acc=0) plus
# the fp32 model built on the CPU before wrap() moves it into the store (4 B).
HOST_BYTES_PER_PARAM = {True: 18 + 4, False: 14 + 4}
GiB = 1024 ** 3


# ----------------------------------------------------------------------------------------------
# shared by the children
# ----------------------------------------------------------------------------------------------

def llama_params(m: dict) -> int:
    """Parameters of a Llama with shape ``m`` (untied embeddings, RMSNorm, no biases)."""
    h, kv = m["hidden"], m["hidden"] // m["heads"] * m["kv_heads"]
    layer = h * h * 2 + h * kv * 2 + 3 * h * m["inter"] + 2 * h
    return m["layers"] * layer + 2 * m["vocab"] * h + h


def model_flops_per_step(n_params: int, m: dict, batch: int, seq: int) -> float:
    head_dim = m["hidden"] // m["heads"]
    return 6.0 * n_params * batch * seq + 6.0 * m["layers"] * batch * seq ** 2 * m["heads"] * head_dim


def llama_config(m: dict, seq: int):
    """The ``transformers.LlamaConfig`` of shape ``m`` (untied embeddings, SDPA attention, no KV cache)."""
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
        max_position_embeddings=max(seq, 2048), tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_model(m: dict, seq: int, init_device: str = "cpu"):
    """fp32 Llama on the CPU, seeded (identical initial weights in every child of a run).

    With ``init_device`` a CUDA device, the weights are created and initialised there (torch's
    CPU ``normal_`` runs at ~0.1 Gparam/s on one core: ~40 s of a 3.4B child's setup) and then moved
    to the CPU, where every system starts from; the GPU memory is released before training.
    """
    import torch
    import transformers
    cfg = llama_config(m, seq)
    torch.manual_seed(0)
    with torch.device(init_device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if str(init_device) != "cpu":
        model = model.to("cpu")
        torch.cuda.empty_cache()
    model.train()
    return model


def make_batches(spec: dict, device):
    import torch
    g = torch.Generator().manual_seed(spec["seed"])
    n = spec["warmup"] + spec["steps"]
    ga = spec.get("grad_accum", 1)
    return [[torch.randint(0, spec["model"]["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
             for _ in range(ga)] for _ in range(n)]


def clip_and_accum(spec: dict):
    """(max_grad_norm or None, grad_accum) of a child's spec."""
    return spec.get("max_grad_norm"), spec.get("grad_accum", 1)


def timed_loop(step, batches, spec, sync, drain=lambda: None, on_window=None):
    """Run warmup + timed steps. step(micro_batches) -> detached loss of the last micro-batch. Returns timing dict.

    on_window(\"start\"|\"end\") is called just before the timed window and after it is drained."""
    import torch
    warmup = spec["warmup"]
    times, loss = [], None
    t_win = None
    setup_peak = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # setup transients (e.g. a model moved to the GPU before being sharded) are not training memory
        sync()
        setup_peak = torch.cuda.max_memory_allocated() / GiB
        torch.cuda.reset_peak_memory_stats()
    for i, x in enumerate(batches):
        if i == warmup:
            drain()
            sync()
            if on_window:
                on_window("start")
            t_win = time.perf_counter()
        t0 = time.perf_counter()
        loss = step(x)
        sync()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
        print(f"step {i} {'timed' if i >= warmup else 'warmup'} {dt:.3f} s", file=sys.stderr, flush=True)
    drain()
    sync()
    window = time.perf_counter() - t_win
    if on_window:
        on_window("end")
    return dict(step_s=window / len(times), step_min_s=min(times), step_times_s=times,
                window_s=window, loss=float(loss), gpu_setup_peak_gib=setup_peak)


def profile_steps(step, batches, spec) -> dict:
    """Run ``len(batches)`` more steps under torch.profiler (CPU + CUDA) and summarise the last one.

    The first profiled step is a warm-up of the profiler; the trace of the last step (between
    device synchronizations) is summarised by benchmarks/trace_summary.py: stream overlap, compute
    idle gaps, host synchronizations per thread. Profiled steps are slower: not timed.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from trace_summary import summarize
    path = os.path.join(spec.get("trace_dir") or "/tmp", f"trace_{spec['system'].replace(':', '_')}.json")
    n = len(batches)
    # Export from on_trace_ready, when the active step ends: after the with-block the profiler has
    # begun a new (empty) cycle, and an export there held no GPU events (seen on the H200).
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 schedule=schedule(wait=0, warmup=n - 1, active=1, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for x in batches:
            step(x)
            torch.cuda.synchronize()
            prof.step()
    with open(path) as f:
        trace = json.load(f)
    try:
        out = summarize(trace)
    except ValueError as e:  # e.g. no CUPTI activity in this environment: keep the row's timings
        cats = collections.Counter(ev.get("cat") for ev in trace.get("traceEvents", []))
        out = dict(error=str(e), event_categories=dict(cats.most_common(12)))
    out["trace"] = path
    return out


def worker_timeline_row(eng, step=None) -> "dict | None":
    """The engine's worker timeline of optimizer step ``step`` (else, or when it is not complete, of the
    last complete step: ``eng.worker_timeline()``) with its summary (``megatrain.runtime.engine.timeline.
    timeline_summary``: totals per kind, longest waits, update span; seconds from the step's begin),
    or None where the engine has no timeline."""
    if not hasattr(eng, "worker_timeline"):
        return None
    from megatrain.runtime.engine.timeline import timeline_summary
    events = (eng.worker_timeline(step) if step is not None else []) or eng.worker_timeline()
    step = next((e.get("step") for e in events if e["kind"] == "step_begin"), None)
    return dict(step=step, **timeline_summary(events), events=events)


def print_worker_timeline(wt: dict) -> None:
    """Three or four lines of a row's ``worker_timeline`` (:func:`worker_timeline_row`), in ms from the step's begin."""
    if wt.get("error"):
        print(f"  worker timeline: failed: {wt['error']}")
        return
    if not wt.get("events"):
        print("  worker timeline: no complete step recorded")
        return

    def ms(v):
        return fmt(None if v is None else v * 1e3, "{:.1f}")

    m, n, tot = wt["marks"], wt["counts"], wt["totals_s"]
    bwd, first = m.get("backward_end"), wt["update_first_start_s"]
    gap = "" if bwd is None or first is None else \
        f", first update {ms(abs(first - bwd))} ms {'after' if first >= bwd else 'before'} backward_end"
    print(f"  worker timeline of step {wt['step']} (ms from its first forward): backward_end +{ms(bwd)}, "
          f"step_end +{ms(m.get('step_end'))}")
    print(f"  {n['update']} updates busy {ms(tot['update'])} ms, spanning {ms(wt['update_span_s'])} ms "
          f"(+{ms(first)} .. +{ms(wt['update_last_end_s'])}){gap}; {n['grad']} gradient tasks busy {ms(tot['grad'])} ms")
    waits = ", ".join(f"unit {w['unit'] if w['unit'] is not None else 'all'} {ms(w['dur_s'])} ms at +{ms(w['start_s'])}"
                      for w in wt["longest_waits"][:4])
    print(f"  main thread waited for updates {n['wait']} times, {ms(tot['wait'])} ms in all; longest: {waits or '-'}")


def _device_sync(device):
    import torch
    if str(device).startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


# ----------------------------------------------------------------------------------------------
# one function per system: (spec) -> partial row (timing, settings, extras)
# ----------------------------------------------------------------------------------------------

# megatrain variant options that are fields of megatrain.runtime.options.Options (the "before" of a ratio)
VARIANT_OPTIONS = {"overlap": "overlap", "d2h": "d2h_overlap", "eager": "eager_updates", "threads": "adam_threads",
                   "fusednorm": "fused_grad_norms", "cslots": "cpp_slots", "replan": "replan"}


def megatrain_variant(name: str) -> dict:
    """``megatrain[:key=value,...]`` -> options. Keys: ``slots`` (num_slots), ``policy``
    (activation_policy), ``overlap`` (0: ``Options.overlap=False``, updates never overlap the next forward),
    ``d2h`` (0: ``Options.d2h_overlap=False``, the compute stream waits for each layer's gradient D2H),
    ``eager`` (0: ``Options.eager_updates=False``, no update starts during backward: all wait for step()),
    ``threads`` (``Options.adam_threads``: CPU threads of the fused Adam), ``fusednorm`` (0:
    ``Options.fused_grad_norms=False``, one norm launch per gradient tensor instead of one per layer), ``cslots``
    (0: ``Options.cpp_slots=False``, the slot pool and the H2D / D2H copies in Python on torch streams), ``replan``
    (0: ``Options.replan=False``, the planner does not place again after the first step), ``acc`` (0:
    ``wrap(grad_accumulator=False)``, 14 instead of 18 host bytes per parameter; one micro-batch per step),
    ``policy=default``: no ``activation_policy`` passed, nor any option not given in the name (``wrap``'s defaults:
    ``auto`` on CUDA), ``liger`` (0 / 1: ``wrap(liger_kernel=False / True)``; absent: not passed, so Liger-Kernel
    is used when installed, on CUDA), ``devstate`` (``wrap(device_state_layers=K)``: layers 0..K-1 keep their whole training state on the
    GPU and are updated there; ``auto``: as many as fit; ``boundary``: the resident unit and layer 0, wrap's
    default on CUDA under the policies other than ``auto``; ``0``: none), ``lean`` (1:
    ``wrap(lean_activations=True)``, the norms and the gated MLP keep less for backward and recompute it), ``hcc``
    (0 / 1: ``wrap(host_compute_copy=False / True)``: 0 keeps no bf16 compute copy in the host store, every layer
    master-streamed at 12 host bytes per parameter, its weights cast on the GPU from the streamed fp32 master;
    1: every layer keeps its compute copy, 14 bytes; absent: not passed, wrap's ``"auto"``).

    Raises:
        ValueError: an unknown key or a malformed option.
    """
    base, _, rest = name.partition(":")
    opts = {}
    for kv in filter(None, rest.split(",")):
        k, sep, v = kv.partition("=")
        if not sep or k not in ("slots", "policy", "acc", "devstate", "lean", "liger", "hcc", *VARIANT_OPTIONS):
            raise ValueError(f"bad megatrain variant option {kv!r} in {name!r}: "
                             "use slots=N, policy=P|default, overlap=0|1, d2h=0|1, eager=0|1, threads=N, fusednorm=0|1, cslots=0|1, replan=0|1, acc=0|1, "
                             "devstate=K|auto|boundary, lean=0|1, liger=0|1, hcc=0|1")
        if k in ("liger", "hcc") and v not in ("0", "1"):
            raise ValueError(f"bad megatrain variant option {kv!r} in {name!r}: {k} is 0 or 1")
        if k == "devstate" and v not in ("auto", "boundary") and not v.isdigit():
            raise ValueError(f"bad megatrain variant option {kv!r} in {name!r}: devstate is a layer count, 'auto' "
                             "or 'boundary'")
        opts[k] = v
    return opts


def run_megatrain(spec):
    import torch
    opts = megatrain_variant(spec["system"])
    import megatrain
    from megatrain.runtime.options import set_options

    changes = {f: (max(1, int(opts[k])) if f == "adam_threads" else opts[k] != "0")
               for k, f in VARIANT_OPTIONS.items() if k in opts}
    mo = set_options(**changes)  # read by the engine when wrap() builds it
    dev = spec["device"]
    default = opts.get("policy") == "default"  # wrap(model) as a user gets it: only the options named
    policy = None if default else opts.get("policy", spec["mt_policy"])
    slots = int(opts.get("slots", 2))
    accumulator = opts.get("acc", "1") != "0"
    lean = opts.get("lean", "0") != "0"
    devstate = opts.get("devstate")  # None: wrap's default (the planner under policy=auto, else "boundary" on CUDA)
    devstate = devstate if devstate in (None, "auto", "boundary") else int(devstate)
    liger = None if "liger" not in opts else opts["liger"] == "1"
    wrap_kw = dict(activation_policy=policy, num_slots=slots, grad_accumulator=accumulator, device_state_layers=devstate,
                   lean_activations=lean, liger_kernel=liger)
    if "hcc" in opts:
        wrap_kw["host_compute_copy"] = opts["hcc"] == "1"
    if default:  # no placement option passed unless the system's name gives it
        named = {"slots": "num_slots", "acc": "grad_accumulator", "devstate": "device_state_layers",
                 "lean": "lean_activations", "liger": "liger_kernel", "hcc": "host_compute_copy"}
        wrap_kw = {w: wrap_kw[w] for k, w in named.items() if k in opts}
    elif liger is None:
        del wrap_kw["liger_kernel"]
    clip, ga = clip_and_accum(spec)
    cdt = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    settings = dict(compute_dtype=spec["dtype"], activation_policy=policy or "wrap default", num_slots=slots,
                    grad_accumulator=accumulator, device_state_layers=devstate, lean_activations=lean,
                    overlap=mo.overlap, d2h_overlap=mo.d2h_overlap, eager_updates=mo.eager_updates,
                    fused_grad_norms=mo.fused_grad_norms, cpp_slots=mo.cpp_slots, adam_threads=mo.adam_threads or "torch default",
                    optimizer="megatrain.optim.CPUAdamW", max_grad_norm=clip, grad_accum=ga, **OPT,
                    state="fp32 master + Adam m/v in host memory, layers streamed to GPU")
    if spec.get("mt_build") == "from_config":  # straight into the host store (no fp32 copy on the host first)
        cfg = llama_config(spec["model"], spec["seq"])
        model = megatrain.from_config(cfg, seed=0, init_device=dev, device=dev, compute_dtype=cdt, **wrap_kw)
        n_params = model.megatrain.stats()["num_params"]
    else:
        model = build_model(spec["model"], spec["seq"], spec["device"])
        n_params = sum(p.numel() for p in model.parameters())
        model = megatrain.wrap(model, device=dev, compute_dtype=cdt, **wrap_kw)
    eng = model.megatrain
    settings.update(wrap_kwargs={k: str(v) for k, v in wrap_kw.items()}, activation_policy=eng.activation_policy,
                    build=spec.get("mt_build", "wrap"),
                    liger_kernel=eng.placement().get("liger_kernel"))
    if default:
        settings.update(num_slots=eng.num_slots, grad_accumulator=eng.accumulator_mode)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"],
                                   weight_decay=OPT["weight_decay"], max_grad_norm=clip,
                                   gradient_accumulation_steps=ga)
    batches = make_batches(spec, dev)
    snaps = {}

    def step(xs):
        for x in xs:
            loss = model(input_ids=x, labels=x).loss
            (loss / ga).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    def on_window(which):
        snaps[which] = eng.stats()

    try:
        r = timed_loop(step, batches, spec, _device_sync(dev), drain=opt.wait, on_window=on_window)
        placement = eng.placement()
        lc = getattr(eng, "long_context", None)  # what the last timed step chunked / tiled (from free memory)
        tiling = {k: v for k, v in lc.last.items() if k != "tokens"} if lc is not None else None
        if spec.get("profile") and dev.startswith("cuda"):
            timeline = hasattr(eng, "set_worker_timeline")  # megatrain.runtime.engine.timeline (Options.worker_timeline)
            first = opt.steps_called + 1  # the first profiled step
            if timeline:
                eng.set_worker_timeline(True)
            try:  # after the timed window: a profiler problem must not lose the timings
                r["profile"] = profile_steps(step, batches[-2:], spec)
            except Exception as e:
                r["profile"] = dict(error=f"{type(e).__name__}: {e}")
            if timeline:
                try:  # the first profiled step: with the second one's forward waiting for its updates
                    r["worker_timeline"] = worker_timeline_row(eng, first)
                except Exception as e:
                    r["worker_timeline"] = dict(error=f"{type(e).__name__}: {e}")
                eng.set_worker_timeline(False)
    finally:
        eng.close()
    a, b = snaps["start"], snaps["end"]
    d = {k: b[k] - a[k] for k in ("h2d_bytes", "d2h_bytes", "h2d_time_s", "d2h_time_s",
                                  "adam_time_s", "adam_exposed_s")}
    w = r["window_s"]
    n = spec["steps"]
    r["megatrain"] = dict(
        h2d_gb_per_step=d["h2d_bytes"] / n / 1e9, d2h_gb_per_step=d["d2h_bytes"] / n / 1e9,
        h2d_gbps_wall=d["h2d_bytes"] / w / 1e9, d2h_gbps_wall=d["d2h_bytes"] / w / 1e9,
        h2d_gbps_copy=d["h2d_bytes"] / d["h2d_time_s"] / 1e9 if d["h2d_time_s"] > 0 else None,
        d2h_gbps_copy=d["d2h_bytes"] / d["d2h_time_s"] / 1e9 if d["d2h_time_s"] > 0 else None,
        adam_s_per_step=d["adam_time_s"] / n, adam_exposed_s_per_step=d["adam_exposed_s"] / n,
        host_store_gib=b["host_store_bytes"] / GiB, pinned_gib=b["pinned_bytes"] / GiB,
        bytes_per_param=b["bytes_per_param"],
        device_state_layers=b.get("device_state_layers", 0),
        master_streamed_layers=len(placement.get("master_streamed_layers") or []),
        device_state_gib=b.get("device_state_bytes", 0) / GiB,
        auto_decisions=[dict(v, input_shapes=str(k)) for k, v in getattr(eng, "auto_decisions", {}).items()],
        replan=placement.get("replan"), long_context_last=tiling)
    r.update(settings=settings, n_params=n_params)
    return r


def torch_variant(name: str) -> dict:
    """``torch_ckpt[:liger=0|1]`` / ``torch_nockpt[:liger=0|1]`` -> options (``liger``: Liger-Kernel applied first).

    Raises:
        ValueError: an unknown key or value.
    """
    base, _, rest = name.partition(":")
    opts = {}
    for kv in filter(None, rest.split(",")):
        k, sep, v = kv.partition("=")
        if not sep or k != "liger" or v not in ("0", "1"):
            raise ValueError(f"bad {base} variant option {kv!r} in {name!r}: use liger=0|1")
        opts[k] = v
    return opts


def apply_liger(model) -> str:
    """Liger-Kernel on a plain model, as ``Trainer(use_liger_kernel=True)`` applies it (Liger's defaults)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    import importlib.metadata

    _apply_liger_kernel_to_instance(model=model)
    return importlib.metadata.version("liger-kernel")


def run_torch(spec, ckpt: bool):
    import torch
    liger = torch_variant(spec["system"]).get("liger") == "1"
    dev = spec["device"]
    dtype = "cuda" if dev.startswith("cuda") else "cpu"
    import contextlib
    bf16 = spec["dtype"] == "bf16"
    clip, ga = clip_and_accum(spec)
    settings = dict(master="fp32 on device", autocast="bf16" if bf16 else "off (fp32)", optimizer="torch.optim.AdamW(fused=True)", **OPT,
                    gradient_checkpointing="HF, use_reentrant=False" if ckpt else "off",
                    max_grad_norm=clip, grad_accum=ga, clipping="torch.nn.utils.clip_grad_norm_" if clip else "off")
    model = build_model(spec["model"], spec["seq"], spec["device"])
    n_params = sum(p.numel() for p in model.parameters())
    settings.update(liger_kernel=apply_liger(model) if liger else None)  # (its version)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **OPT)
    batches = make_batches(spec, dev)

    def step(xs):
        for x in xs:
            with torch.autocast(dtype, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                loss = model(input_ids=x, labels=x).loss
            (loss / ga).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    r = timed_loop(step, batches, spec, _device_sync(dev))
    r.update(settings=settings, n_params=n_params)
    return r


def _init_single_rank_pg(backend: str):
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=0, world_size=1)


FSDP2_HOST_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, exp_avg, exp_avg_sq: all on the host with CPU offload


def run_fsdp2(spec):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from megatrain.runtime.placement.host_memory import host_memory_limits
    need = FSDP2_HOST_BYTES_PER_PARAM * llama_params(spec["model"])
    avail = host_memory_limits().get("mem_available_bytes")
    if avail is not None and need > avail:  # it would page-lock past the host's memory (3.37B measured 63.6 GiB peak)
        return dict(status=f"skipped: FSDP2 CPU offload keeps {FSDP2_HOST_BYTES_PER_PARAM} B/param of fp32 state on the "
                    f"host, {need / GiB:.1f} GiB; {avail / GiB:.1f} GiB available", n_params=llama_params(spec["model"]))
    torch.cuda.set_device(0)
    _init_single_rank_pg("cpu:gloo,cuda:nccl")
    model = build_model(spec["model"], spec["seq"], spec["device"])
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    clip, ga = clip_and_accum(spec)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    settings = dict(world_size=1, fully_shard="each decoder layer, then root",
                    offload_policy="CPUOffloadPolicy(pin_memory=True)",
                    mp_policy="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
                    reshard_after_forward="default (True)", gradient_checkpointing="HF, use_reentrant=False",
                    optimizer="torch.optim.AdamW(fused=True) on CPU params", **OPT,
                    max_grad_norm=clip, grad_accum=ga, clipping="torch.nn.utils.clip_grad_norm_ (DTensor)" if clip else "off")
    state = {"opt": torch.optim.AdamW(model.parameters(), fused=True, **OPT)}
    batches = make_batches(spec, "cuda")

    def step(xs):
        for x in xs:
            loss = model(input_ids=x, labels=x).loss
            (loss / ga).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        try:
            state["opt"].step()
        except Exception as e:  # fused CPU AdamW on DTensors not supported in this build: foreach
            if settings["optimizer"].startswith("torch.optim.AdamW(foreach"):
                raise
            print(f"fused AdamW failed ({type(e).__name__}: {e}); falling back to foreach", file=sys.stderr)
            state["opt"] = torch.optim.AdamW(model.parameters(), foreach=True, **OPT)
            settings["optimizer"] = f"torch.optim.AdamW(foreach=True) on CPU params (fused failed: {type(e).__name__})"
            state["opt"].step()
        state["opt"].zero_grad(set_to_none=True)
        return loss.detach()

    try:
        r = timed_loop(step, batches, spec, torch.cuda.synchronize)
    finally:
        dist.destroy_process_group()
    r.update(settings=settings, n_params=n_params)
    return r


def deepspeed_host_need(m: dict, stage: int) -> int:
    """Host bytes DeepSpeed's own estimator gives for model shape ``m`` with CPU offload on 1 GPU.

    ``estimate_zero2_model_states_mem_needs`` (optimizer offload) or
    ``estimate_zero3_model_states_mem_needs`` (parameter + optimizer offload, ``zero_init=False``: the
    model is built before ``deepspeed.initialize``), with their default buffer factor 1.5. At 3.37B
    they give 75.3 / 84.7 GiB where the H200 runs measured 67.3 / 79.0 GiB of peak host RSS.
    """
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    n = llama_params(m)
    if stage == 2:
        return estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=1, cpu_offload=True)[0]
    h = m["hidden"]
    largest = max(m["vocab"] * h, h * m["inter"])  # the largest single module's parameters
    return estimate_zero3_model_states_mem_needs(n, largest, num_gpus_per_node=1, cpu_offload=True,
                                                 cpu_offload_params=True, zero_init=False)[0]


def run_deepspeed(spec, stage: int):
    import importlib.util
    if importlib.util.find_spec("deepspeed") is None:
        return dict(status="unavailable: deepspeed not installed")
    import torch
    import deepspeed
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from megatrain.runtime.placement.host_memory import host_memory_limits
    need, avail = deepspeed_host_need(spec["model"], stage), host_memory_limits().get("mem_available_bytes")
    if avail is not None and need > avail:  # it would page-lock past the host's memory and thrash for minutes
        return dict(status=f"skipped: DeepSpeed's own estimate (estimate_zero{stage}_model_states_mem_needs, "
                    f"CPU offload, 1 GPU) is {need / GiB:.1f} GiB of host memory; {avail / GiB:.1f} GiB available",
                    n_params=llama_params(spec["model"]))
    torch.cuda.set_device(0)
    _init_single_rank_pg("nccl")
    deepspeed.init_distributed(dist_backend="nccl")
    clip, ga = clip_and_accum(spec)
    zero2 = {  # ZeRO-Offload: the bf16 weights and gradients stay on the GPU, the fp32 optimizer on the CPU
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 5e8,
    }
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": ga,
        "gradient_clipping": float(clip or 0.0),
        "bf16": {"enabled": True},
        "zero_optimization": zero2 if stage == 2 else {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e8,
            "stage3_param_persistence_threshold": 1e6,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "sub_group_size": 1e9,
        },
        "wall_clock_breakdown": False,
        "steps_per_print": 10 ** 9,
    }
    model = build_model(spec["model"], spec["seq"], spec["device"])
    n_params = sum(p.numel() for p in model.parameters())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = DeepSpeedCPUAdam(model.parameters(), lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"],
                           weight_decay=OPT["weight_decay"], adamw_mode=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    batches = make_batches(spec, engine.device)

    def step(xs):
        for x in xs:  # DeepSpeed scales the loss by 1 / gradient_accumulation_steps and steps at the boundary
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        return loss.detach()

    r = timed_loop(step, batches, spec, torch.cuda.synchronize)
    r.update(settings=dict(deepspeed=deepspeed.__version__, optimizer="DeepSpeedCPUAdam(adamw_mode=True)",
                           gradient_checkpointing="HF, use_reentrant=False", **OPT, config=ds_config),
             n_params=n_params)
    return r


def run_peer(spec):
    """A peer of benchmarks/peers/ (its source under $MEGATRAIN_PEERS_DIR), driven in this child process."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import peers
    return peers.run(spec, sys.modules[__name__])


def run_matmul(spec):
    """bf16 8192^3 matmul rate on CUDA: mean of 10 after 3 warm-ups."""
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 10
    return dict(status="ok", matmul_tflops=2 * n ** 3 / dt / 1e12, gpu=torch.cuda.get_device_name(0))


def child_main(spec: dict) -> None:
    name = spec["system"]
    OPT["lr"] = spec.get("lr", OPT["lr"])  # every system reads OPT
    row = dict(system=name, status="ok")
    fn = {"torch_ckpt": lambda s: run_torch(s, True),
          "torch_nockpt": lambda s: run_torch(s, False), "fsdp2_offload": run_fsdp2,
          "deepspeed_zero3": lambda s: run_deepspeed(s, 3), "deepspeed_zero2": lambda s: run_deepspeed(s, 2),
          "matmul": run_matmul, **{p: run_peer for p in PEER_SYSTEMS}}.get(name.partition(":")[0], run_megatrain)
    report_child(row, lambda: fn(spec), spec["device"], RESULT_TAG)


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------

def peer_skip_reason(spec: dict) -> str | None:
    """``"skipped: ..."`` for a peer system whose source is missing or that cannot run ``spec``, else None."""
    if spec["system"] not in PEER_SYSTEMS:
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import peers
    from megatrain.runtime.placement.host_memory import host_memory_limits
    return (peers.skip_reason(spec["system"], spec)
            or peers.host_skip_reason(spec["system"], llama_params(spec["model"]),
                                      host_memory_limits().get("mem_available_bytes")))


def spawn(spec: dict, timeout: float) -> dict:
    """Run one child; stream its output (prefixed) to stderr; parse its BENCH_RESULT line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    tag = spec["system"]
    print(f"==== {tag}: batch {spec['batch']} x seq {spec['seq']}, {spec['model']['layers']} layers", file=sys.stderr)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, bufsize=1)
    tail = collections.deque(maxlen=50)
    result = {}

    def reader():
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT_TAG):
                result.update(json.loads(line[len(RESULT_TAG):]))
            else:
                tail.append(line)
                print(f"  [{tag}] {line}", file=sys.stderr, flush=True)

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child's own session/process group
        rc = proc.wait()
        result.setdefault("status", f"error: timeout after {timeout:.0f} s")
    th.join(timeout=10)
    result.setdefault("system", tag)
    if not result:
        last = next((l.strip() for l in reversed(tail) if l.strip()), "")
        if rc < 0:
            why = f"killed by signal {-rc}" + (" (host OOM killer?)" if rc == -signal.SIGKILL else "")
            last = f"{why}; last output: {last}" if last else why
        result = dict(system=tag, status=f"error: {last or f'exit code {rc}'}"[:300])
    result["child_wall_s"] = time.perf_counter() - t0
    return result


def finish_row(row: dict, spec: dict, peak_tflops: float | None) -> dict:
    m = spec["model"]
    row.update(batch=spec["batch"], seq=spec["seq"], layers=m["layers"], hidden=m["hidden"],
               grad_accum=spec.get("grad_accum", 1), max_grad_norm=spec.get("max_grad_norm"),
               tokens_per_step=spec["batch"] * spec["seq"] * spec.get("grad_accum", 1))
    if row.get("status") == "ok" and "step_s" in row:
        fl = model_flops_per_step(row["n_params"], m, spec["batch"], spec["seq"]) * spec.get("grad_accum", 1)
        row["model_flops_per_step"] = fl
        row["tokens_per_s"] = row["tokens_per_step"] / row["step_s"]
        row["model_tflops"] = fl / row["step_s"] / 1e12
        row["mfu"] = row["model_tflops"] / peak_tflops if peak_tflops else None
    return row


def machine_info() -> dict:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024 / GiB
    except OSError:
        pass
    return dict(host=platform.node(), cpu=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), host_mem_gib=mem, python=platform.python_version())


def versions() -> dict:
    import importlib.metadata as md
    out = {}
    for p in ("torch", "transformers", "megatrain", "deepspeed"):
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def fmt(v, f="{:.3f}"):
    return "-" if v is None else f.format(v)


def print_table(rows: list, extra_key: str | None = None) -> None:
    head = ["system"] + ([extra_key] if extra_key else []) + \
        ["step s", "min s", "tokens/s", "TFLOP/s", "MFU", "GPU GiB", "host GiB", "loss", "status"]
    lines = [head]
    for r in rows:
        lines.append([r["system"]] + ([str(r.get(extra_key))] if extra_key else []) + [
            fmt(r.get("step_s")), fmt(r.get("step_min_s")), fmt(r.get("tokens_per_s"), "{:.0f}"),
            fmt(r.get("model_tflops"), "{:.1f}" if (r.get("model_tflops") or 0) >= 10 else "{:.3g}"), fmt(r.get("mfu"), "{:.1%}"),
            fmt(r.get("gpu_peak_gib"), "{:.1f}"), fmt(r.get("host_peak_gib"), "{:.1f}"),
            fmt(r.get("loss"), "{:.4f}"), str(r.get("status"))[:70]])
    w = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for i, l in enumerate(lines):
        print("  ".join(c.ljust(w[j]) for j, c in enumerate(l)))
        if i == 0:
            print("  ".join("-" * x for x in w))


def ratios(rows: list) -> list:
    """Each other row against the ``megatrain`` row (or, without one, the first megatrain variant run,
    e.g. ``megatrain:policy=default``): tokens/s and GPU peak ratios."""
    ok = [r for r in rows if r.get("status") == "ok"]
    mt = next((r for r in ok if r["system"] == "megatrain"), None) or next(
        (r for r in ok if r["system"].startswith("megatrain:")), None)  # not the megatrain_official peer
    out = []
    if mt is None:
        return out
    for r in ok:
        if r is mt:  # other variants: the "before" of a ratio
            continue
        gpu = (mt["gpu_peak_gib"] / r["gpu_peak_gib"]) if mt.get("gpu_peak_gib") and r.get("gpu_peak_gib") else None
        out.append(dict(megatrain=mt["system"], peer=r["system"], throughput_ratio=mt["tokens_per_s"] / r["tokens_per_s"],
                        gpu_memory_ratio=gpu))
    return out


def plot_bars(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s (higher is better)"),
                           (axes[1], "gpu_peak_gib", "GPU peak allocated, GiB")):
        vals = [r.get(key) or 0.0 if r.get("status") == "ok" else 0.0 for r in rows]
        bars = ax.bar(names, vals, color=["C1" if n == "megatrain" else "C0" for n in names])
        for b, r, v in zip(bars, rows, vals):
            txt = f"{v:.0f}" if key == "tokens_per_s" else f"{v:.1f}"
            ax.annotate(txt if r.get("status") == "ok" else str(r.get("status")).split(":")[0],
                        (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(rows: list, path: str, xkey: str, xlabel: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("tokens_per_s", "tokens/s"), ("model_tflops", "model TFLOP/s"), ("gpu_peak_gib", "GPU peak GiB"))
    for ax, (key, label) in zip(axes, panels):
        for sysname in dict.fromkeys(r["system"] for r in rows):
            pts = [(r[xkey], r[key]) for r in rows if r["system"] == sysname and r.get("status") == "ok"
                   and r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=sysname)
            for r in rows:  # mark failures on the x axis
                if r["system"] == sysname and r.get("status") != "ok":
                    ax.plot([r[xkey]], [0], marker="x", color="red")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_title(label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def system_name(text: str) -> str:
    """argparse type: a peer name, or ``megatrain[:options]`` (checked by ``megatrain_variant``)."""
    if text in SYSTEMS:
        return text
    if text.startswith("megatrain:"):
        try:
            megatrain_variant(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
        return text
    if text.startswith(("torch_ckpt:", "torch_nockpt:")):
        try:
            torch_variant(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
        return text
    raise argparse.ArgumentTypeError(f"unknown system {text!r}: choose from {', '.join(SYSTEMS)}, megatrain:OPTIONS or "
                                     "torch_ckpt:liger=1 / torch_nockpt:liger=1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: 3b (--sweep depth: 1b)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--kv-heads", type=int, help="override the preset's KV heads (3b preset: 24)")
    ap.add_argument("--batch", type=int, help="sequences per step (preset default: 4; tiny: 2)")
    ap.add_argument("--seq", type=int, help="sequence length (preset default: 4096; tiny: 128)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    ap.add_argument("--systems", nargs="+", type=system_name, default=None,
                    help=f"default: {' '.join(DEFAULT_SYSTEMS)} (sweeps: megatrain torch_ckpt / megatrain); "
                         f"any of {', '.join(SYSTEMS)}, or a megatrain variant such as "
                         "megatrain:slots=3 / megatrain:overlap=0 / megatrain:policy=block:2. The peers "
                         f"{' and '.join(PEER_SYSTEMS)} run only when named, from their public source at "
                         "$MEGATRAIN_PEERS_DIR/<name> (default .peers/<name>; missing: a skipped row)")
    ap.add_argument("--mt-policy", default="recompute", help="megatrain activation_policy: recompute | block:K")
    ap.add_argument("--mt-build", choices=["wrap", "from_config"], default=None,
                    help="megatrain rows: wrap(model) of the fp32 model built on the host (default), or "
                         "megatrain.from_config straight into the host store (default for --preset 8b, whose fp32 "
                         "copy beside the store would not fit a 125 GiB host)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"],
                    help="compute dtype of megatrain / autocast of torch_* (default: bf16 on cuda, fp32 on cpu, "
                         "where bf16 matmuls are emulated and very slow); fsdp2/deepspeed always bf16")
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: megatrain and torch_* only; smoke test)")
    ap.add_argument("--sweep", choices=["tokens", "depth", "size"],
                    help="tokens: 2K..64K tokens/step; depth: 16..128 layers at 1b width; size: Llama 1b/3b/7b/13b "
                         "shapes, those whose host memory need exceeds the machine's recorded as skipped")
    ap.add_argument("--sizes", nargs="+", choices=sorted(SIZE_SHAPES), default=SWEEP_SIZES)
    ap.add_argument("--depths", type=int, nargs="+", default=SWEEP_DEPTHS)
    ap.add_argument("--tokens", type=int, nargs="+", default=SWEEP_TOKENS)
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip the global gradient norm to this in every system (default: no clipping)")
    ap.add_argument("--lr", type=float, default=OPT["lr"], help="AdamW learning rate of every system")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step in every system")
    ap.add_argument("--peak-tflops", type=float, help="MFU denominator instead of the measured matmul rate")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token batches")
    ap.add_argument("--profile", action="store_true",
                    help="megatrain rows: profile one extra step, add a stream-overlap / idle-gap / host-sync summary "
                         "and the CPU worker's timeline of a step (row['worker_timeline'])")
    ap.add_argument("--child-timeout", type=float, default=1800, help="seconds per child before it is killed")
    ap.add_argument("--out", help="JSON path; a PNG with the same basename is written next to it")
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args._child:
        child_main(json.loads(args._child))
        return

    cuda = args.device.startswith("cuda")
    preset = args.preset or ("1b" if args.sweep == "depth" else "3b")
    p = dict(PRESETS[preset])
    if args.layers:
        p["layers"] = args.layers
    if args.kv_heads:
        p["kv_heads"] = args.kv_heads
    model = {k: p[k] for k in ("hidden", "layers", "inter", "vocab", "heads", "kv_heads")}
    batch, seq = args.batch or p["batch"], args.seq or p["seq"]
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.grad_accum < 1 or (args.max_grad_norm is not None and not args.max_grad_norm > 0):
        ap.error("--grad-accum must be >= 1 and --max-grad-norm > 0")
    base = dict(device=args.device, dtype=dtype, steps=args.steps, warmup=args.warmup, seed=args.seed, mt_policy=args.mt_policy,
                profile=args.profile, max_grad_norm=args.max_grad_norm, grad_accum=args.grad_accum, lr=args.lr,
                mt_build=args.mt_build or ("from_config" if preset == "8b" else "wrap"))

    peak, gpu = args.peak_tflops, None
    if cuda:
        mm = spawn(dict(base, system="matmul", model=model, batch=0, seq=0), 600)
        gpu = mm.get("gpu")
        print(f"bf16 8192^3 matmul: {fmt(mm.get('matmul_tflops'), '{:.1f}')} TFLOP/s on {gpu} ({mm.get('status')})")
        if peak is None:
            peak = mm.get("matmul_tflops")
        matmul = mm.get("matmul_tflops")
    else:
        matmul = None

    # the list of (spec) to run
    if args.sweep == "tokens":
        systems = args.systems or ["megatrain", "torch_ckpt"]
        specs = []
        for t in args.tokens:
            s = min(seq, t)
            specs += [dict(base, system=n, model=model, batch=max(1, t // s), seq=s) for n in systems]
    elif args.sweep == "depth":
        systems = args.systems or ["megatrain"]
        specs = [dict(base, system=n, model=dict(model, layers=L), batch=batch, seq=seq)
                 for L in args.depths for n in systems]
    elif args.sweep == "size":
        systems = args.systems or ["megatrain"]
        specs = [dict(base, system=n, size=name,
                      model={k: SIZE_SHAPES[name][k] for k in ("hidden", "layers", "inter", "vocab", "heads", "kv_heads")},
                      batch=batch, seq=seq) for name in args.sizes for n in systems]
    else:
        systems = args.systems or DEFAULT_SYSTEMS
        specs = [dict(base, system=n, model=model, batch=batch, seq=seq) for n in systems]

    rows = []
    host_gib = machine_info()["host_mem_gib"]
    for spec in specs:
        need_gib = None
        if spec.get("size") and spec["system"].startswith("megatrain"):
            acc = megatrain_variant(spec["system"]).get("acc", "1") != "0"
            need_gib = llama_params(spec["model"]) * HOST_BYTES_PER_PARAM[acc] / GiB
        peer_skip = peer_skip_reason(spec)
        if peer_skip:
            row = dict(system=spec["system"], status=peer_skip)
        elif spec["system"] in CUDA_ONLY and not cuda:
            row = dict(system=spec["system"], status="skipped: needs CUDA")
        elif need_gib is not None and host_gib is not None and need_gib > 0.92 * host_gib:
            row = dict(system=spec["system"], status=f"skipped: needs ~{need_gib:.0f} GiB of host memory "
                       f"({llama_params(spec['model']) / 1e9:.2f}B params), the machine has {host_gib:.0f} GiB")
        else:
            row = spawn(spec, args.child_timeout)
        rows.append(finish_row(row, spec, peak))
        if spec.get("size"):
            rows[-1].update(size=spec["size"], params_b=(rows[-1].get("n_params") or llama_params(spec["model"])) / 1e9)
        r = rows[-1]
        print(f"---- {r['system']}: {r.get('status')}  step {fmt(r.get('step_s'))} s  "
              f"{fmt(r.get('tokens_per_s'), '{:.0f}')} tok/s  GPU {fmt(r.get('gpu_peak_gib'), '{:.1f}')} GiB",
              file=sys.stderr, flush=True)
        if args.out:  # rows so far, in case the run is cut short (replaced by the full document below)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(benchmark="bench_train", partial=True, git_commit=git_commit(),
                               matmul_bf16_tflops=matmul, rows=rows), f, indent=1)

    n_params = next((r["n_params"] for r in rows if r.get("n_params")), None)
    print()
    size = "" if not n_params else f" ({n_params / 1e9:.2f}B params)" if n_params >= 1e9 else f" ({n_params / 1e6:.1f}M params)"
    shape = f"{model['layers']} layers, hidden {model['hidden']}"
    toks = f"batch {batch} x seq {seq}" + (f" x {args.grad_accum} micro-batches" if args.grad_accum > 1 else "") + \
        (f", max_grad_norm {args.max_grad_norm:g}" if args.max_grad_norm else ", no clipping")
    if args.sweep == "tokens":
        title = f"sweep tokens/step: {preset} preset{size}, {shape}, {args.device} {dtype}"
    elif args.sweep == "depth":
        title = f"sweep depth: {preset} preset width (hidden {model['hidden']}), {toks}, {args.device} {dtype}"
    elif args.sweep == "size":
        title = f"sweep model size: Llama {', '.join(args.sizes)}, {toks}, {args.device} {dtype}"
    else:
        title = f"{preset} preset{size}, {shape}, {toks}, {args.device} {dtype}"
    print(title)
    extra = {"tokens": "tokens_per_step", "depth": "layers", "size": "size"}.get(args.sweep)
    print_table(rows, extra)
    rat = [] if args.sweep else ratios(rows)
    if rat:
        print(f"\n{rat[0]['megatrain']} vs peer:  throughput ratio (>1: megatrain faster),  GPU memory ratio (<1: megatrain uses less)")
        for x in rat:
            print(f"  vs {x['peer']:<16} throughput x{x['throughput_ratio']:.2f}   GPU memory x{fmt(x['gpu_memory_ratio'], '{:.2f}')}")
    print("\nsettings:")
    for name in dict.fromkeys(r["system"] for r in rows):
        st = next((r["settings"] for r in rows if r["system"] == name and r.get("settings")), None)
        if st:
            print(f"  {name}: " + ", ".join(f"{k}={v}" for k, v in st.items() if k != "config"))
        pr = next((r for r in rows if r["system"] == name and "precision" in r), None)
        if pr:
            print(f"  {name}: master weights {pr['precision']}, clipped: {pr['clips']} (clipping support: {pr['clip_support']})")
    for r in rows:
        pr = r.get("profile")
        if pr and "error" in pr:
            print(f"profile {r['system']}: failed: {pr['error']} {pr.get('event_categories', '')}")
        elif pr:
            syncs = {tid: {k: v["count"] for k, v in calls.items()} for tid, calls in pr["host_syncs"].items()}
            print(f"profile {r['system']} (one step): window {pr['window_s']:.3f} s, compute busy {pr['compute_busy_s']:.3f} s, "
                  f"idle {pr['compute_idle_s']:.3f} s in {pr['compute_idle_gaps_over_threshold']} gaps > 100 us "
                  f"(largest {', '.join(f'{g * 1e3:.1f}' for g in pr['largest_idle_gaps_s'][:3])} ms); "
                  f"H2D {pr['h2d_busy_s']:.3f} s ({pr['h2d_overlapped_s'] / max(pr['h2d_busy_s'], 1e-12):.0%} under compute), "
                  f"D2H {pr['d2h_busy_s']:.3f} s ({pr['d2h_overlapped_s'] / max(pr['d2h_busy_s'], 1e-12):.0%} under compute); "
                  f"host syncs per thread {syncs}")
            if pr.get("compute_idle_step_s") is not None:
                print(f"  from the step's start on the host: {pr['step_span_s']:.3f} s, first GPU activity after "
                      f"{pr['host_lead_s'] * 1e3:.1f} ms, compute idle {pr['compute_idle_step_s']:.3f} s")
            for g in pr.get("idle_gaps", []):
                print(f"  gap {g['dur_s'] * 1e3:.2f} ms at +{g['offset_s'] * 1e3:.1f} ms: {g['before']} -> {g['after']}; "
                      f"launch late {fmt(g.get('launch_late_s', None) and g['launch_late_s'] * 1e3, '{:.2f}')} ms, "
                      f"H2D {g['h2d_s'] * 1e3:.2f} ms, D2H {g['d2h_s'] * 1e3:.2f} ms inside; cpu ops {g.get('cpu_ops', [])}")
        if r.get("worker_timeline"):
            print_worker_timeline(r["worker_timeline"])
    for r in rows:
        if r.get("megatrain"):
            at = f" ({extra}={r.get(extra)})" if extra else ""
            print(f"megatrain transfers over the timed steps{at}: " +
                  ", ".join(f"{k}={fmt(v, '{:.3g}') if isinstance(v, (int, float)) or v is None else v}"
                            for k, v in r["megatrain"].items()))

    if args.out:
        doc = dict(benchmark="bench_train", sweep=args.sweep, title=title,
                   date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                   machine=machine_info(), gpu=gpu, git_commit=git_commit(), versions=versions(),
                   matmul_bf16_tflops=matmul, peak_tflops_for_mfu=peak,
                   flops_formula="6*N*T + 6*L*B*S^2*H*D (N = all params; causal attention; recompute not counted)",
                   preset=preset, model=model, args={k: v for k, v in vars(args).items() if k != "_child"},
                   rows=rows, ratios=rat)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        png = os.path.splitext(args.out)[0] + ".png"
        try:
            if args.sweep == "tokens":
                plot_sweep(rows, png, "tokens_per_step", "tokens / step", title)
            elif args.sweep == "depth":
                plot_sweep(rows, png, "layers", "decoder layers", title)
            elif args.sweep == "size":
                plot_sweep(rows, png, "params_b", "parameters, billions", title)
            else:
                plot_bars(rows, png, title)
            print(f"\nwrote {args.out} and {png}")
        except Exception as e:  # a plotting problem must not lose the JSON
            print(f"\nwrote {args.out}; PNG failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
