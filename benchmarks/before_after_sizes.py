"""One before / after table across model sizes, from ``run_h200.sh before_after`` JSON files.

``run_h200.sh before_after`` (one call per size, ``BA_PRESET=3b|7b|8b``) writes two ``bench_train.py``
files per size and system: ``before_after_<preset>_<system>_{before,after}_clip<clip>.json`` (the
tree in ``.before/`` and this one, run alternately on the same machine). This script gathers them
into one JSON (rows: size, step_s before / after, their ratio, TFLOP/s, GPU and host peaks, both
commits) and a PNG of the step times (``--out``), and prints a Markdown table (the stage itself prints
it for each system and max_grad_norm).

    python benchmarks/before_after_sizes.py --system megatrain:policy=auto --presets 3b 7b 8b \\
        --out docs/benchmarks/before_after_sizes_h200.json

A run that did not finish (out of memory, an error) is a row with its status and no ratio.
Raises SystemExit (one line) when a file is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load_pair(folder: str, preset: str, system: str, clip: str, suffix: str = "") -> dict:
    """The before and after rows (and their files' commit and date) of one size."""
    lab = system.replace(":", "_").replace("=", "_").replace(",", "_")
    pair = {}
    for tree in ("before", "after"):
        pre = f"{preset}_" if preset else ""  # run_h200.sh names no preset in the file when BA_PRESET is unset
        path = os.path.join(folder, f"before_after_{pre}{lab}_{tree}_clip{clip}{suffix}.json")
        if not os.path.exists(path):
            sys.exit(f"before_after_sizes: {path} is missing; run `BA_PRESET={preset} BA_SYSTEMS={system} "
                     f"BA_CLIPS={clip} bash benchmarks/run_h200.sh before_after` first")
        with open(path) as f:
            doc = json.load(f)
        row = doc["rows"][0]
        pair[tree] = dict(row=row, commit=doc.get("git_commit"), date=doc.get("date"), gpu=doc.get("gpu"), file=path)
    return pair


def summarise(preset: str, pair: dict) -> dict:
    """One size's row; a run that did not finish (``status`` not ``ok``: out of memory, an error) has
    None step time and TFLOP/s, its status kept, and no ratio."""
    b, a = pair["before"]["row"], pair["after"]["row"]
    ok = b.get("status") == "ok" and a.get("status") == "ok"
    return dict(preset=preset, n_params=a.get("n_params") or b.get("n_params"), layers=a["layers"],
                tokens_per_step=a["tokens_per_step"], max_grad_norm=a["max_grad_norm"], before_status=b.get("status"),
                after_status=a.get("status"), before_step_s=b.get("step_s"), after_step_s=a.get("step_s"),
                after_over_before=a["step_s"] / b["step_s"] if ok else None, before_tflops=b.get("model_tflops"),
                after_tflops=a.get("model_tflops"), before_gpu_peak_gib=b["gpu_peak_gib"], after_gpu_peak_gib=a["gpu_peak_gib"],
                before_host_peak_gib=b["host_peak_gib"], after_host_peak_gib=a["host_peak_gib"],
                before_commit=pair["before"]["commit"], after_commit=pair["after"]["commit"],
                date=pair["after"]["date"], files=[pair["before"]["file"], pair["after"]["file"]])


def size_label(r: dict) -> str:
    """``6.74B``, or the preset's name where neither run got as far as counting the parameters."""
    return f"{r['n_params'] / 1e9:.2f}B" if r["n_params"] else f"{r['preset']} preset"


def plot(rows: list, system: str, gpu: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.8))
    xs = range(len(rows))
    for off, key, name, color in ((-0.2, "before_step_s", "before", "tab:gray"), (0.2, "after_step_s", "after", "tab:blue")):
        bars = ax.bar([x + off for x in xs], [r[key] or 0.0 for r in rows], width=0.4, label=name, color=color)
        ax.bar_label(bars, labels=[f"{r[key]:.3f}" if r[key] else r[name + "_status"].split(":")[0] for r in rows], fontsize=7)
    ax.set_xticks(list(xs), [size_label(r) for r in rows])
    ax.set_ylabel("s/step (lower is better)")
    ax.set_title(f"{gpu}: {system}, max_grad_norm {rows[0]['max_grad_norm']}, {rows[0]['tokens_per_step']} tokens/step "
                 f"({rows[0]['date'][:10]})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", default="megatrain:policy=auto", help="the bench_train system both trees ran")
    ap.add_argument("--presets", nargs="+", default=["3b", "7b", "8b"],
                    help='the BA_PRESET values of the files ("": files named without one, the 3b default)')
    ap.add_argument("--clip", default="1.0", help="the BA_CLIPS value of the files")
    ap.add_argument("--dir", default="docs/benchmarks", help="where the before_after_*.json files are")
    ap.add_argument("--suffix", default="", help="the files' name ends with this before .json (e.g. _h200)")
    ap.add_argument("--out", help="the combined JSON (a PNG is written beside it); none: the table only")
    args = ap.parse_args(argv)
    pairs = {p: load_pair(args.dir, p, args.system, args.clip, args.suffix) for p in args.presets}  # every file read first
    rows = [summarise(p, pairs[p]) for p in args.presets]
    first = pairs[args.presets[0]]["after"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="before_after_sizes", system=args.system, gpu=first["gpu"], rows=rows), f, indent=1)
        plot(rows, args.system, first["gpu"], os.path.splitext(args.out)[0] + ".png")
    print(f"| model | before ({rows[0]['before_commit']}) s/step | after ({rows[0]['after_commit']}) s/step | after / before "
          "| TFLOP/s before -> after |\n|---|---|---|---|---|")
    def cell(r, tree, key, fmt):
        return fmt.format(r[f"{tree}_{key}"]) if r[f"{tree}_status"] == "ok" else r[f"{tree}_status"][:60]

    for r in rows:
        ratio = f"{r['after_over_before']:.3f}" if r["after_over_before"] is not None else "-"
        print(f"| {size_label(r)} | {cell(r, 'before', 'step_s', '{:.3f}')} | {cell(r, 'after', 'step_s', '{:.3f}')} "
              f"| {ratio} | {cell(r, 'before', 'tflops', '{:.1f}')} -> {cell(r, 'after', 'tflops', '{:.1f}')} |")


if __name__ == "__main__":
    main()
