"""The end of a ``megatrain train`` run in numbers: ``summary.json`` (completed, failed or interrupted), the
loss curve, and the table the CLI prints.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

from megatrain.train import metrics as metrics_mod
from megatrain.train.checkpoints import list_checkpoints
from megatrain.train.config import Config
from megatrain.train.messages import first_line, warn
from megatrain.train.step_loop import LoopState, Training


def completed_summary(tr: Training, st: LoopState, model_dir: Optional[str], loss_curve: Optional[str],
                      start_time: float) -> dict:
    """``summary.json`` of a completed run (docs/metrics.md): losses, throughput over the steady log windows
    (every window but the first, the warm-up, if there are more), memory, placement and the files written.

    Args:
        model_dir: the final model's directory (None: not saved); loss_curve: the plot's path (None: none).
        start_time: ``time.perf_counter()`` when the run started writing (for ``wall_time_s``).
    """
    import torch

    cfg, plan, ms, evals = tr.cfg, tr.plan, st.ms, st.evals
    t, d, device, out_dir, resume = cfg.train, plan.data, plan.device, plan.out_dir, plan.resume
    flops, peak, engine, tokens_per_step = tr.flops, tr.peak, tr.engine, tr.tokens_per_step
    first, steady = ms["first_window"], ms["steady"]
    tok_tot, time_tot, count = (steady[0], steady[1], ms["windows"] - 1) if ms["windows"] > 1 else (
        first[0], first[1], ms["windows"])
    tok_s = tok_tot / time_tot if time_tot else None
    return {
        "status": st.status,
        "steps": t.steps,
        "tokens": t.steps * tokens_per_step,
        "tokens_per_step": tokens_per_step,
        "initial_eval_loss": evals[0]["eval_loss"],
        "final_eval_loss": evals[-1]["eval_loss"],
        "final_train_loss": ms["last_window_loss"],
        "eval_history": evals,
        "eval_batches": len(tr.eval_batches),
        "eval_batch_size": tr.eval_bs,
        "train_time_s": ms["train_time_s"],
        "wall_time_s": time.perf_counter() - start_time,
        "tokens_per_s": tok_s,
        "step_time_s": (time_tot / count) if count else None,
        "model_tflops": flops.model * tok_s / 1e12 if tok_s else None,
        "recompute_tflops": flops.recompute * tok_s / 1e12 if tok_s else None,
        "mfu": flops.model * tok_s / peak if (peak and tok_s) else None,
        "peak_tflops": peak / 1e12 if peak else None,
        "peak_source": tr.peak_source,
        "model_flops_per_token": flops.model,
        "recompute_flops_per_token": flops.recompute,
        "params": tr.params,
        "device": str(device),
        "world_size": tr.ranks.world,
        "compute_dtype": str(plan.compute_dtype).replace("torch.", ""),
        "activation_policy": tr.policy,
        "auto_decisions": _auto_decisions(engine),
        "placement": engine.placement() if engine is not None else None,
        "long_context": _long_context(engine, cfg),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "host_rss_bytes": metrics_mod.host_rss_bytes(),
        "engine_stats": tr.stats.read(),
        "model_dir": model_dir,
        "tokenizer": d.tokenizer.source,
        "loss_curve": loss_curve,
        "metrics_file": tr.sink.path,
        "tensorboard_dir": tr.sink.tensorboard_dir,
        "checkpoints": [p for _, p in list_checkpoints(out_dir)],
        "resumed_from": {"step": st.start_step, "checkpoint": resume.path} if resume is not None else None,
        "out_dir": out_dir,
    }


def unfinished_summary(tr: Training, st: LoopState) -> dict:
    """``summary.json`` of a run that failed or was interrupted: where it stopped, the checkpoint that
    resumes it (when one was written after the last completed step) and the command that does."""
    resume, out_dir = tr.plan.resume, tr.plan.out_dir
    summary = {
        "status": st.status,
        "step": st.done_step,
        "checkpoint": st.saved["path"] if st.saved["step"] == st.done_step else None,
        "eval_history": st.evals,
        "activation_policy": activation_policy(tr.model, tr.cfg),
        "auto_decisions": _auto_decisions(tr.engine),
        "resumed_from": {"step": st.start_step, "checkpoint": resume.path} if resume is not None else None,
        "out_dir": out_dir,
    }
    if summary["checkpoint"]:
        summary["resume_command"] = f"megatrain train --resume {out_dir}"
    return summary


def write_summary(out_dir: str, summary: dict) -> None:
    """Writes ``out_dir/summary.json``."""
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=metrics_mod._json_default)


def _auto_decisions(engine) -> Optional[list]:
    """What ``activation_policy: auto`` chose, per layer input shape (None for other policies):
    ``policy`` (store | recompute | store K layers, recompute the rest | block:K) and the engine's numbers."""
    acts = engine.placement()["activations"] if engine is not None else None
    if acts is None:
        return None
    out = []
    for d in acts:
        stored = d.get("store_layers")
        policy = ("store" if not d.get("recompute_layers") else
                  "recompute" if not stored else f"store {stored} layers, recompute the rest")
        if d.get("block_k", 1) > 1:
            policy = f"block:{d['block_k']}"
        out.append({"input_shapes": d["input_shapes"], "policy": policy, **d})
    return out


def activation_policy(model, cfg: Config) -> Optional[str]:
    """The activation policy the run uses: ``runtime.activation_policy``, or wrap's default it resolved to."""
    engine = getattr(model, "megatrain", None)
    return getattr(engine, "activation_policy", None) or cfg.runtime.activation_policy


def _long_context(engine, cfg: Config) -> dict:
    """``runtime.chunked_loss`` / ``runtime.tile_mlp`` and what the last forward used: ``loss_rows``
    (rows per loss chunk, None: full logits), ``mlp_rows`` (rows per MLP tile, None: untiled), ``tokens``."""
    lc = getattr(engine, "long_context", None)
    last = dict(lc.last) if lc is not None else {}
    return {"chunked_loss": cfg.runtime.chunked_loss, "tile_mlp": cfg.runtime.tile_mlp, **last}


def write_loss_curve(metrics_path: str, out_dir: str) -> Optional[str]:
    """``out_dir/loss_curve.png`` drawn from ``metrics_path`` (:func:`metrics.plot_loss_curve`); its path,
    or None after one warning line when it cannot be drawn (the trained model is not lost over a plot)."""
    path = os.path.join(out_dir, metrics_mod.LOSS_CURVE_FILE)
    try:
        return metrics_mod.plot_loss_curve(metrics_path, path, title=f"megatrain train: {out_dir}")
    except Exception as exc:  # noqa: BLE001 - matplotlib missing / broken, a full disk
        warn(f"the loss curve {path!r} was not written ({first_line(exc)}); metrics.jsonl holds the losses")
        return None


def summary_rows(summary: dict) -> list:
    """Rows of the end-of-run table."""
    f = metrics_mod.fmt
    b = metrics_mod.fmt_bytes
    stats = summary.get("engine_stats") or {}
    rows = [
        ("parameters", f"{summary['params']['total'] / 1e6:.2f} M"),
        ("device / dtype", f"{summary['device']} / {summary['compute_dtype']}"),
        ("steps x tokens/step", f"{summary['steps']} x {summary['tokens_per_step']}"),
        ("eval loss: initial -> final", f"{summary['initial_eval_loss']:.4f} -> {summary['final_eval_loss']:.4f}"),
        ("final train loss", f(summary.get("final_train_loss"), ".4f")),
        ("step time", f"{summary['step_time_s'] * 1e3:.1f} ms" if summary.get("step_time_s") else "n/a"),
        ("tokens/s", f(summary.get("tokens_per_s"), ".0f")),
        ("model TFLOP/s (+ recompute)", f"{f(summary.get('model_tflops'))} (+{f(summary.get('recompute_tflops'))})"),
        ("MFU", f"{summary['mfu'] * 100:.1f}% of {summary['peak_tflops']:.0f} TFLOP/s" if summary.get("mfu") else "n/a"),
        ("GPU peak memory", b(summary.get("gpu_peak_bytes")) if summary.get("gpu_peak_bytes") is not None else "n/a"),
        ("host RSS", b(summary.get("host_rss_bytes"))),
    ]
    pl = summary.get("placement")
    if pl and pl.get("device_state_layers"):
        rows.append(("layers with their state on the device",
                     f"{pl['device_state_layers']} of {pl['layers']} ({b(pl['device_state_bytes'])}), "
                     f"{pl['streamed_layers']} streamed"))
    if pl and pl.get("disk_layers"):
        rows.append(("layers with their fp32 state on disk",
                     f"{len(pl['disk_layers'])} of {pl['layers']} ({b(pl['disk_bytes'])} under {pl['offload_dir']})"))
    if "pinned_bytes" in stats:
        rows.append(("pinned host memory", b(stats["pinned_bytes"])))
    if "bytes_per_param" in stats:
        rows.append(("host store bytes/param", f(stats["bytes_per_param"], ".2f")))
    rows.append(("wall time", f"{summary['wall_time_s']:.1f} s"))
    rows.append(("model saved to", summary.get("model_dir") or "(not saved)"))
    rows.append(("tokenizer", summary.get("tokenizer") or "n/a"))
    rows.append(("loss curve", summary.get("loss_curve") or "(not written)"))
    rows.append(("metrics", summary.get("metrics_file") or "n/a"))
    rows.append(("TensorBoard logs", summary.get("tensorboard_dir") or "(off: log.tensorboard=false or not installed)"))
    if summary.get("out_dir"):
        rows.append(("summary", os.path.join(summary["out_dir"], "summary.json")))
    return rows
