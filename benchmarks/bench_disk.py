"""Sequential write and read bandwidth of a directory's disk, through megatrain's DiskTier and dd.

For each I/O thread count, a DiskTier of ``--total-gb`` split into units of ``--unit-gb`` (three
equal fp32 sections each, like a decoder layer's master / exp_avg / exp_avg_sq: a 7B Llama layer
is ~2.4 GB) writes every unit (write-behind, then flush with fdatasync) and reads them all back
(read-ahead into ``--buffers`` RAM buffers), timed from the first issued I/O to the last one done.
The baseline is ``dd`` with O_DIRECT (``oflag=direct conv=fdatasync`` / ``iflag=direct``) over the
same byte count in 64 MiB blocks. Prints a table; with ``--out PREFIX`` writes PREFIX.json (and
PREFIX.png when matplotlib is installed).

    python benchmarks/bench_disk.py --dir /path/on/the/disk --out docs/benchmarks/disk_h200
    python benchmarks/bench_disk.py --quick          # a few hundred MB, a few seconds

Numbers are only meaningful with O_DIRECT (``direct_io`` in the output); where the filesystem
refuses it the page cache is measured too, and the table says so.
"""

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GB = 1e9


def _commit():
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent, text=True,
            stderr=subprocess.DEVNULL,
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _fs_type(path):
    try:
        return subprocess.check_output(["stat", "-f", "-c", "%T", path], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_tier(_C, root, unit_bytes, num_units, threads, buffers, chunk_bytes):
    """One DiskTier configuration: write all units, flush, drop the cache, read all back.

    Returns a dict with write_GBps / read_GBps (file bytes / wall seconds) and direct_io.
    """
    section = unit_bytes // 3
    units = [[section] * 3 for _ in range(num_units)]
    tier = _C.DiskTier(os.path.join(root, f"tier_t{threads}"), units, num_buffers=buffers,
                       io_threads=threads, chunk_bytes=chunk_bytes)
    total = _C.DiskTier.bytes_required(units)
    try:
        # Write: the first acquire zero-fills (and faults in) a buffer before the clock starts;
        # later zero fills overlap the writes already issued.
        t0 = None
        for u in range(num_units):
            tier.acquire(u)
            if t0 is None:
                t0 = time.perf_counter()
            tier.release(u, True)
        tier.flush()
        write_s = time.perf_counter() - t0
        tier.drop_cached()
        # Read: every unit asked for ahead; the queue is served as buffers come free.
        t0 = time.perf_counter()
        for u in range(num_units):
            tier.prefetch(u)
        for u in range(num_units):
            tier.acquire(u)
            tier.release(u, False)
        read_s = time.perf_counter() - t0
        st = tier.stats()
        assert st["bytes_read"] == total and st["bytes_written"] == total, st
        return {
            "tool": "DiskTier", "threads": threads, "bytes": total,
            "write_GBps": total / write_s / GB, "read_GBps": total / read_s / GB,
            "write_s": write_s, "read_s": read_s, "direct_io": tier.direct_io,
            "direct_io_note": tier.direct_io_note,
        }
    finally:
        del tier  # removes the files


def bench_dd(root, total_bytes):
    """dd with O_DIRECT, 64 MiB blocks: write (fdatasync at the end), then read."""
    if shutil.which("dd") is None:
        return None
    path = os.path.join(root, "dd.bin")
    block = 64 << 20
    count = max(1, math.ceil(total_bytes / block))
    direct = True
    try:
        t0 = time.perf_counter()
        r = subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
                            "oflag=direct", "conv=fdatasync"], capture_output=True, text=True)
        if r.returncode != 0:  # the filesystem refuses O_DIRECT
            direct = False
            t0 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}",
                            "conv=fdatasync"], capture_output=True, text=True, check=True)
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={block}"] + (["iflag=direct"] if direct else []),
                       capture_output=True, text=True, check=True)
        read_s = time.perf_counter() - t0
    finally:
        if os.path.exists(path):
            os.unlink(path)
    n = count * block
    return {"tool": "dd", "threads": 1, "bytes": n, "write_GBps": n / write_s / GB,
            "read_GBps": n / read_s / GB, "write_s": write_s, "read_s": read_s, "direct_io": direct,
            "direct_io_note": "" if direct else "dd refused O_DIRECT here: buffered"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir under $TMPDIR)")
    p.add_argument("--unit-gb", type=float, default=2.4, help="bytes per unit, GB (default 2.4: a 7B layer's fp32 state)")
    p.add_argument("--total-gb", type=float, default=4.8, help="bytes per configuration, GB (default 4.8)")
    p.add_argument("--threads", default="1,2,4,8", help="I/O thread counts (default 1,2,4,8)")
    p.add_argument("--buffers", type=int, default=2, help="RAM buffers of the tier (default 2)")
    p.add_argument("--chunk-mb", type=float, default=8, help="bytes per pread/pwrite, MiB (default 8)")
    p.add_argument("--max-seconds", type=float, default=55, help="skip the configurations left after this long")
    p.add_argument("--quick", action="store_true", help="64 MB units, 256 MB per configuration, threads 1,2,4")
    p.add_argument("--out", default=None, help="write OUT.json (and OUT.png) with the results")
    args = p.parse_args(argv)
    if args.quick:
        args.unit_gb, args.total_gb, args.threads = 0.064, 0.256, "1,2,4"

    from megatrain import _C

    unit_bytes = int(args.unit_gb * GB) // (3 * 4096) * (3 * 4096)
    num_units = max(1, round(args.total_gb * GB / unit_bytes))
    threads = [int(t) for t in args.threads.split(",") if t.strip()]
    chunk = int(args.chunk_mb * (1 << 20))
    own_dir = args.dir is None
    root = tempfile.mkdtemp(prefix="megatrain_bench_disk_") if own_dir else tempfile.mkdtemp(
        prefix="megatrain_bench_disk_", dir=args.dir)
    start = time.perf_counter()
    rows, skipped = [], []
    try:
        dd = bench_dd(root, unit_bytes * num_units)
        if dd:
            rows.append(dd)
        for t in threads:
            if time.perf_counter() - start > args.max_seconds:
                skipped.append(t)
                continue
            rows.append(bench_tier(_C, root, unit_bytes, num_units, t, args.buffers, chunk))
    finally:
        shutil.rmtree(root, ignore_errors=True)

    fs = _fs_type(args.dir or tempfile.gettempdir())
    print(f"dir {args.dir or tempfile.gettempdir()} ({fs}), {num_units} units x {unit_bytes / GB:.3f} GB, "
          f"{args.buffers} buffers, chunk {chunk >> 20} MiB")
    print(f"{'tool':<9} {'threads':>7} {'GB':>7} {'write GB/s':>11} {'read GB/s':>10}  direct_io")
    for r in rows:
        print(f"{r['tool']:<9} {r['threads']:>7} {r['bytes'] / GB:>7.2f} {r['write_GBps']:>11.3f} "
              f"{r['read_GBps']:>10.3f}  {r['direct_io']}{'  (' + r['direct_io_note'] + ')' if r['direct_io_note'] else ''}")
    if skipped:
        print(f"skipped (past --max-seconds {args.max_seconds}): threads {skipped}")
    print(f"total {time.perf_counter() - start:.1f} s")

    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": "bench_disk", "machine": platform.node(), "date": datetime.date.today().isoformat(),
            "commit": _commit(), "dir": args.dir, "filesystem": fs, "unit_bytes": unit_bytes,
            "num_units": num_units, "buffers": args.buffers, "chunk_bytes": chunk, "results": rows,
            "skipped_threads": skipped, "command": " ".join([sys.executable] + sys.argv),
        }
        out.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out.with_suffix('.json')}")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return 0
        labels = [f"{r['tool']}\n{r['threads']} thr" if r["tool"] != "dd" else "dd\nO_DIRECT" for r in rows]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.bar([i - 0.2 for i in x], [r["write_GBps"] for r in rows], 0.4, label="write")
        ax.bar([i + 0.2 for i in x], [r["read_GBps"] for r in rows], 0.4, label="read")
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{platform.node()} {fs}: sequential bandwidth ({unit_bytes / GB:.2f} GB units)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
        print(f"wrote {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
