"""CPU AdamW throughput: megatrain's fused step vs torch.optim.AdamW(fused=True) and (foreach=True),
against a host-bandwidth roofline measured in the same run.

Everything updates the same number of fp32 parameters in one process, side by side, so the ratios
are comparable.

Roofline (STREAM-style, ``torch.ops.megatrain.bench_stream`` of the ``megatrain._bench`` extension): copy, triad and an "AdamW-shaped"
stream (read p, m, v and the grad, write p, m, v and a bf16 copy, trivial arithmetic), run on all
threads with the same ``at::parallel_for`` chunking as ``megatrain::adamw_step_``, on the very
arrays each megatrain variant updates (same size, same allocation), each with and without
non-temporal stores for the write-only array. Bytes are counted the STREAM way (explicit reads +
writes; the read-for-ownership of a write-allocate is not counted). A contender's roofline is the
best AdamW-shaped stream with its bytes per parameter over every memory layout in the run
("%roof"); "%own" is against the same stream on the contender's own memory (kernel efficiency
alone); "%copy" against the best copy. The old "memcpy" figure (one ``torch.Tensor.copy_``, read
+ write) is kept, labelled legacy, for continuity with earlier results.

Bytes counted per parameter for megatrain: read master, exp_avg, exp_avg_sq (3 x 4 B) and grad
(4 B fp32 or 2 B bf16); write master, exp_avg, exp_avg_sq (3 x 4 B) and the bf16 compute copy
(2 B): 30 B with fp32 grads, 28 B with bf16 grads. torch's AdamW reads p, g, m, v and writes p, m,
v (28 B); its GB/s uses that count.

megatrain variants (``--variants``, comma separated) A/B the switches of
csrc/megatrain/common/tuning.h in one run:
    torchmem        state in ordinary torch tensors (what this benchmark timed before), ordinary stores
    store_old       the training path as it was: HostStore arena (compute | master | exp_avg |
                    exp_avg_sq | grad_accum back to back) + pinned_empty bf16 grads, huge pages, no
                    skew (MEGATRAIN_STORE_SKEW=0), ordinary stores
    store_4k        HostStore with staggered sections, 4 KiB pages (MEGATRAIN_HUGEPAGES=0)
    store_hp        staggered sections, huge pages (2 MiB-aligned arena, MADV_HUGEPAGE)
    store_4k_nt     staggered, 4 KiB pages, non-temporal stores for the bf16 compute copy
    store_hp_nt     staggered, huge pages, non-temporal stores, no software prefetch
    store_hp_nt_pf  the same + software prefetch 1024 B ahead (the defaults now)
    NAME:hp=0|1:sk=0|1:nt=0|1:pf=BYTES   a preset (or "store" / "torchmem") with overrides,
                    e.g. store:hp=1:sk=1:nt=1:pf=512
Each variant is timed with three gradient sources, as training has them: "fp32", the store's
grad_accum section (gradient accumulation > 1; 30 B/param); "bf16", a pinned_empty staging buffer
(28 B/param); "bf16c", the bf16 gradient in the compute section itself, which the update then
overwrites with the new weights (the engine's direct D2H path at accumulation 1; 28 B/param, two
streams fewer, and no streaming stores: the kernel has just read those lines). torch_fused_store (``--no-torch-store`` skips it) runs torch's fused
AdamW on HostStore memory (huge pages, staggered) as well, so a gain that comes only from the
memory shows as such; "x fused" is always against torch_fused on ordinary torch tensors (the
reference of the issue).

Usage:
    python benchmarks/bench_cpu_adam.py                      # 256M parameters, default variants
    python benchmarks/bench_cpu_adam.py --numel 16M --steps 3
    python benchmarks/bench_cpu_adam.py --threads 16 --out docs/benchmarks --tag h200-xeon16
"""

import argparse
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path

import torch

import megatrain._bench  # noqa: F401  (registers torch.ops.megatrain.bench_stream)
import megatrain.ops as ops
from megatrain._ext import _C as C

from bench_common import git_commit

PRESETS = {
    "torchmem": dict(alloc="torch", hp=None, sk=None, nt=0, pf=0),
    "store_old": dict(alloc="store", hp=1, sk=0, nt=0, pf=0),
    "store_4k": dict(alloc="store", hp=0, sk=1, nt=0, pf=0),
    "store_hp": dict(alloc="store", hp=1, sk=1, nt=0, pf=0),
    "store_4k_nt": dict(alloc="store", hp=0, sk=1, nt=1, pf=0),
    "store_hp_nt": dict(alloc="store", hp=1, sk=1, nt=1, pf=0),
    "store_hp_nt_pf": dict(alloc="store", hp=1, sk=1, nt=1, pf=1024),
    "store": dict(alloc="store", hp=1, sk=1, nt=1, pf=1024),
}
DEFAULT_VARIANTS = "torchmem,store_old,store_4k,store_hp,store_hp_nt,store_hp_nt_pf"

# Stream kernels: name -> (kind, grad dtype or None, with bf16 out, nt stores)
STREAMS = {
    "copy": ("copy", None, False, False),
    "copy_nt": ("copy", None, False, True),
    "triad": ("triad", None, False, False),
    "triad_nt": ("triad", None, False, True),
    "adam_g32": ("adam", torch.float32, True, False),
    "adam_g32_nt": ("adam", torch.float32, True, True),
    "adam_g16": ("adam", torch.bfloat16, True, False),
    "adam_g16_nt": ("adam", torch.bfloat16, True, True),
    "adam_g16c": ("adam", "compute", True, False),
    "adam_g16c_nt": ("adam", "compute", True, True),
    "adam_g32_noout": ("adam", torch.float32, False, False),
}
# Which stream kernels bound a contender with this many bytes per parameter.
ROOF_KERNELS = {30: ["adam_g32", "adam_g32_nt"], 28: ["adam_g16", "adam_g16_nt"],
                "28c": ["adam_g16c", "adam_g16c_nt"], "torch": ["adam_g32_noout"], "copy": ["copy", "copy_nt"]}
# Gradient sources timed per megatrain variant: name -> (State attribute, bytes per param, roofline key)
GRADS = {
    "fp32": ("g32", 30, 30),       # fp32 grad_accum section (gradient accumulation > 1)
    "bf16": ("g16", 28, 28),       # bf16 pinned staging buffer
    "bf16c": ("compute", 28, "28c"),  # bf16 gradient in the compute section itself, overwritten
                                      # by the update (training's direct D2H path, accumulation 1)
}


def parse_count(text):
    """'256M' -> 268435456, '1.5G' -> 1610612736, '1000' -> 1000 (binary multiples)."""
    text = text.strip().upper()
    mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def parse_variants(text):
    out = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        name, *kvs = token.split(":")
        if name not in PRESETS:
            raise SystemExit(f"unknown variant {name!r}; presets: {', '.join(PRESETS)}")
        v = dict(PRESETS[name], label=token)
        for kv in kvs:
            k, _, val = kv.partition("=")
            if k not in ("hp", "sk", "nt", "pf") or not val.isdigit():
                raise SystemExit(f"bad variant option {kv!r} in {token!r} (hp=0|1, sk=0|1, nt=0|1, pf=BYTES)")
            v[k] = int(val)
        if v["alloc"] == "torch" and (v["hp"] is not None or v["sk"] is not None):
            raise SystemExit(f"{token}: torch tensors have no huge-page / skew switch (use a store variant)")
        out.append(v)
    return out


def memory_kind(v):
    return "torchmem" if v["alloc"] == "torch" else f"store_hp{v['hp']}_sk{v['sk']}"


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def time_it(fn, steps, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def huge_fraction(tensors):
    total = sum(t.numel() * t.element_size() for t in tensors)
    huge = [C.huge_page_bytes(t) for t in tensors]
    if total == 0 or any(h < 0 for h in huge):
        return None
    return sum(huge) / total


class State:
    """The arrays one AdamW update touches, allocated as `kind` says.

    torchmem: ordinary torch tensors. store_hp{0,1}_sk{0,1}: the training path, one HostStore
    arena (bf16 compute, with grad_accum; pinned when a GPU is visible, as the engine does) with
    MEGATRAIN_HUGEPAGES / MEGATRAIN_STORE_SKEW as given, and a pinned_empty bf16 staging buffer.
    """

    def __init__(self, kind, n, pin, tuning_default):
        self.kind, self.store = kind, None
        t0 = time.perf_counter()
        if kind == "torchmem":
            self.master, self.exp_avg, self.exp_avg_sq, self.g32 = (torch.empty(n) for _ in range(4))
            self.compute, self.g16 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        else:
            hp, sk = int(kind[8]), int(kind[-1])
            C.set_tuning(hugepages=bool(hp), store_skew=bool(sk))
            self.store = C.HostStore([[("w", [n])]], torch.bfloat16, True, pin)
            self.master, self.exp_avg, self.exp_avg_sq, self.compute, self.g32 = (
                self.store.section(0, s)[:n] for s in ("master", "exp_avg", "exp_avg_sq", "compute", "grad_accum"))
            self.g16 = C.pinned_empty(n, torch.bfloat16)
            C.set_tuning(hugepages=tuning_default["hugepages"], store_skew=tuning_default["store_skew"])
        self.alloc_seconds = time.perf_counter() - t0

    def tensors(self):
        return [self.master, self.exp_avg, self.exp_avg_sq, self.compute, self.g32, self.g16]

    def reset(self, master0, grad0, grad0_bf16):
        self.master.copy_(master0), self.exp_avg.zero_(), self.exp_avg_sq.zero_(), self.compute.zero_()
        self.g32.copy_(grad0), self.g16.copy_(grad0_bf16)

    def info(self):
        d = {"alloc_seconds": self.alloc_seconds, "huge_page_fraction": huge_fraction(self.tensors())}
        if self.store is not None:
            d["hugepage_advised"] = self.store.hugepage_advised
            d["skew_sections"] = self.store.skew_sections
            d["offsets_mod_256KiB"] = {name: (t.data_ptr() % (256 << 10)) // 1024 for name, t in (
                ("master", self.master), ("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq),
                ("grad_accum", self.g32), ("compute", self.compute), ("grad_bf16", self.g16))}
        return d


def measure_streams(st, n, steps, warmup):
    """Every STREAMS kernel on the state's own arrays (contents are clobbered: reset after)."""
    row = {}
    for name, (k, gdt, with_out, nt) in STREAMS.items():
        if k == "copy":
            arr = [st.exp_avg, st.master]
        elif k == "triad":
            arr = [st.master, st.exp_avg, st.exp_avg_sq]
        else:
            g = {torch.float32: st.g32, torch.bfloat16: st.g16, "compute": st.compute}[gdt]
            arr = [st.master, st.exp_avg, st.exp_avg_sq, g] + ([st.compute] if with_out else [])
        nbytes = [0]

        def run(k=k, arr=arr, nt=nt):
            nbytes[0] = torch.ops.megatrain.bench_stream(k, arr, nt, C.cpu_isa())
        ts, times = time_it(run, steps, warmup)
        row[name] = {"seconds": ts, "times": times, "bytes": nbytes[0], "GB_per_s": nbytes[0] / ts / 1e9,
                     "bytes_per_elem": nbytes[0] // n}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", default="256M", help="parameters to update (suffix K/M/G = 2^10/2^20/2^30)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per contender (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--isa", action="append", default=None,
                    help="megatrain ISA(s) to time (default: the best this CPU supports)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"megatrain memory variants, comma separated (default: {DEFAULT_VARIANTS})")
    ap.add_argument("--skip-foreach", action="store_true", help="skip torch foreach (slow at 256M)")
    ap.add_argument("--no-torch-store", action="store_true", help="skip torch fused on HostStore memory")
    ap.add_argument("--out", default=None,
                    help="directory (writes cpu_adam_<tag>.json there) or a .json path")
    ap.add_argument("--tag", default=None, help="name for the result file (default: hostname)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = parse_count(args.numel)
    isas = args.isa or [C.supported_isas()[-1]]
    variants = parse_variants(args.variants)
    pin = torch.cuda.is_available()  # as the engine: the store is pinned when training on CUDA
    tuning_default = C.tuning()
    isa_before = C.cpu_isa()
    torch.manual_seed(0)
    lr, wd = 1e-4, 0.1
    master0 = torch.randn(n)
    grad0 = torch.randn(n) * 1e-3
    grad0_bf16 = grad0.to(torch.bfloat16)
    results, info, stream = {}, {}, {}

    # --- legacy memcpy (kept for continuity): copy one state-sized buffer, count read + write.
    mc_numel = max(n, 16 * 2**20)
    src, dst = torch.ones(mc_numel), torch.empty(mc_numel)
    t, _ = time_it(lambda: dst.copy_(src), args.steps, args.warmup)
    legacy_gbs = 2 * mc_numel * 4 / t / 1e9
    results["memcpy"] = {"seconds": t, "GB_per_s": legacy_gbs, "bytes": 2 * mc_numel * 4,
                         "note": "legacy: one torch Tensor.copy_ (torch allocator); not a roofline"}
    del src, dst

    # --- megatrain variants; the stream roofline on each memory kind's own arrays (first use).
    step = [0]
    st = None
    try:
        for var in variants:
            label, kind = var["label"], memory_kind(var)
            if st is None or st.kind != kind:
                st = None
                gc.collect()
                st = State(kind, n, pin, tuning_default)
                st.reset(master0, grad0, grad0_bf16)
            if kind not in stream:
                C.set_cpu_isa(isas[-1])
                stream[kind] = dict(measure_streams(st, n, args.steps, args.warmup),
                                    huge_page_fraction=huge_fraction(st.tensors()))
                st.reset(master0, grad0, grad0_bf16)
            C.set_tuning(nt_stores=bool(var["nt"]), prefetch_bytes=var["pf"])
            info[label] = dict(var, memory=kind, **st.info())
            for isa in isas:
                C.set_cpu_isa(isa)
                for gname, (attr, bpp, roof_key) in GRADS.items():
                    if attr == "compute":
                        # Later steps read the weights the previous one wrote as their gradient:
                        # other values, the same memory traffic.
                        st.compute.copy_(grad0_bf16)

                    def run(g=getattr(st, attr)):
                        step[0] += 1
                        ops.adamw_step_(st.master, st.exp_avg, st.exp_avg_sq, g, st.compute, lr=lr,
                                        weight_decay=wd, step=step[0])
                    t, times = time_it(run, args.steps, args.warmup)
                    results[f"megatrain_{label}_{isa}_grad_{gname}"] = {
                        "variant": label, "memory": kind, "isa": isa, "grad": gname,
                        "seconds": t, "times": times, "Gparam_per_s": n / t / 1e9,
                        "GB_per_s": n * bpp / t / 1e9, "bytes_per_param": bpp, "roofline_key": roof_key,
                        "huge_page_fraction": info[label]["huge_page_fraction"],
                    }
            C.set_tuning(**tuning_default)
    finally:
        C.set_cpu_isa(isa_before)
        C.set_tuning(**tuning_default)
    st = None
    gc.collect()

    # --- torch.
    torch_runs = [("torch_fused", dict(fused=True), False)]
    if not args.no_torch_store:
        torch_runs.append(("torch_fused_store", dict(fused=True), True))
    if not args.skip_foreach:
        torch_runs.append(("torch_foreach", dict(foreach=True), False))
    for name, kw, on_store in torch_runs:
        if on_store:
            st = State("store_hp1_sk1", n, pin, tuning_default)
            st.reset(master0, grad0, grad0_bf16)
            p = torch.nn.Parameter(st.master)
            p.grad = st.g32
            opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, **kw)
            opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                            "exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq}
            memory = st.kind
        else:
            p = torch.nn.Parameter(master0.clone())
            p.grad = grad0.clone()
            opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, **kw)
            memory = "torchmem"
        t, times = time_it(opt.step, args.steps, args.warmup)
        s_ = opt.state[p]
        results[name] = {"memory": memory, "seconds": t, "times": times, "Gparam_per_s": n / t / 1e9,
                         "GB_per_s": n * 28 / t / 1e9, "bytes_per_param": 28, "roofline_key": "torch",
                         "huge_page_fraction": huge_fraction([p.detach(), p.grad, s_["exp_avg"], s_["exp_avg_sq"]])}
        del opt, p, s_
        st = None
        gc.collect()

    # --- rooflines and ratios.
    def best(names, kinds=None):
        cands = [(row[nm]["GB_per_s"], kind, nm) for kind, row in stream.items()
                 if kinds is None or kind in kinds for nm in names]
        return max(cands) if cands else (float("nan"), None, None)

    roof = {key: best(names) for key, names in ROOF_KERNELS.items()}
    fused = results["torch_fused"]["Gparam_per_s"]
    for k, r in results.items():
        if k == "memcpy":
            continue
        r["x_torch_fused"] = r["Gparam_per_s"] / fused
        if "torch_foreach" in results:
            r["x_torch_foreach"] = r["Gparam_per_s"] / results["torch_foreach"]["Gparam_per_s"]
        r["fraction_of_roofline"] = r["GB_per_s"] / roof[r["roofline_key"]][0]
        own = best(ROOF_KERNELS[r["roofline_key"]], kinds=[r["memory"]])
        r["fraction_of_own_memory_roofline"] = r["GB_per_s"] / own[0] if own[1] else None
        r["fraction_of_stream_copy"] = r["GB_per_s"] / roof["copy"][0]
        r["fraction_of_legacy_memcpy"] = r["GB_per_s"] / legacy_gbs
    mega = {k: r for k, r in results.items() if k.startswith("megatrain_")}
    best_of = {g: max((k for k in mega if k.endswith(f"grad_{g}")), key=lambda k: mega[k]["Gparam_per_s"])
               for g in GRADS}

    report = {
        "benchmark": "cpu_adam",
        "machine": {"hostname": socket.gethostname(), "cpu": cpu_model(), "logical_cpus": os.cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit() or C.build_info().get("git_sha", "unknown"),
        "torch_version": torch.__version__,
        "megatrain_build": C.build_info(),
        "threads": torch.get_num_threads(),
        "numel": n,
        "steps": args.steps,
        "pinned": pin,
        "transparent_hugepage": C.transparent_hugepage_mode(),
        "tuning_default": tuning_default,
        "variants": info,
        "stream": stream,
        "roofline": {str(k): {"GB_per_s": v[0], "memory": v[1], "kernel": v[2]} for k, v in roof.items()},
        "results": results,
        "best": {f"grad_{g}": k for g, k in best_of.items()},
        "wall_seconds": time.perf_counter() - t_start,
        "tag": args.tag,
    }

    print(f"CPU AdamW, {n / 1e6:.1f}M params, {torch.get_num_threads()} threads, {cpu_model()}, "
          f"ISA {','.join(isas)}, THP {C.transparent_hugepage_mode()}, pinned {pin}, defaults {tuning_default}")
    print("host bandwidth, GB/s (STREAM-style, all threads, explicit bytes read + written), on each "
          "memory layout's own arrays:")
    print(f"  {'memory':14s} {'huge%':>6s} " + " ".join(f"{nm:>14s}" for nm in STREAMS))
    for kind, row in stream.items():
        hf = row["huge_page_fraction"]
        print(f"  {kind:14s} {'-' if hf is None else f'{100 * hf:5.1f}%':>6s} "
              + " ".join(f"{row[nm]['GB_per_s']:14.1f}" for nm in STREAMS))
    print(f"  legacy memcpy (one torch copy_, not a roofline): {legacy_gbs:.1f} GB/s")
    for key, label in ((30, "megatrain fp32 grads (30 B/param)"), (28, "megatrain bf16 grads (28 B/param)"),
                       ("28c", "megatrain bf16 grads in the compute section (28 B/param)"),
                       ("torch", "torch AdamW (28 B/param)"), ("copy", "copy")):
        gbs, kind, nm = roof[key]
        extra = f" = {gbs / (key if isinstance(key, int) else 28):.3f} Gparam/s max" if key != "copy" else ""
        print(f"  roofline {label}: {gbs:.1f} GB/s ({nm} on {kind}){extra}")
    print(f"{'contender':40s} {'huge%':>6s} {'ms':>8s} {'Gparam/s':>9s} {'GB/s':>7s} {'%roof':>6s} "
          f"{'%own':>6s} {'%copy':>6s} {'%legacy':>8s} {'x fused':>8s}")
    pct = lambda x: "     -" if x is None else f"{100 * x:5.1f}%"  # noqa: E731
    for k, r in results.items():
        if k == "memcpy":
            continue
        print(f"{k:40s} {pct(r.get('huge_page_fraction'))} {r['seconds'] * 1e3:8.2f} "
              f"{r['Gparam_per_s']:9.3f} {r['GB_per_s']:7.1f} {pct(r['fraction_of_roofline'])} "
              f"{pct(r['fraction_of_own_memory_roofline'])} {pct(r['fraction_of_stream_copy'])} "
              f"{100 * r['fraction_of_legacy_memcpy']:7.1f}% {r['x_torch_fused']:8.2f}")
    print("best megatrain: " + "; ".join(f"grad {g}: {k} ({mega[k]['Gparam_per_s']:.3f} Gparam/s, "
                                         f"{mega[k]['x_torch_fused']:.2f}x fused)" for g, k in best_of.items())
          + f"; wall {report['wall_seconds']:.0f} s")

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
