#!/usr/bin/env python3
"""Causal SDPA attention per backend at long context: time, TFLOP/s, agreement, peak memory.

Runs ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)`` (the call
transformers' ``sdpa`` attention makes when no mask is needed) under each of torch's backends
(``torch.nn.attention.SDPBackend``: FLASH_ATTENTION, CUDNN_ATTENTION, EFFICIENT_ATTENTION, and
torch's own choice without a ``sdpa_kernel`` context), forward
and forward + backward, for the head shapes of the benchmark presets (``7b``: 32 heads x 128,
``1b``: 32 x 64) at batch 1.

FLOPs (causal, as ``bench_train.py`` counts attention): forward ``2 * 2 * S^2 * H * D / 2``
(QK^T and A.V, half the matrix), backward twice the forward. TFLOP/s = those FLOPs / the measured
time (mean of ``--reps`` after one warm-up; CUDA events). Agreement: per tensor (output, dq, dk,
dv), the largest absolute difference from the FLASH_ATTENTION result divided by the largest
absolute value of that result. A backend that cannot run a shape is recorded with its error.

Usage (GPU)::

    python benchmarks/bench_attention.py --seq 16384 65536 131072 --out docs/benchmarks/attention_h200.json
    python benchmarks/bench_attention.py --replot docs/benchmarks/attention_h200.json   # the PNG again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_common import git_commit  # noqa: E402
from bench_train import machine_info  # noqa: E402

SHAPES = {"7b": (32, 128), "1b": (32, 64)}
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def run_case(shape: str, seq: int, backend: str, reps: int, ref: dict | None) -> tuple:
    """One backend at one shape: ``(row, ref)``, ``ref`` the reference results (set by the first backend)."""
    heads, dim = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    fwd_flops = 2 * 2 * seq * seq * heads * dim / 2
    row = dict(shape=shape, heads=heads, head_dim=dim, seq=seq, backend=backend)
    try:
        with (sdpa_kernel([BACKENDS[backend]]) if BACKENDS[backend] is not None else contextlib.nullcontext()):
            def fwd():
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

            def fwd_bwd():
                q.grad = k.grad = v.grad = None
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(dout)
                return out

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t_f = _time(fwd, reps)
            t_fb = _time(fwd_bwd, reps)
            out = fwd_bwd().detach()
            row.update(status="ok", fwd_s=t_f, fwd_bwd_s=t_fb, fwd_tflops=fwd_flops / t_f / 1e12,
                       fwd_bwd_tflops=3 * fwd_flops / t_fb / 1e12,
                       peak_extra_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
            got = dict(out=out, dq=q.grad, dk=k.grad, dv=v.grad)
            if ref is None:
                ref = {n: t.clone() for n, t in got.items()}
                row["ref"] = True
            else:
                row["rel_max_diff"] = {n: float((got[n].float() - ref[n].float()).abs().max()
                                                / ref[n].float().abs().max()) for n in got}
    except Exception as e:  # a backend that does not support the shape: recorded, the others go on
        row.update(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    del q, k, v, dout
    torch.cuda.empty_cache()
    return row, ref


def plot(doc: dict, path: str) -> None:
    """Forward + backward TF/s per backend against the sequence length, one panel per head shape (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in doc["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for b in dict.fromkeys(r["backend"] for r in doc["rows"]):
            pts = [(r["seq"], r["fwd_bwd_tflops"]) for r in doc["rows"]
                   if r["shape"] == shape and r["backend"] == b and r["status"] == "ok"]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=b)
        h, d = SHAPES[shape]
        ax.set(xscale="log", xlabel="tokens (batch 1)", ylabel="forward + backward TFLOP/s (causal)",
               title=f"{shape}: {h} heads x {d}")
        ax.legend(fontsize=8)
    fig.suptitle(f"causal SDPA per backend, {doc.get('gpu', '')}, torch {doc.get('torch', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536, 131072])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--backends", nargs="+", default=["flash", "cudnn", "efficient", "default"], choices=list(BACKENDS),
                    help="the first is the reference for the agreement columns (default: flash); "
                         "'default' is torch's own choice (no sdpa_kernel context)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON file (rows written as they finish) and its PNG")
    ap.add_argument("--replot", metavar="JSON", help="only draw the PNG of an earlier run's JSON (no GPU needed)")
    a = ap.parse_args(argv)
    if a.replot:
        plot(json.load(open(a.replot)), a.replot.rsplit(".", 1)[0] + ".png")
        return 0
    if not torch.cuda.is_available():
        print("bench_attention.py: needs CUDA (SDPA's flash / cuDNN kernels are GPU kernels)", file=sys.stderr)
        return 2
    rows, doc = [], dict(machine=machine_info(), commit=git_commit(), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                         torch=torch.__version__, gpu=torch.cuda.get_device_name(),
                         cudnn=torch.backends.cudnn.version(), args=vars(a))
    print(f"{'shape':>5} {'seq':>7} {'backend':>9} {'fwd s':>8} {'fwd TF/s':>8} {'f+b s':>8} {'f+b TF/s':>8} "
          f"{'extra GiB':>9}  agreement / status")
    for shape in a.shapes:
        for seq in a.seq:
            ref = None
            for b in a.backends:
                row, ref = run_case(shape, seq, b, a.reps, ref)
                rows.append(row)
                if row["status"] == "ok":
                    agree = ("reference" if row.get("ref") else
                             " ".join(f"{n} {v:.1e}" for n, v in row["rel_max_diff"].items()))
                    print(f"{shape:>5} {seq:>7} {b:>9} {row['fwd_s']:8.4f} {row['fwd_tflops']:8.1f} "
                          f"{row['fwd_bwd_s']:8.4f} {row['fwd_bwd_tflops']:8.1f} {row['peak_extra_gib']:9.2f}  {agree}",
                          flush=True)
                else:
                    print(f"{shape:>5} {seq:>7} {b:>9}  {row['status']}", flush=True)
                if a.out:
                    doc["rows"] = rows
                    with open(a.out, "w") as f:
                        json.dump(doc, f, indent=1)
    if a.out:
        plot(doc, a.out.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
