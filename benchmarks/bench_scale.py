"""Largest-model benchmarks: models built straight into the host store, loads, LoRA on a frozen base.

Each case runs in its own child process (peak host RSS = that child's VmHWM) and prints one JSON row;
the parent writes them to docs/benchmarks/scale_<part>_<machine>.json with the machine, date, commit.

  python benchmarks/bench_scale.py train   # Llama-3-8B shape and the 6.74B shape, from_config -> store, 5 steps
  python benchmarks/bench_scale.py load    # write a 7B bf16 HF dir layer by layer, load it with from_pretrained
  python benchmarks/bench_scale.py lora    # PEFT LoRA r=16 (q,k,v,o) on a frozen ~30B Llama base
  python benchmarks/bench_scale.py disk --dir DIR   # a 10B Llama (fp32 state 130 GiB > host) with the
                                           # deepest layers' state on DIR (the disk tier), 16K and 64K tokens/step
  python benchmarks/bench_scale.py pool    # the largest Llama of the 14B shape this machine's host + GPU hold
                                           # (host store + exclusive device-state layers), as a user gets it

Options: --steps N (default 5), --batch B --seq T (default 4 x 4096), --dir DIR (load: where the
checkpoint goes; default $TMPDIR; disk: the offload_dir), --pin-after-fill 0|1 (load:
MEGATRAIN_PIN_AFTER_FILL of the child), --small (tiny shapes: checks the script end to end on any
machine, CPU included). disk: --host-limit-gib G (host_memory_limit, default 110: the layers whose
state does not fit go to DIR), --tokens 16384,65536 (tokens per step, batches of --seq), --steps
(timed steps per token count after one warm-up step, default 2). pool: --layers N (default: the largest
N that megatrain.estimate says fits, searched with estimate alone and printed before anything is built),
--steps (timed steps after one warm-up, default 3), --host-margin-gib / --gpu-margin-gib (memory the
search leaves to the child's Python, CUDA context and allocator: default 4 / 5).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit  # noqa: E402
from bench_scale_common import (GiB, TAG, _attn_flops, _config, _peak_rss, _rss, _train_steps,  # noqa: E402
                                spawn)

SHAPES = {
    "llama3_8b": dict(hidden=4096, layers=32, inter=14336, heads=32, kv_heads=8, vocab=128256),
    # the Llama-3-8B shape with 34 decoder layers (8.47B): near the largest a 125 GiB host holds at 14 B/param
    "llama3_8b_34l": dict(hidden=4096, layers=34, inter=14336, heads=32, kv_heads=8, vocab=128256),
    "llama_6.7b": dict(hidden=4096, layers=32, inter=11008, heads=32, kv_heads=32, vocab=32000),
    "llama_7b_bf16": dict(hidden=4096, layers=32, inter=11008, heads=32, kv_heads=32, vocab=32000),
    "llama_30b": dict(hidden=6656, layers=60, inter=17920, heads=52, kv_heads=52, vocab=32000),
    # 9.98B: fp32 state at 14 B/param is 130 GiB, more than the H200 machine's 125 GiB host; with a
    # 110 GiB host_memory_limit the 12 deepest layers (29.1 GB of fp32 state) go to the disk tier
    "llama_10b": dict(hidden=4096, layers=48, inter=11008, heads=32, kv_heads=32, vocab=32000),
}
SMALL = dict(hidden=64, layers=2, inter=128, heads=4, kv_heads=2, vocab=256)
SMALL_DISK = dict(hidden=64, layers=6, inter=128, heads=4, kv_heads=2, vocab=256)  # >= 3 layers: some go to disk
# pool: the 14B Llama shape (~275M parameters per layer); its layer count is --layers or the largest that fits
def child_train(spec):
    """from_config straight into the store (init on the GPU), fp32 masters, bf16 compute, N steps."""
    import torch
    import megatrain
    m = spec["model"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = megatrain.from_config(_config(m, spec["seq"]), seed=0, init_device=dev if dev.type == "cuda" else "cpu",
                                  device=dev, compute_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    build_s = time.perf_counter() - t0
    rss_built = _rss()
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    times, loss = _train_steps(model, opt, spec, dev)
    st = model.megatrain.stats()
    n = st["num_params"]
    step = sum(times) / len(times)
    flops = 6.0 * n * spec["batch"] * spec["seq"] + _attn_flops(m, spec["batch"], spec["seq"])
    peak = _peak_rss()
    return dict(n_params=n, build_s=build_s, step_s=step, step_times_s=times, loss=loss,
                tflops=flops / step / 1e12, tokens_per_s=spec["batch"] * spec["seq"] / step,
                host_store_bytes=st["host_store_bytes"], section_bytes=dict(model.megatrain.store.section_bytes),
                accumulator_bytes=model.megatrain.accumulator_bytes(), pinned_bytes=st["pinned_bytes"],
                rss_after_build_gib=rss_built / GiB, peak_rss_gib=peak / GiB, peak_rss_bytes_per_param=peak / n,
                store_bytes_per_param=st["host_store_bytes"] / n,
                gpu_peak_gib=torch.cuda.max_memory_allocated() / GiB if dev.type == "cuda" else None)


def child_save(spec):
    """A bf16 HF directory written layer by layer from a seeded init (never the whole model in memory)."""
    import torch
    from safetensors.torch import save_file
    from megatrain.state.loading import meta_model
    m = spec["model"]
    cfg = _config(m, 2048)
    cfg.dtype = "bfloat16"
    out = spec["dir"]
    os.makedirs(out, exist_ok=True)
    model = meta_model(cfg)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(0)
    groups: dict = {}
    for name, p in model.named_parameters():
        key = name.split(".")[2] if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append((name, tuple(p.shape)))
    weight_map, total = {}, 0
    t0 = time.perf_counter()
    for k, (key, items) in enumerate(groups.items()):
        fn = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in items:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, device=dev).normal_(0.0, 0.02, generator=g).to(torch.bfloat16).cpu()
            tensors[name] = t
            weight_map[name] = fn
            total += t.numel() * 2
        save_file(tensors, os.path.join(out, fn), metadata={"format": "pt"})
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(dict(metadata=dict(total_size=total), weight_map=weight_map), f)
    cfg.save_pretrained(out)
    return dict(save_s=time.perf_counter() - t0, checkpoint_bytes=total, peak_rss_gib=_peak_rss() / GiB)


def child_load(spec):
    import torch
    import megatrain
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = megatrain.from_pretrained(spec["dir"], device=dev,
                                      compute_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    load_s = time.perf_counter() - t0
    st = model.megatrain.stats()
    size = sum(os.path.getsize(os.path.join(spec["dir"], f)) for f in os.listdir(spec["dir"]) if f.endswith(".safetensors"))
    peak = _peak_rss()
    x = torch.randint(0, model.config.vocab_size, (1, 128)).to(dev)
    with torch.no_grad():
        ok = bool(torch.isfinite(model(input_ids=x).logits).all())
    return dict(load_s=load_s, checkpoint_bytes=size, read_gb_per_s=size / load_s / 1e9,
                store_fill_gb_per_s=st["host_store_bytes"] / load_s / 1e9, host_store_bytes=st["host_store_bytes"],
                peak_rss_gib=peak / GiB, store_gib=st["host_store_bytes"] / GiB,
                peak_minus_store_gib=(peak - st["host_store_bytes"]) / GiB, pinned=bool(model.megatrain.store.is_pinned),
                pin_after_fill=model.megatrain.options.pin_after_fill, n_params=st["num_params"],
                forward_finite=ok)


def child_lora(spec):
    """PEFT LoRA on a frozen base built from_config straight into the store (base: compute copy only)."""
    import peft
    import torch
    import megatrain
    m = spec["model"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lcfg = peft.LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    t0 = time.perf_counter()
    model = megatrain.from_config(_config(m, spec["seq"]), seed=0, init_device=dev if dev.type == "cuda" else "cpu",
                                  transform=lambda mm: peft.get_peft_model(mm, lcfg), device=dev,
                                  compute_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    build_s = time.perf_counter() - t0
    opt = megatrain.optim.CPUAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    times, loss = _train_steps(model, opt, spec, dev)
    st = model.megatrain.stats()
    store = model.megatrain.store
    n, frozen = st["num_params"], store.frozen_numel
    step = sum(times) / len(times)
    tok = spec["batch"] * spec["seq"]
    # frozen weights get no weight gradient: forward 2NT + input-gradient backward 2NT, + 2NT recompute
    # for the streamed layers' forward (counted as model FLOPs the 6NT way would count them: reported both)
    flops_4nt = 4.0 * n * tok + _attn_flops(m, spec["batch"], spec["seq"])
    peak = _peak_rss()
    base_bytes = store.section_bytes["compute"]
    return dict(n_params=n, frozen_params=frozen, trainable_params=n - frozen, build_s=build_s, step_s=step,
                step_times_s=times, loss=loss, tokens_per_s=tok / step, tflops_4nt=flops_4nt / step / 1e12,
                host_store_bytes=st["host_store_bytes"], section_bytes=dict(store.section_bytes),
                base_bytes_per_param=base_bytes / n, store_bytes_per_param=st["host_store_bytes"] / n,
                peak_rss_gib=peak / GiB, peak_rss_bytes_per_param=peak / n,
                gpu_peak_gib=torch.cuda.max_memory_allocated() / GiB if dev.type == "cuda" else None)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _disk_plan(spec: dict):
    """``megatrain.estimate`` of the disk case (nothing allocated): what goes to disk, and the host part.

    Planned for the CPU device (no CUDA context in the parent process: its host memory would be
    missing from the child's) with the child's compute dtype; the host and disk bytes are the same.
    """
    import torch
    import megatrain
    return megatrain.estimate(_config(spec["model"], spec["seq"]), device="cpu",
                              compute_dtype=torch.bfloat16 if spec["cuda"] else torch.float32,
                              offload_dir=spec["tier_dir"], host_memory_limit=spec["host_limit"],
                              host_compute_copy=True)  # the disk tier's benchmark: every layer keeps its compute copy


def _print_disk_plan(est) -> None:
    _log(f"planned: {est.num_params / 1e9:.2f}B parameters, fp32 state + compute copy "
         f"{(est.store_bytes + est.disk_bytes) / GiB:.1f} GiB in all; host part {est.host_bytes / GiB:.1f} GiB "
         f"(host_memory_limit {est.host_memory_limit / GiB:.1f} GiB, disk tier buffers {est.disk_pool_bytes / GiB:.1f} "
         f"GiB); disk: {est.disk_layers} of {est.num_layers} layers, {est.disk_bytes / 1e9:.1f} GB under "
         f"{est.offload_dir} ({(est.disk_free_bytes or 0) / 1e9:.1f} GB free); moved per step: "
         f"{2 * est.disk_bytes / 1e9:.1f} GB (read + write)" + ("" if est.fits else f"; DOES NOT FIT: {est.reason()}"))


def child_disk(spec):
    """A model whose fp32 state exceeds the host, trained with its deepest layers' state on disk.

    The disk's bandwidth is measured first through the tier itself (two units of the model's
    layer size, 4 I/O threads, in the same directory). Per token count: one warm-up step, then
    ``steps`` steps timed from a drained worker to a drained worker (each step's updates, and so
    its disk I/O, are in the time). Disk floor = bytes read / read GB/s + bytes written / write
    GB/s; exposed = time the training waited for the CPU worker's updates (which wait for the
    disk); hidden fraction = 1 - exposed / floor.
    """
    import torch
    import megatrain
    from megatrain import _C
    from bench_disk import GB, bench_tier
    m = spec["model"]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    est = _disk_plan(spec)  # printed by the parent before this child started
    os.makedirs(spec["dir"], exist_ok=True)
    layer_state = est.disk_bytes // max(1, est.disk_layers)
    bw_root = tempfile.mkdtemp(prefix="bw_", dir=spec["dir"])
    try:
        bw = bench_tier(_C, bw_root, max(3 * 4096, layer_state // (3 * 4096) * (3 * 4096)), 2, 4, 2, 8 << 20)
    finally:
        import shutil
        shutil.rmtree(bw_root, ignore_errors=True)
    _log(f"disk {spec['dir']}: write {bw['write_GBps']:.2f} GB/s, read {bw['read_GBps']:.2f} GB/s "
         f"(DiskTier, 4 threads, O_DIRECT {bw['direct_io']})")
    t0 = time.perf_counter()
    model = megatrain.from_config(_config(m, spec["seq"]), seed=0, init_device=dev if dev.type == "cuda" else "cpu",
                                  device=dev, compute_dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                  offload_dir=spec["tier_dir"], host_memory_limit=spec["host_limit"],
                                  device_state_layers=0, host_compute_copy=True)
    build_s = time.perf_counter() - t0
    eng = model.megatrain
    plan = eng.offload_plan
    _log(f"built in {build_s:.1f} s: layers {plan.disk_units[0]}..{plan.disk_units[-1]} on disk, host RSS "
         f"{_rss() / GiB:.1f} GiB")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def sync():
        opt.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize()

    keys = ("disk_bytes_read", "disk_bytes_written", "disk_read_seconds", "disk_write_seconds",
            "disk_acquire_wait_seconds", "adam_exposed_s", "adam_time_s", "grad_wait_s")
    rows = []
    for tokens in spec["tokens"]:
        batch = max(1, tokens // spec["seq"])
        x = torch.randint(0, m["vocab"], (batch, spec["seq"]), generator=g).to(dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        step(x)  # warm-up (not timed)
        sync()
        s0 = eng.stats()
        t_start = time.perf_counter()
        ends = []
        for _ in range(spec["steps"]):
            loss = step(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            ends.append(time.perf_counter() - t_start)
        sync()  # the last steps' updates (and their disk I/O) are in the time
        total = time.perf_counter() - t_start
        s1 = eng.stats()
        d = {k: (s1.get(k, 0) - s0.get(k, 0)) / spec["steps"] for k in keys}
        step_s = total / spec["steps"]
        floor = d["disk_bytes_read"] / (bw["read_GBps"] * GB) + d["disk_bytes_written"] / (bw["write_GBps"] * GB)
        exposed = d["adam_exposed_s"]
        n = s1["num_params"]
        flops = 6.0 * n * batch * spec["seq"] + _attn_flops(m, batch, spec["seq"])
        row = dict(tokens_per_step=batch * spec["seq"], batch=batch, seq=spec["seq"], step_s=step_s,
                   step_ends_s=ends, drained_s=total, loss=loss.item(),
                   disk_read_bytes_per_step=d["disk_bytes_read"], disk_write_bytes_per_step=d["disk_bytes_written"],
                   disk_bytes_per_step=d["disk_bytes_read"] + d["disk_bytes_written"], disk_floor_s=floor,
                   step_over_floor=step_s / floor if floor else None, exposed_wait_s=exposed,
                   io_hidden_fraction=max(0.0, min(1.0, 1.0 - exposed / floor)) if floor else None,
                   compute_s_est=max(0.0, step_s - exposed), worker_disk_wait_s=d["disk_acquire_wait_seconds"],
                   disk_read_busy_s=d["disk_read_seconds"], disk_write_busy_s=d["disk_write_seconds"],
                   adam_s=d["adam_time_s"], tokens_per_s=batch * spec["seq"] / step_s,
                   tflops=flops / step_s / 1e12, peak_rss_gib=_peak_rss() / GiB,
                   gpu_peak_gib=torch.cuda.max_memory_allocated() / GiB if dev.type == "cuda" else None)
        _log(f"{row['tokens_per_step']} tokens/step: {step_s:.2f} s/step, disk floor {floor:.2f} s "
             f"({row['disk_bytes_per_step'] / GB:.1f} GB/step), waited for the disk {exposed:.2f} s/step, I/O hidden "
             f"{(row['io_hidden_fraction'] or 0) * 100:.0f}%, host peak RSS {row['peak_rss_gib']:.1f} GiB, GPU peak "
             f"{row['gpu_peak_gib'] or 0:.1f} GiB")
        rows.append(row)
    st = eng.stats()
    return dict(n_params=st["num_params"], build_s=build_s, disk=bw, disk_layers=plan.disk_units,
                gpu=torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
                disk_state_bytes=plan.disk_bytes, host_memory_limit=spec["host_limit"],
                planned_host_bytes=plan.host_bytes, pool_bytes=plan.pool_bytes,
                host_store_bytes=st["host_store_bytes"], direct_io=st.get("disk_direct_io"),
                fp32_state_bytes=12 * st["num_params"], state_and_compute_bytes=st["host_store_bytes"] + plan.disk_bytes,
                peak_rss_gib=_peak_rss() / GiB, per_tokens=rows)


def child_pool(spec):
    """The pool part's child (benchmarks/bench_scale_pool.py)."""
    from bench_scale_pool import child_pool as run
    return run(spec)


def child_main(spec):
    import traceback
    row = dict(case=spec["case"], status="ok")
    try:
        row.update({"train": child_train, "save": child_save, "load": child_load, "lora": child_lora,
                    "disk": child_disk, "pool": child_pool}[spec["kind"]](spec))
    except Exception as e:  # reported as the row's status
        traceback.print_exc()
        row["status"] = f"error: {type(e).__name__}: {str(e).strip()[:300]}"
    print(TAG + json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", nargs="?", choices=["train", "load", "lora", "disk", "pool"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--pin-after-fill", default=None, choices=["0", "1", "both"])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--shapes", default=None, help="train: comma-separated names from SHAPES")
    ap.add_argument("--host-limit-gib", type=float, default=110.0, help="disk: host_memory_limit in GiB")
    ap.add_argument("--tokens", default="16384,65536", help="disk: tokens per step, comma-separated")
    ap.add_argument("--layers", type=int, default=None, help="pool: decoder layers (default: the largest that fits)")
    ap.add_argument("--host-margin-gib", type=float, default=4.0, help="pool: host memory the search leaves free")
    ap.add_argument("--gpu-margin-gib", type=float, default=5.0,
                    help="pool: GPU memory the search leaves free (the estimate was 3.5 GiB under the H200 run's peak)")
    ap.add_argument("--timeout", type=float, default=560.0, help="seconds the child may run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--_child", default=None)
    a = ap.parse_args()
    if a._child:
        return child_main(json.loads(a._child))
    if a.part is None:
        ap.error("name a part: train, load, lora, disk or pool")
    if a.part == "disk":
        return main_disk(a)
    if a.part == "pool":
        from bench_scale_pool import main_pool
        return main_pool(a)
    base = dict(steps=a.steps, batch=a.batch, seq=a.seq, lora_r=a.lora_r)
    if a.small:
        base.update(batch=2, seq=64, steps=2)
    rows = []
    if a.part == "train":
        names = a.shapes.split(",") if a.shapes else ["llama3_8b", "llama_6.7b"]
        for nm in names:
            m = SMALL if a.small else SHAPES[nm]
            rows.append(spawn(dict(base, case=f"train_{nm}", kind="train", model=m, vocab=m["vocab"])))
        ok = [r for r in rows if r.get("status") == "ok"]
        if len(ok) == 2:
            rows.append(dict(case="ratio", tflops_ratio=ok[0]["tflops"] / ok[1]["tflops"]))
    elif a.part == "load":
        m = SMALL if a.small else SHAPES["llama_7b_bf16"]
        d = a.dir or tempfile.mkdtemp(prefix="megatrain-7b-")
        rows.append(spawn(dict(base, case="save_bf16_dir", kind="save", model=m, dir=d)))
        pins = ["1", "0"] if a.pin_after_fill in (None, "both") else [a.pin_after_fill]
        for pin in pins:
            rows.append(spawn(dict(base, case=f"from_pretrained_pin_after_fill_{pin}", kind="load", dir=d),
                              env_extra=dict(MEGATRAIN_PIN_AFTER_FILL=pin)))
        if a.dir is None:
            import shutil
            shutil.rmtree(d, ignore_errors=True)
    else:
        m = SMALL if a.small else SHAPES["llama_30b"]
        rows.append(spawn(dict(base, case="lora_r%d_30b" % a.lora_r, kind="lora", model=m, vocab=m["vocab"])))
    import torch
    result = dict(benchmark=f"bench_scale {a.part}", date=datetime.date.today().isoformat(), commit=git_commit(),
                  machine=dict(host=platform.node(), cpu_count=os.cpu_count(),
                               gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None),
                  versions=dict(torch=torch.__version__), settings=base, rows=rows)
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks",
                                f"scale_{a.part}_{'small' if a.small else 'h200'}.json")
    if not a.small or a.out:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    print(json.dumps(rows, indent=1))


def main_disk(a) -> None:
    """``disk``: the plan printed first, then one child (build, bandwidth, both token counts), JSON + PNG.

    This process never touches CUDA (its context would take host memory from the child's budget)."""
    import torch
    if a.dir is None:
        raise SystemExit("bench_scale.py disk: pass --dir DIR, a directory on the disk to train from")
    steps = 2 if a.steps == 5 else a.steps  # the default of the other parts is 5
    spec = dict(case="disk_llama_10b", kind="disk", model=SHAPES["llama_10b"], seq=a.seq, steps=steps,
                tokens=[int(t) for t in a.tokens.split(",")], dir=os.path.abspath(a.dir),
                cuda=not a.small and os.path.exists("/dev/nvidia0"))
    if a.small:
        spec.update(case="disk_small", model=SMALL_DISK, seq=64, steps=2, tokens=[128, 256])
    os.makedirs(spec["dir"], exist_ok=True)
    spec["tier_dir"] = os.path.join(spec["dir"], "megatrain_tier")
    spec["host_limit"] = int(a.host_limit_gib * GiB)
    if a.small:  # one byte less than the whole model needs: the deepest layers go to disk
        est = _disk_plan(dict(spec, host_limit=None))
        spec["host_limit"] = est.host_bytes - 1
    _print_disk_plan(_disk_plan(spec))
    row = spawn(spec, timeout=a.timeout, stream_stderr=True)
    result = dict(benchmark="bench_scale disk", date=datetime.date.today().isoformat(), commit=git_commit(),
                  machine=dict(host=platform.node(), cpu_count=os.cpu_count(), gpu=row.get("gpu"),
                               host_ram_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB),
                  versions=dict(torch=torch.__version__), settings={k: v for k, v in spec.items() if k != "model"},
                  model=spec["model"], rows=[row])
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks",
                                f"disk_train_{'small' if a.small else 'h200'}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    _plot_disk(result, out[:-5] + ".png")
    for r in row.get("per_tokens", []):
        print(f"{r['tokens_per_step']:>6} tokens/step  {r['step_s']:7.2f} s/step  disk floor {r['disk_floor_s']:6.2f} s "
              f"({r['disk_bytes_per_step'] / 1e9:.1f} GB)  exposed {r['exposed_wait_s']:6.2f} s  I/O hidden "
              f"{(r['io_hidden_fraction'] or 0) * 100:4.0f}%  host peak {r['peak_rss_gib']:.1f} GiB  GPU peak "
              f"{r['gpu_peak_gib'] or 0:.1f} GiB")
    print(f"status {row.get('status')}")


def _plot_disk(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"][0].get("per_tokens") or []
    if not rows:
        return
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    w = 0.27
    ax.bar([i - w for i in x], [r["step_s"] for r in rows], w, label="step time")
    ax.bar(list(x), [r["disk_floor_s"] for r in rows], w, label="disk floor (bytes / measured GB/s)")
    ax.bar([i + w for i in x], [r["compute_s_est"] for r in rows], w, label="step - waits for the disk")
    for i, r in enumerate(rows):
        ax.text(i - w, r["step_s"], f"{(r['io_hidden_fraction'] or 0) * 100:.0f}% hidden", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['tokens_per_step'] // 1024}K tokens/step" for r in rows])
    ax.set_ylabel("seconds")
    top = result["rows"][0]
    ax.set_title(f"{top.get('n_params', 0) / 1e9:.1f}B Llama, {len(top.get('disk_layers', []))} layers' fp32 state on "
                 f"disk ({top.get('disk_state_bytes', 0) / 1e9:.0f} GB)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
