"""CPU AdamW throughput: megatrain's fused step vs torch.optim.AdamW(fused=True) and (foreach=True).

All contenders update the same size of fp32 state in one run, side by side, so the ratios are
comparable; achieved host bandwidth is set against a memcpy bandwidth measured in the same run.

Bytes counted per parameter for megatrain: read master, exp_avg, exp_avg_sq (3 x 4 B) and grad
(4 B fp32 or 2 B bf16); write master, exp_avg, exp_avg_sq (3 x 4 B) and the bf16 compute copy
(2 B): 30 B with fp32 grads, 28 B with bf16 grads. torch's AdamW reads p, g, m, v and writes p, m,
v (28 B); its GB/s uses that count. memcpy counts read + write.

Usage:
    python benchmarks/bench_cpu_adam.py                      # 256M parameters
    python benchmarks/bench_cpu_adam.py --numel 16M --steps 3
    python benchmarks/bench_cpu_adam.py --out docs/benchmarks --tag h200-xeon16
"""

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import time
from pathlib import Path

import torch

import megatrain.ops as ops
from megatrain._ext import _C as C


def parse_count(text):
    """'256M' -> 268435456, '1.5G' -> 1610612736, '1000' -> 1000 (binary multiples)."""
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       cwd=Path(__file__).resolve().parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return C.build_info().get("git_sha", "unknown")


def time_it(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="256M", help="parameters to update (suffix K/M/G = 2^10/2^20/2^30)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per contender (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--isa", action="append", default=None,
                    help="megatrain ISA(s) to time (default: every one this CPU supports)")
    ap.add_argument("--skip-foreach", action="store_true", help="skip torch foreach (slow at 256M)")
    ap.add_argument("--out", default=None,
                    help="directory (writes cpu_adam_<tag>.json there) or a .json path")
    ap.add_argument("--tag", default=None, help="name for the result file (default: hostname)")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    n = parse_count(args.numel)
    isas = args.isa or C.supported_isas()
    torch.manual_seed(0)
    lr, wd = 1e-4, 0.1

    # megatrain state (the compute copy is bf16, as in training).
    master = torch.randn(n)
    exp_avg = torch.zeros(n)
    exp_avg_sq = torch.zeros(n)
    grad = torch.randn(n) * 1e-3
    grad_bf16 = grad.to(torch.bfloat16)
    compute = torch.empty(n, dtype=torch.bfloat16)

    results = {}

    # memcpy reference: copy one state-sized buffer (>= 64 MiB), count read + write.
    mc_numel = max(n, 16 * 2**20)
    src, dst = torch.ones(mc_numel), torch.empty(mc_numel)
    t, _ = time_it(lambda: dst.copy_(src), args.steps, args.warmup)
    memcpy_gbs = 2 * mc_numel * 4 / t / 1e9
    results["memcpy"] = {"seconds": t, "GB_per_s": memcpy_gbs, "bytes": 2 * mc_numel * 4}
    del src, dst

    before = C.cpu_isa()
    step = [0]
    for isa in isas:
        C.set_cpu_isa(isa)
        for gname, g, gbytes in (("fp32", grad, 4), ("bf16", grad_bf16, 2)):
            def run():
                step[0] += 1
                ops.adamw_step_(master, exp_avg, exp_avg_sq, g, compute, lr=lr, weight_decay=wd,
                                step=step[0])
            t, times = time_it(run, args.steps, args.warmup)
            bytes_ = n * (12 + gbytes + 12 + 2)
            results[f"megatrain_{isa}_grad_{gname}"] = {
                "seconds": t, "times": times, "Gparam_per_s": n / t / 1e9,
                "GB_per_s": bytes_ / t / 1e9, "bytes_per_param": 12 + gbytes + 12 + 2,
            }
    C.set_cpu_isa(before)
    del master, exp_avg, exp_avg_sq, grad_bf16, compute

    p = torch.nn.Parameter(torch.randn(n))
    p.grad = grad
    variants = [("torch_fused", dict(fused=True))]
    if not args.skip_foreach:
        variants.append(("torch_foreach", dict(foreach=True)))
    for name, kw in variants:
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, **kw)
        t, times = time_it(opt.step, args.steps, args.warmup)
        results[name] = {"seconds": t, "times": times, "Gparam_per_s": n / t / 1e9,
                         "GB_per_s": n * 28 / t / 1e9, "bytes_per_param": 28}
        del opt

    # Ratios against torch (same numel, same run).
    best = max((k for k in results if k.startswith("megatrain_") and k.endswith("grad_fp32")),
               key=lambda k: results[k]["Gparam_per_s"])
    for k, r in results.items():
        if k.startswith("megatrain_"):
            r["x_torch_fused"] = r["Gparam_per_s"] / results["torch_fused"]["Gparam_per_s"]
            if "torch_foreach" in results:
                r["x_torch_foreach"] = r["Gparam_per_s"] / results["torch_foreach"]["Gparam_per_s"]
        if "GB_per_s" in r and k != "memcpy":
            r["fraction_of_memcpy"] = r["GB_per_s"] / memcpy_gbs

    report = {
        "benchmark": "cpu_adam",
        "machine": {"hostname": socket.gethostname(), "cpu": cpu_model(), "logical_cpus": os.cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "torch_version": torch.__version__,
        "megatrain_build": C.build_info(),
        "threads": torch.get_num_threads(),
        "numel": n,
        "steps": args.steps,
        "results": results,
        "tag": args.tag,
    }

    print(f"CPU AdamW, {n / 1e6:.1f}M params, {torch.get_num_threads()} threads, {cpu_model()}")
    print(f"memcpy: {memcpy_gbs:.1f} GB/s (read+write)")
    print(f"{'contender':32s} {'ms':>9s} {'Gparam/s':>9s} {'GB/s':>7s} {'%memcpy':>8s} {'x fused':>8s} {'x foreach':>9s}")
    for k, r in results.items():
        if k == "memcpy":
            continue
        print(f"{k:32s} {r['seconds'] * 1e3:9.2f} {r['Gparam_per_s']:9.3f} {r['GB_per_s']:7.1f} "
              f"{100 * r['fraction_of_memcpy']:7.1f}% {r.get('x_torch_fused', float('nan')):8.2f} "
              f"{r.get('x_torch_foreach', float('nan')):9.2f}")
    print(f"best megatrain (fp32 grads): {best}")

    if args.out:
        out = Path(args.out)
        if out.suffix != ".json":
            out = out / f"cpu_adam_{args.tag or socket.gethostname()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
