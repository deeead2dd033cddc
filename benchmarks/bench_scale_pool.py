"""``bench_scale.py pool``: the largest Llama of the 14B shape one machine trains, host store + GPU as one pool.

The shape: hidden 5120, intermediate 13824, 40 heads, 8 KV heads, vocab 32000 (~275M parameters per
decoder layer); the layer count is ``--layers`` or the largest N for which ``megatrain.estimate`` says it
fits this machine's host and GPU memory at the given batch, found by a search over N with the estimate
alone (printed before anything is built). The model is built by ``megatrain.from_config`` straight into
the host store with no placement option, only the batch (the defaults: what a user gets; when the host store
does not fit, the planner makes the fewest leading layers exclusive device-state layers, docs/placement.md) and
trained with ``CPUAdamW(max_grad_norm=1.0)``: one warm-up step, then ``--steps`` timed steps of
``--batch`` x ``--seq`` tokens. The row: parameters, layers, s/step, model TFLOP/s (bench_train's
formula), peak host RSS (the child's VmHWM), peak GPU memory, the placement (exclusive layers and their
share, device-state layers, host store bytes), host bytes per host-stored parameter, and the estimate's
prediction beside the measurement.

The parent never touches CUDA (its context would take host memory from the child's budget): it reads
the host's available memory (``host_memory_limits``: MemAvailable, the cgroup limit) and the GPU's free
memory (``nvidia-smi``), less the margins, and judges the estimate against them (``host_memory=`` /
``gpu_memory=``). The child gives ``from_config`` the batch (``micro_batch_size=`` / ``seq_len=``), so the
capacity share keeps this batch's activation estimate as ``megatrain.estimate`` does, and the search asks the
estimate with the batch alone: the N it finds is one ``wrap`` plans the same way. ``--small``: a tiny shape on the CPU with a ``host_memory_limit`` one byte short of the
whole model's need, so one layer is exclusive (on the CPU backend the default places no device state:
``device_state_layers="auto"`` is passed there, what CUDA's default is); it checks the script end to end.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import time

from bench_common import git_commit
from bench_scale_common import GiB, _config, _peak_rss, _train_steps, spawn

POOL_SHAPE = dict(hidden=5120, inter=13824, heads=40, kv_heads=8, vocab=32000)
SMALL_POOL = dict(hidden=64, layers=4, inter=128, heads=4, kv_heads=2, vocab=256)

MAX_LAYERS = 512  # the search's upper bound


def _estimate(m: dict, spec: dict):
    """``megatrain.estimate`` of the pool model ``m`` as the child will build it, with its batch (nothing allocated)."""
    import megatrain
    kw = dict(seq_len=spec["seq"], micro_batch_size=spec["batch"])
    if spec["cuda"]:
        return megatrain.estimate(_config(m, spec["seq"]), host_memory=spec["host_memory"],
                                  gpu_memory=spec["gpu_memory"], max_grad_norm=1.0, **kw)
    return megatrain.estimate(_config(m, spec["seq"]), device="cpu", host_memory_limit=spec.get("host_limit"),
                              max_grad_norm=1.0, host_compute_copy=True, **kw)  # --small: the exclusive tier


def _fits(layers: int, spec: dict) -> bool:
    m = dict(spec["shape"], layers=layers)
    return _estimate(m, spec).fits


def largest_layers(spec: dict) -> int:
    """The largest N in ``1 .. MAX_LAYERS`` for which :func:`_fits` holds (0: not even one layer); doubling,
    then bisection (the fit shrinks as N grows)."""
    lo, hi = 0, 1
    while hi <= MAX_LAYERS and _fits(hi, spec):
        lo, hi = hi, 2 * hi
    hi = min(hi, MAX_LAYERS + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(mid, spec) else (lo, mid)
    return lo


def _prediction(est) -> dict:
    """What the estimate predicts, for the row (bytes)."""
    return dict(fits=est.fits, host_bytes=est.host_bytes, gpu_bytes=est.gpu_bytes, store_bytes=est.store_bytes,
                exclusive_layers=est.exclusive_layers, exclusive_share=est.exclusive_share,
                exclusive_device_bytes=est.exclusive_device_bytes, auto_share_layers=est.exclusive_max,
                capacity_share_layers=est.capacity_max, activation_reserve_bytes=est.activation_reserve_bytes,
                activation_bytes=est.activation_bytes, logits_bytes=est.logits_bytes,
                activation_policy=est.activation_policy, reason=est.reason())


def child_pool(spec: dict) -> dict:
    """Build the model into the host store with the defaults (``--small``: the CPU, a host limit), train it."""
    import torch
    import megatrain
    from bench_train import model_flops_per_step
    m = spec["model"]
    dev = torch.device("cuda" if spec["cuda"] else "cpu")
    kw = dict(micro_batch_size=spec["batch"], seq_len=spec["seq"])  # the batch: the estimate's activation reserve
    if not spec["cuda"]:  # --small exercises the exclusive tier
        kw.update(host_memory_limit=spec["host_limit"], device_state_layers="auto", host_compute_copy=True)
    t0 = time.perf_counter()
    model = megatrain.from_config(_config(m, spec["seq"]), seed=0, init_device=dev if spec["cuda"] else "cpu",
                                  device=dev, **kw)
    build_s = time.perf_counter() - t0
    eng = model.megatrain
    pl = eng.placement()
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-5, weight_decay=0.0, max_grad_norm=1.0)
    times, loss = _train_steps(model, opt, spec, dev)
    st = eng.stats()
    n = st["num_params"]
    by_index = {u.index: u for u in eng.units}
    excl_params = sum(e.numel for k in pl["exclusive_layers"] for e in by_index[k].entries)
    step = sum(times) / len(times)
    flops = model_flops_per_step(n, m, spec["batch"], spec["seq"])
    peak = _peak_rss()
    host_params = n - excl_params  # parameters whose fp32 state is in the host store
    return dict(n_params=n, layers=m["layers"], build_s=build_s, step_s=step, step_times_s=times, loss=loss,
                model_tflops=flops / step / 1e12, tokens_per_s=spec["batch"] * spec["seq"] / step,
                peak_rss_gib=peak / GiB, gpu_peak_gib=torch.cuda.max_memory_allocated() / GiB if spec["cuda"] else None,
                gpu_reserved_peak_gib=torch.cuda.max_memory_reserved() / GiB if spec["cuda"] else None,
                placement=dict(exclusive_layers=pl["exclusive_layers"], exclusive_share=pl.get("exclusive_share"),
                               device_state_layers=pl["device_state_layers"],
                               device_state_resident=pl["device_state_resident"],
                               device_state_bytes=pl["device_state_bytes"], host_store_bytes=pl["host_store_bytes"],
                               activations=pl["activations"], replan=pl["replan"],
                               activation_reserve=pl["activation_reserve"],
                               activation_reserve_bytes=pl["activation_reserve_bytes"]),
                host_stored_params=host_params, exclusive_params=excl_params,
                host_store_bytes_per_host_param=pl["host_store_bytes"] / host_params if host_params else None,
                peak_rss_bytes_per_host_param=peak / host_params if host_params else None,
                gpu=torch.cuda.get_device_name(0) if spec["cuda"] else None)


def _gpu_free_bytes():
    """The first GPU's free memory in bytes from ``nvidia-smi`` (no CUDA context here), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    try:
        return int(float(out.stdout.strip().splitlines()[0])) * 1024 ** 2
    except (ValueError, IndexError):
        return None


def _host_available_bytes() -> int:
    """This machine's available host memory: MemAvailable, or the cgroup limit less its usage when tighter."""
    from megatrain.runtime.placement.host_memory import host_memory_limits
    lim = host_memory_limits()
    avail = [lim["mem_available_bytes"]]
    if lim["cgroup_limit_bytes"] is not None:
        avail.append(lim["cgroup_limit_bytes"] - (lim["cgroup_usage_bytes"] or 0))
    return min(a for a in avail if a is not None)


def _spec(a) -> dict:
    """The case: the shape, the batch, the memory judged, the layer count (searched unless given)."""
    gpu = None if a.small else _gpu_free_bytes()
    spec = dict(case="pool_14b_shape", kind="pool", batch=a.batch, seq=a.seq, steps=3 if a.steps == 5 else a.steps,
                shape=dict(POOL_SHAPE), cuda=gpu is not None)
    if a.small:
        spec.update(case="pool_small", shape={k: v for k, v in SMALL_POOL.items() if k != "layers"}, batch=2, seq=64,
                    steps=2)
        m = dict(spec["shape"], layers=a.layers or SMALL_POOL["layers"])
        spec["host_limit"] = _estimate(m, dict(spec, host_limit=None)).host_bytes - 1  # one layer must be exclusive
    else:
        spec["host_memory"] = int(_host_available_bytes() - a.host_margin_gib * GiB)
        if gpu is not None:
            spec["gpu_memory"] = int(gpu - a.gpu_margin_gib * GiB)
    layers = a.layers or (SMALL_POOL["layers"] if a.small else None)
    t0 = time.perf_counter()
    if layers is None:
        layers = largest_layers(spec)
        print(f"search: {layers} layers is the largest N the estimate says fits ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    spec["model"] = dict(spec["shape"], layers=layers)
    spec["vocab"] = spec["shape"]["vocab"]
    return spec


def main_pool(a) -> None:
    """``pool``: the layer count and the estimate printed first, then one child; JSON (+ PNG)."""
    import torch
    spec = _spec(a)
    m = spec["model"]
    est = _estimate(m, spec)
    judged = (f"host {spec['host_memory'] / GiB:.1f} GiB, GPU {spec.get('gpu_memory', 0) / GiB:.1f} GiB"
              if "host_memory" in spec else f"host_memory_limit {spec['host_limit']} bytes, CPU")
    what = "the tiny shape (the CPU's estimate plans no exclusive layer: it says the limit does not fit)" \
        if a.small else "the 14B shape"
    print(f"pool: {m['layers']} layers of {what} ({judged}), {spec['batch']} x {spec['seq']} tokens", flush=True)
    print(est, flush=True)
    env = {"MEGATRAIN_SKIP_HOST_MEMORY_CHECK": "0"}  # the engine checks the host as a user's run does
    row = spawn(spec, env_extra=env, timeout=a.timeout, stream_stderr=True)
    row["predicted"] = _prediction(est)
    result = dict(benchmark="bench_scale pool", date=datetime.date.today().isoformat(), commit=git_commit(),
                  machine=dict(host=platform.node(), cpu_count=os.cpu_count(), gpu=row.get("gpu"),
                               host_ram_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GiB),
                  versions=dict(torch=torch.__version__), model=m,
                  settings={k: v for k, v in spec.items() if k not in ("model", "shape")}, rows=[row])
    out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks",
                                f"scale_pool_{'small' if a.small else 'h200'}.json")
    if not a.small or a.out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
        _plot(result, out[:-5] + ".png")
    p = row["predicted"]
    pl = row.get("placement") or {}
    print(f"{row.get('n_params', 0) / 1e9:.2f}B parameters, {m['layers']} layers: {row.get('step_s', float('nan')):.3f} "
          f"s/step, {row.get('model_tflops', float('nan')):.1f} TFLOP/s; exclusive layers "
          f"{len(pl.get('exclusive_layers', []))} ({pl.get('exclusive_share')}) vs {p['exclusive_layers']} predicted; "
          f"host peak RSS {row.get('peak_rss_gib', float('nan')):.1f} GiB vs {p['host_bytes'] / GiB:.1f} GiB predicted; "
          f"GPU peak {row.get('gpu_peak_gib') or 0:.1f} GiB vs ~{p['gpu_bytes'] / GiB:.1f} GiB predicted")
    print(f"status {row.get('status')}")


def _plot(result: dict, path: str) -> None:
    """Predicted vs measured host and GPU memory (GiB) of the row."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    row = result["rows"][0]
    if row.get("status") != "ok":
        return
    p = row["predicted"]
    labels = ["host", "GPU"]
    pred = [p["host_bytes"] / GiB, p["gpu_bytes"] / GiB]
    meas = [row["peak_rss_gib"], row.get("gpu_peak_gib") or 0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    w = 0.35
    ax.bar([i - w / 2 for i in range(2)], pred, w, label="estimate")
    ax.bar([i + w / 2 for i in range(2)], meas, w, label="measured peak (host RSS / GPU allocated)")
    ax.set_xticks(range(2))
    ax.set_xticklabels(labels)
    ax.set_ylabel("GiB")
    ax.set_title(f"{row['n_params'] / 1e9:.2f}B Llama, {row['layers']} layers, "
                 f"{len(row['placement']['exclusive_layers'])} exclusive: {row['step_s']:.2f} s/step", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
