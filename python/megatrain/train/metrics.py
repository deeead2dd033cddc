"""Training metrics: FLOP counts, MFU, transfer rates, memory, and their sinks (JSONL, TensorBoard).

The formulas are in docs/metrics.md; in short, per training token of a sequence of length S:

* dense:     6 * N_dense            (N_dense: parameters used in matmuls: decoder layers + LM head)
* attention: 6 * L * H * D * S      (causal QK^T and AV, forward 2*L*H*D*S, backward twice that)
* recompute: 2 * N_layers + 2 * L * H * D * S   (one more forward of the decoder layers)

Model FLOPs = dense + attention (the MFU numerator); recompute FLOPs are reported separately
(hardware FLOP/s = model + recompute).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Optional

from ..byte_units import format_bytes

H200_BF16_PEAK_FLOPS = 800e12  # measured dense bf16 matmul rate of an H200 (docs/metrics.md)


@dataclass
class FlopCounts:
    """FLOPs per trained token (multiply-add = 2 FLOPs)."""

    dense: float
    attention: float
    recompute: float
    n_dense_params: int
    n_layer_params: int

    @property
    def model(self) -> float:
        return self.dense + self.attention


def count_params(model) -> dict:
    """Parameter counts of an (unwrapped) HF causal LM: total, embedding, decoder layers, dense."""
    seen = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    layer_params = 0
    layers = _decoder_layers(model)
    if layers is not None:
        layer_params = sum(p.numel() for p in layers.parameters())
    # The input embedding is a gather, not a matmul; when tied it *is* the LM head, counted once.
    dense = total if tied else total - emb.numel()
    return {"total": total, "embedding": emb.numel(), "layers": layer_params, "dense": dense, "tied": tied}


def _decoder_layers(model):
    base = getattr(model, "base_model", model)
    for name in ("layers", "h", "blocks", "decoder_layers"):
        layers = getattr(base, name, None)
        if layers is not None and hasattr(layers, "__len__"):
            return layers
    return None


def flops_per_token(model_config, params: dict, seq_len: int, activation_policy) -> FlopCounts:
    """FLOPs per token of one training step (forward + backward), see the module docstring.
    ``activation_policy``: the run's (a string or an ``ActivationPolicy``); recompute is counted when it re-runs
    every layer's forward in backward (``recompute``, ``offload``, ``block:K``)."""
    from megatrain.runtime.activations.activation_policy import ActivationPolicy

    num_layers = int(getattr(model_config, "num_hidden_layers"))
    num_heads = int(getattr(model_config, "num_attention_heads"))
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // num_heads
    attn_fwd = 2.0 * num_layers * num_heads * head_dim * seq_len  # causal: half of 4*L*H*D*S
    recompute = 0.0
    if ActivationPolicy.parse(activation_policy).recomputes:
        recompute = 2.0 * params["layers"] + attn_fwd
    return FlopCounts(
        dense=6.0 * params["dense"],
        attention=3.0 * attn_fwd,
        recompute=recompute,
        n_dense_params=params["dense"],
        n_layer_params=params["layers"],
    )


def measure_peak_flops(device, dtype, size: int = 8192, iters: int = 10) -> Optional[float]:
    """Measured dense matmul FLOP/s on ``device`` in ``dtype``; None on CPU.

    A size^3 matmul repeated ``iters`` times after one warm-up (~0.1 s on an H200).
    """
    import torch

    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    del a, b
    torch.cuda.empty_cache()
    return 2.0 * size**3 * iters / elapsed


def host_rss_bytes() -> Optional[int]:
    """Resident set size of this process (psutil, else /proc/self/status VmRSS), None if unknown."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class StatsWindow:
    """Diffs of the engine's cumulative counters (``engine.stats()``) between two log lines."""

    RATE_KEYS = ("h2d_bytes", "d2h_bytes", "h2d_time_s", "d2h_time_s", "adam_time_s", "adam_exposed_s")

    def __init__(self, engine):
        self.engine = engine
        self.last = self._read()

    def _read(self) -> dict:
        if self.engine is None or not hasattr(self.engine, "stats"):
            return {}
        try:
            return dict(self.engine.stats())
        except Exception:  # noqa: BLE001 - metrics must never stop training
            return {}

    def reset(self) -> None:
        """Starts a new window now (e.g. after an evaluation, whose transfers are not training's)."""
        self.last = self._read()

    def read(self) -> dict:
        """The engine's cumulative counters now ({} without an engine)."""
        return self._read()

    def step(self, wall_s: float) -> dict:
        """Metrics for the window that just ended (``wall_s`` seconds long)."""
        now = self._read()
        out = {}
        diff = {k: now.get(k, 0) - self.last.get(k, 0) for k in self.RATE_KEYS if k in now}
        if "h2d_bytes" in diff:
            out["h2d_gb"] = diff["h2d_bytes"] / 1e9
            # Achieved rate while copying (bytes / copy time) and average over the window.
            if diff.get("h2d_time_s", 0) > 0:
                out["h2d_gbps"] = diff["h2d_bytes"] / diff["h2d_time_s"] / 1e9
            out["h2d_gbps_wall"] = diff["h2d_bytes"] / max(wall_s, 1e-12) / 1e9
        if "d2h_bytes" in diff:
            out["d2h_gb"] = diff["d2h_bytes"] / 1e9
            if diff.get("d2h_time_s", 0) > 0:
                out["d2h_gbps"] = diff["d2h_bytes"] / diff["d2h_time_s"] / 1e9
            out["d2h_gbps_wall"] = diff["d2h_bytes"] / max(wall_s, 1e-12) / 1e9
        if "adam_time_s" in diff:
            exposed = diff.get("adam_exposed_s", 0.0)
            out["adam_s"] = diff["adam_time_s"]
            out["adam_exposed_s"] = exposed
            out["adam_hidden_s"] = max(0.0, diff["adam_time_s"] - exposed)
        for key in ("host_store_bytes", "pinned_bytes", "bytes_per_param", "num_params", "streamed_layers"):
            if key in now:
                out[key] = now[key]
        self.last = now
        return out


class MetricsSink:
    """Writes metric records to ``metrics.jsonl`` and (optionally) TensorBoard under ``out_dir``.

    Attributes:
        path: the ``metrics.jsonl`` file.
        tensorboard_dir: the TensorBoard log directory, None when TensorBoard is off or unavailable.
    """

    def __init__(self, out_dir: str, tensorboard: bool = True, append: bool = True):
        """``append=False`` starts ``metrics.jsonl`` afresh (a new run in a reused directory)."""
        self.path = os.path.join(out_dir, METRICS_FILE)
        self.jsonl = open(self.path, "a" if append else "w", buffering=1)
        self.writer = None
        self.tensorboard_dir = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=os.path.join(out_dir, "tensorboard"))
                self.tensorboard_dir = os.path.join(out_dir, "tensorboard")
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self.writer = None

    def write(self, record: dict, prefix: str = "train") -> None:
        self.jsonl.write(json.dumps({"kind": prefix, **record}, default=_json_default) + "\n")
        if self.writer is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def close(self) -> None:
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()


METRICS_FILE = "metrics.jsonl"
LOSS_CURVE_FILE = "loss_curve.png"


def loss_history(metrics_path: str) -> tuple:
    """``(train, eval)``: lists of ``(step, loss)`` from a ``metrics.jsonl``, in step order.

    ``train`` holds the ``"kind": "train"`` records' window mean ``loss``, ``eval`` the held-out
    ``eval_loss``. A ``"kind": "resume"`` record at step N drops the earlier records after step N (a
    run that crashed after its last checkpoint logged them; the resumed run logs those steps again).
    Non-finite losses are left out; lines that are not JSON are skipped.
    """
    train: list = []
    held: list = []
    with open(metrics_path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                continue
            kind, step = rec.get("kind"), rec["step"]
            if kind == "resume":
                train = [p for p in train if p[0] <= step]
                held = [p for p in held if p[0] <= step]
            elif kind == "train" and isinstance(rec.get("loss"), (int, float)) and math.isfinite(rec["loss"]):
                train.append((step, float(rec["loss"])))
            elif kind == "eval" and isinstance(rec.get("eval_loss"), (int, float)) and math.isfinite(rec["eval_loss"]):
                held.append((step, float(rec["eval_loss"])))
    return train, held


def plot_loss_curve(metrics_path: str, out_path: str, title: Optional[str] = None) -> str:
    """Draws the training loss and the held-out loss against the step from ``metrics_path``
    (:func:`loss_history`) into the PNG ``out_path`` (matplotlib's Agg canvas: no display, no pyplot
    state), written to a temporary file and renamed. Returns ``out_path``.

    Raises:
        OSError: ``metrics_path`` cannot be read or ``out_path`` written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, held = loss_history(metrics_path)
    fig = Figure(figsize=(7, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], label="train loss (mean over the log window)",
                color="tab:blue", linewidth=1.5, marker="." if len(train) < 50 else None)
    if held:
        ax.plot([s for s, _ in held], [v for _, v in held], label="held-out loss", color="tab:orange",
                marker="o", markersize=4, linewidth=1.5)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(True, alpha=0.3)
    if train or held:
        ax.legend()
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    tmp = out_path + ".partial.png"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def _json_default(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def fmt_bytes(n: Optional[float]) -> str:
    """Bytes for a log line: one decimal, up to TiB (``"1.5 GiB"``), ``"n/a"`` for None."""
    return format_bytes(n, decimals=1, largest="TiB")


def fmt(value, spec: str = ".3g", none: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return none
    return format(value, spec)


def log_line(rec: dict) -> str:
    """One human-readable log line for a training record."""
    parts = [
        f"step {rec['step']}",
        f"loss {rec['loss']:.4f}",
        f"lr {rec['lr']:.3g}",
        *([f"grad norm {rec['grad_norm']:.3g}"] if rec.get("grad_norm") is not None else []),
        f"{rec['step_time_s'] * 1e3:.0f} ms/step",
        f"{rec['tokens_per_s']:.0f} tok/s",
        f"{fmt(rec.get('model_tflops'))} TFLOP/s (+{fmt(rec.get('recompute_tflops'))} recompute)",
        "MFU " + (f"{rec['mfu'] * 100:.1f}%" if rec.get("mfu") is not None else "n/a"),
    ]
    if "h2d_gbps" in rec or "d2h_gbps" in rec:
        parts.append(f"H2D {fmt(rec.get('h2d_gbps'), '.1f')} GB/s D2H {fmt(rec.get('d2h_gbps'), '.1f')} GB/s")
    if "adam_s" in rec:
        parts.append(f"Adam {rec['adam_exposed_s'] * 1e3:.0f} ms exposed / {rec['adam_hidden_s'] * 1e3:.0f} ms hidden")
    if rec.get("gpu_peak_bytes") is not None:
        parts.append(f"GPU peak {fmt_bytes(rec['gpu_peak_bytes'])}")
    parts.append(f"RSS {fmt_bytes(rec.get('host_rss_bytes'))}")
    if rec.get("pinned_bytes") is not None:
        parts.append(f"pinned {fmt_bytes(rec['pinned_bytes'])}")
    if rec.get("bytes_per_param") is not None:
        parts.append(f"{rec['bytes_per_param']:.1f} B/param")
    return " | ".join(parts)


def summary_table(rows: list) -> str:
    """Formats ``[(name, value_str), ...]`` as a two-column text table."""
    width = max(len(name) for name, _ in rows)
    vwidth = max(len(value) for _, value in rows)
    line = "+" + "-" * (width + 2) + "+" + "-" * (vwidth + 2) + "+"
    body = [f"| {name.ljust(width)} | {value.rjust(vwidth)} |" for name, value in rows]
    return "\n".join([line, *body, line])
