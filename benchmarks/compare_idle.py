"""Compute-stream idle time of profiled training steps from several source trees, side by side.

Each trace (a Kineto Chrome trace of one profiled step, written by ``bench_train.py --profile``)
is summarised by this tree's :mod:`trace_summary`, so that traces taken with older trees'
benchmark scripts are measured the same way. Two idle measures per step:

* ``idle_window_s``: idle inside the window from the first to the last GPU activity of the step
  (what ``bench_train.py --profile`` prints as "idle");
* ``idle_step_s``: idle from the CPU start of the step (its ``ProfilerStep#`` annotation) to its
  last GPU activity: it also counts a host wait before the step's first GPU activity (e.g. for the
  CPU AdamW update of the first unit the forward needs), which the window leaves out.

    python benchmarks/compare_idle.py --out idle.json [--png idle.png] LABEL=TRACE.json [LABEL=TRACE.json ...]

LABEL names the tree (several traces may share a label: repeated runs). Prints one row per trace
and the mean per label; writes the rows and the means as JSON to ``--out`` and, with ``--png``, a
chart of both idle measures per trace.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_summary import summarize  # noqa: E402


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def compare(items) -> dict:
    """``items``: ``[(label, trace_path)]`` -> ``dict(rows=[...], means={label: {...}})`` (seconds)."""
    rows = []
    for label, path in items:
        s = summarize(_load(path))
        rows.append(dict(label=label, trace=os.path.basename(path), window_s=s["window_s"],
                         compute_busy_s=s["compute_busy_s"], idle_window_s=s["compute_idle_s"],
                         host_lead_s=s["host_lead_s"], step_span_s=s["step_span_s"],
                         idle_step_s=s["compute_idle_step_s"], largest_gaps_s=s["largest_idle_gaps_s"][:3],
                         idle_gaps=s["idle_gaps"]))
    by = collections.defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    keys = ("window_s", "compute_busy_s", "idle_window_s", "host_lead_s", "idle_step_s")
    means = {lab: {k: (sum(r[k] for r in rs) / len(rs) if all(r[k] is not None for r in rs) else None) for k in keys}
             for lab, rs in by.items()}
    for lab, m in means.items():
        m["n"] = len(by[lab])
    return dict(rows=rows, means=means)


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="LABEL=TRACE.json (or .json.gz)")
    ap.add_argument("--out", help="write the rows and means as JSON here")
    ap.add_argument("--png", help="write a chart of the idle time per trace here")
    args = ap.parse_args()
    items = []
    for t in args.traces:
        label, sep, path = t.partition("=")
        if not sep or not path:
            ap.error(f"{t!r}: give LABEL=TRACE.json")
        items.append((label, path))
    res = compare(items)
    print(f"{'tree':<12} {'trace':<28} {'busy ms':>8} {'window':>8} {'idle(win)':>9} {'lead':>6} {'idle(step)':>10}  largest gaps ms")
    for r in res["rows"]:
        print(f"{r['label']:<12} {r['trace'][:28]:<28} {_ms(r['compute_busy_s']):>8} {_ms(r['window_s']):>8} "
              f"{_ms(r['idle_window_s']):>9} {_ms(r['host_lead_s']):>6} {_ms(r['idle_step_s']):>10}  "
              + ", ".join(_ms(g) for g in r["largest_gaps_s"]))
    for lab, m in res["means"].items():
        print(f"mean {lab:<7} n={m['n']}  busy {_ms(m['compute_busy_s'])} ms, idle in window {_ms(m['idle_window_s'])} ms, "
              f"host lead {_ms(m['host_lead_s'])} ms, idle over the step {_ms(m['idle_step_s'])} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.png:
        plot(res, args.png)


def plot(res: dict, path: str) -> None:
    """Bar chart: per trace, the compute idle inside the GPU window and over the whole step (ms)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = sorted(res["rows"], key=lambda r: r["label"])
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar([i - 0.2 for i in x], [r["idle_window_s"] * 1e3 for r in rows], 0.4, label="idle in the GPU window")
    ax.bar([i + 0.2 for i in x], [(r["idle_step_s"] or 0) * 1e3 for r in rows], 0.4, label="idle from the step's host start")
    runs = collections.Counter()
    ticks = []
    for r in rows:
        runs[r["label"]] += 1
        ticks.append(f"{r['label']}\nrun {runs[r['label']]}")
    ax.set_xticks(list(x), ticks, fontsize=8)
    ax.set_ylabel("compute-stream idle per step (ms)")
    ax.legend(fontsize=8)
    ax.set_title("profiled steps, one bar pair per trace", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
