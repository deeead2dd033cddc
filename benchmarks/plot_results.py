"""PNG charts for the JSON results of bench_cpu_adam.py and bench_memory.py.

    python benchmarks/plot_results.py docs/benchmarks/cpu_adam_h200.json docs/benchmarks/memory_depth_h200.json

Each ``X.json`` gets an ``X.png`` beside it.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_cpu_adam(d, out):
    res = {k: v for k, v in d["results"].items() if "Gparam_per_s" in v}
    names = list(res)
    vals = [res[k]["Gparam_per_s"] for k in names]
    fig, ax = plt.subplots(figsize=(8, max(3.8, 1.2 + 0.3 * len(names))))
    bars = ax.barh(names, vals, color=["tab:blue" if n.startswith("megatrain") else "tab:gray" for n in names])
    ax.bar_label(bars, fmt="%.2f")
    ax.set_xlabel("Gparam/s (higher is better)")
    ax.set_title(f"CPU AdamW, {d['numel'] / 2**20:.0f}M fp32 params, {d['threads']} threads "
                 f"({d['machine'].get('cpu', '')}, {d['date'][:10]})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def plot_memory(d, out):
    rows = d["rows"]
    gib = 2 ** 30
    parts = ["slots", "resident", "other", "saved_layer_inputs"]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    left = [0.0] * len(rows)
    labels = [f"{r['layers']} layers ({r['params'] / 1e9:.2f}B)" for r in rows]
    for p in parts:
        v = [r[p] / gib for r in rows]
        ax.barh(labels, v, left=left, label=p.replace("_", " "))
        left = [a + b for a, b in zip(left, v)]
    ax.set_xlabel("GPU peak allocated, GiB")
    ax.set_title(f"GPU memory vs depth (hidden {rows[0]['hidden']}, {rows[0]['tokens']} tokens/step); "
                 f"\npeak without the saved layer inputs: ratio {d['non_saved_ratio']:.3f}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(paths):
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        out = path[:-5] + ".png"
        if d.get("benchmark") == "cpu_adam":
            plot_cpu_adam(d, out)
        elif "rows" in d and "non_saved_ratio" in d:
            plot_memory(d, out)
        else:
            print(f"skip {path}: unknown result format")
            continue
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
