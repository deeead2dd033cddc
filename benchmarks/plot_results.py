"""PNG charts for the JSON results of bench_cpu_adam.py, bench_memory.py and bench_scale.py.

    python benchmarks/plot_results.py docs/benchmarks/cpu_adam_h200.json docs/benchmarks/memory_depth_h200.json
    python benchmarks/plot_results.py docs/benchmarks/scale_train_h200.json   # any bench_scale JSON

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


def plot_scale(d, out):
    """Host bytes per parameter (peak RSS and the store) and, where trained, model TFLOP/s per case."""
    rows = [r for r in d["rows"] if r.get("status") == "ok" and r.get("peak_rss_gib") is not None]
    names = [r["case"] + (f"\n{r['n_params'] / 1e9:.2f}B" if r.get("n_params") else "") for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, max(3.0, 1.0 + 0.6 * len(rows))))
    peak = [r.get("peak_rss_bytes_per_param") or 0 for r in rows]
    store = [r.get("store_bytes_per_param") or 0 for r in rows]
    y = range(len(rows))
    axes[0].barh([i + 0.2 for i in y], peak, height=0.4, label="peak host RSS", color="tab:blue")
    axes[0].barh([i - 0.2 for i in y], store, height=0.4, label="host store", color="tab:gray")
    axes[0].set_yticks(list(y), names, fontsize=8)
    axes[0].set_xlabel("host bytes per parameter")
    axes[0].legend(fontsize=8)
    tf = [r.get("tflops") or r.get("tflops_4nt") or 0 for r in rows]
    bars = axes[1].barh(list(y), tf, color="tab:green")
    axes[1].bar_label(bars, fmt="%.0f")
    axes[1].set_yticks(list(y), [""] * len(rows))
    axes[1].set_xlabel("model TFLOP/s (LoRA: 4NT + attention)")
    fig.suptitle(f"{d['benchmark']} ({(d.get('machine') or {}).get('gpu')}, {d.get('date')}, {d.get('commit')})", fontsize=9)
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
        elif str(d.get("benchmark", "")).startswith("bench_scale"):
            plot_scale(d, out)
        else:
            print(f"skip {path}: unknown result format")
            continue
        print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
