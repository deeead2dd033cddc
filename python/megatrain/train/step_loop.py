"""The training steps of a ``megatrain train`` run: micro batches, the optimizer step, and at their steps
the log line (metrics.jsonl, TensorBoard, the terminal), the held-out evaluation and the checkpoint.

:class:`Training` holds the run's fixed parts, :class:`LoopState` where the run is; both are built by
:func:`megatrain.train.trainer.run`.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from megatrain.train import metrics as metrics_mod
from megatrain.train.checkpoints import TRAINER_TAG, checkpoint_path, prune_checkpoints
from megatrain.train.config import Config
from megatrain.train.distributed import Ranks
from megatrain.train.signals import Interrupted, StopRequest, step_outcome


class NullBar:
    """The progress bar when there is none (``log.progress: false``, ranks other than 0, after training)."""

    def update(self, n=1):
        pass

    def set_postfix(self, *args, **kwargs):
        pass

    def close(self):
        pass


@dataclass
class Training:
    """The parts of a run, built once by :func:`megatrain.train.trainer.run` and fixed while it trains.

    ``flops``: :func:`megatrain.train.metrics.flops_per_token` of the model; ``peak``: the MFU denominator in
    FLOP/s (None: unknown). Under torchrun a global micro-batch has ``world x micro_batch_size`` rows, of
    which this rank trains its share: ``tokens_per_step`` / ``rows_per_step`` / ``eval_bs`` count all ranks.
    """

    cfg: Config
    plan: object  # megatrain.train.run_plan.Plan
    ranks: Ranks
    say: Callable[[str], None]  # one line to the user (nothing on ranks other than 0)
    stop: StopRequest
    model: object  # the wrapped model
    engine: object  # model.megatrain (None: not wrapped)
    optimizer: object  # megatrain.optim.CPUAdamW
    scheduler: object  # torch.optim.lr_scheduler.LambdaLR
    params: dict  # metrics.count_params
    policy: Optional[str]  # the activation policy the run uses
    flops: object
    peak: Optional[float]
    peak_source: Optional[str]
    tokens_per_step: int = 0
    rows_per_step: int = 0
    eval_bs: int = 0  # rows per eval batch, all ranks
    eval_batches: list = field(default_factory=list)
    batches: Optional[Iterator] = None  # endless training micro batches from the run's data position
    fingerprint: str = ""  # sha256 of the data (TextData.fingerprint), kept in every checkpoint
    sink: object = None  # metrics.MetricsSink (run_files.NullSink on ranks other than 0)
    stats: object = None  # metrics.StatsWindow


@dataclass
class LoopState:
    """Where a run is. ``ms``: the metrics state, kept in every checkpoint and carried across a resume so the
    summary covers the whole run (eval history, train time, the log windows' sums, ``rows_consumed``: the
    data position)."""

    ms: dict
    start_step: int  # optimizer steps done when this process started (a resumed checkpoint's step)
    done_step: int  # optimizer steps completed
    window_start: float = 0.0  # time.perf_counter() at the start of the current log window
    # the newest checkpoint this process wrote
    saved: dict = field(default_factory=lambda: {"step": None, "path": None})
    bar: object = field(default_factory=NullBar)
    status: str = "failed"  # failed | interrupted | completed, as summary.json says

    @property
    def evals(self) -> list:
        """``[{"step", "eval_loss"}]`` so far."""
        return self.ms["evals"]


def new_metrics_state() -> dict:
    """The metrics state ``LoopState.ms`` of a run that starts at step 0."""
    return {
        "evals": [], "train_time_s": 0.0, "last_window_loss": None, "windows": 0,
        "first_window": [0.0, 0.0], "steady": [0.0, 0.0],  # [sum of tokens/step, sum of step_time_s]
        "window_steps": 0, "window_loss": 0.0, "window_time_s": 0.0, "rows_consumed": 0,
    }


def begin(tr: Training, st: LoopState) -> None:
    """Before the first step: the step-0 evaluation (a resumed run records where it resumed instead), the
    progress bar, training mode, and the first log window's start."""
    cfg, resume = tr.cfg, tr.plan.resume
    if resume is None:
        loss0 = evaluate(tr.model, tr.eval_batches, tr.plan.device, tr.ranks)
        st.evals.append({"step": 0, "eval_loss": loss0})
        tr.sink.write({"step": 0, "eval_loss": loss0}, prefix="eval")
        tr.say(f"step 0 | eval loss {loss0:.4f}")
    else:
        tr.sink.write({"step": st.start_step, "checkpoint": resume.path}, prefix="resume")
    if cfg.log.progress and tr.ranks.main:
        from tqdm.auto import tqdm

        st.bar = tqdm(total=cfg.train.steps, initial=st.start_step, desc="train", unit="step", dynamic_ncols=True,
                      file=sys.stderr)
    tr.model.train()
    st.window_start = time.perf_counter() - st.ms["window_time_s"]
    tr.stats.reset()  # the initial eval's copies are not training's


def train_steps(tr: Training, st: LoopState) -> None:
    """Steps ``start_step + 1 .. train.steps``: each step, then its log line, evaluation and checkpoint when due.

    SIGINT / SIGTERM (``tr.stop``, deferred while this runs) end the step, write a checkpoint and stop.

    Raises:
        Interrupted: stopped by a signal (``checkpoint``: the one just written).
        FloatingPointError: a non-finite loss under ``train.nonfinite: raise``.
    """
    cfg, t = tr.cfg, tr.cfg.train
    with tr.stop.installed():
        tr.stop.deferred = True
        for step in range(st.start_step + 1, t.steps + 1):
            last_loss, stopping = _train_step(tr, st, step)
            if not math.isfinite(last_loss):
                if t.nonfinite == "raise":
                    raise FloatingPointError(f"loss is {last_loss} at step {step}; lower train.lr (or set "
                                             "train.nonfinite=skip to skip such steps)")
                tr.say(f"step {step} | loss {last_loss}: non-finite, the update was skipped "
                       f"({tr.optimizer.skipped_steps} skipped so far)")
                st.bar.update(1)
                continue
            ms = st.ms
            ms["window_steps"] += 1
            ms["window_loss"] += last_loss
            now = time.perf_counter()
            rate = ms["window_steps"] * tr.tokens_per_step / max(now - st.window_start, 1e-12)
            st.bar.update(1)
            st.bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:.0f}")

            if step % cfg.log.every == 0 or step == t.steps:
                _log_window(tr, st, step, now)
            if step % cfg.eval.every == 0 or step == t.steps:
                _evaluate_at(tr, st, step)
            periodic = t.save_every and (step % t.save_every == 0 or step == t.steps)
            if periodic or stopping is not None:
                save_start = time.perf_counter()
                path = save_checkpoint(tr, st, step, save_start - st.window_start)
                st.window_start += time.perf_counter() - save_start  # nor is saving
                if periodic:
                    tr.say(f"step {step} | checkpoint {path}")
            if stopping is not None:
                raise Interrupted(stopping, step, st.saved["path"])
        tr.stop.deferred = False


def _train_step(tr: Training, st: LoopState, step: int):
    """One optimizer step over ``train.gradient_accumulation_steps`` micro batches; returns
    :func:`~megatrain.train.signals.step_outcome`'s ``(loss, signal to stop on)``."""
    t, model, optimizer = tr.cfg.train, tr.model, tr.optimizer
    step_loss = 0.0
    for _ in range(t.gradient_accumulation_steps):
        x = tr.ranks.shard(next(tr.batches)).to(tr.plan.device, non_blocking=True)
        loss = model(input_ids=x, labels=x).loss / t.gradient_accumulation_steps
        loss.backward()
        step_loss += loss.detach().float()
    optimizer.step()
    tr.scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    st.ms["rows_consumed"] += tr.rows_per_step
    st.done_step = step
    # syncs: the step's work is done when this returns. Under torchrun: the mean over the
    # ranks, and a signal any rank got stops every rank after this step.
    return step_outcome(tr.ranks, step_loss, tr.stop.signum)


def _log_window(tr: Training, st: LoopState, step: int, now: float) -> None:
    """The log line of the window that ends at ``step`` (metrics.jsonl, TensorBoard, the terminal); starts the next."""
    import torch

    ms, flops, peak, device = st.ms, tr.flops, tr.peak, tr.plan.device
    tokens_per_step = tr.tokens_per_step
    wall = now - st.window_start
    n = ms["window_steps"]
    ms["train_time_s"] += wall
    step_s = wall / n
    tok_s = n * tokens_per_step / wall
    rec = {
        "step": step,
        "loss": ms["window_loss"] / n,
        "lr": tr.scheduler.get_last_lr()[0],
        # global gradient L2 norm before clipping, last step (CPUAdamW with max_grad_norm)
        "grad_norm": getattr(tr.optimizer, "last_grad_norm", None),
        "skipped_steps": tr.optimizer.skipped_steps,  # non-finite loss / gradient: update skipped
        "step_time_s": step_s,
        "tokens_per_s": tok_s,
        "tokens": step * tokens_per_step,
        "model_tflops": flops.model * tok_s / 1e12,
        "dense_tflops": flops.dense * tok_s / 1e12,
        "attention_tflops": flops.attention * tok_s / 1e12,
        "recompute_tflops": flops.recompute * tok_s / 1e12,
        "mfu": (flops.model * tok_s / peak) if peak else None,
        "hfu": ((flops.model + flops.recompute) * tok_s / peak) if peak else None,
        "host_rss_bytes": metrics_mod.host_rss_bytes(),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    rec.update(tr.stats.step(wall))
    tr.sink.write(rec)
    tr.say(metrics_mod.log_line(rec))
    # Steady state for the summary: every log window but the first (warm-up), if any.
    ms["windows"] += 1
    acc = ms["first_window"] if ms["windows"] == 1 else ms["steady"]
    acc[0] += tokens_per_step
    acc[1] += step_s
    ms["last_window_loss"] = rec["loss"]
    ms["window_steps"], ms["window_loss"] = 0, 0.0
    st.window_start = time.perf_counter()


def _evaluate_at(tr: Training, st: LoopState, step: int) -> None:
    """The held-out loss after ``step``, recorded and printed; its time is kept out of the log window."""
    eval_start = time.perf_counter()
    ev = evaluate(tr.model, tr.eval_batches, tr.plan.device, tr.ranks)
    st.evals.append({"step": step, "eval_loss": ev})
    tr.sink.write({"step": step, "eval_loss": ev}, prefix="eval")
    tr.say(f"step {step} | eval loss {ev:.4f}")
    st.window_start += time.perf_counter() - eval_start  # eval time is not training time
    if st.ms["window_steps"] == 0:  # eval right after a log line: keep its copies out of the next window
        tr.stats.reset()


def save_checkpoint(tr: Training, st: LoopState, at_step: int, window_time_s: float) -> str:
    """Writes the checkpoint after ``at_step`` steps (:func:`~megatrain.train.checkpoints.checkpoint_path`):
    model, optimizer, scheduler and, in ``extra``, what :func:`~megatrain.train.checkpoints.find_resume_point`
    and a resumed run read (config, data position and fingerprint, metrics state); prunes the old ones
    (rank 0). Returns its path."""
    import megatrain

    cfg, d, out_dir = tr.cfg, tr.plan.data, tr.plan.out_dir
    state = dict(st.ms, evals=st.evals, window_time_s=window_time_s)
    extra = {
        "trainer": TRAINER_TAG,
        "step": at_step,
        "epoch": state["rows_consumed"] // len(d.train),  # informational; rows_consumed is the position
        "config": cfg.to_dict(),
        "data": {"sha256": tr.fingerprint, "train_rows": len(d.train), "seq_len": d.seq_len},
        "metrics": state,
    }
    path = megatrain.save_checkpoint(checkpoint_path(out_dir, at_step), tr.model, tr.optimizer, tr.scheduler,
                                     extra=extra)
    if tr.ranks.main:
        prune_checkpoints(out_dir, at_step, cfg.train.keep_last)
    st.saved.update(step=at_step, path=path)
    return path


def evaluate(model, batches, device, ranks: Optional[Ranks] = None) -> float:
    """Mean next-token cross-entropy over ``batches`` (token-weighted), under no_grad.

    Args:
        batches: int64 tensors [B, S] (CPU); labels = inputs.
        ranks: under torchrun each rank evaluates its rows of every batch (:meth:`Ranks.shard`); the sums
            are combined, so the result is the mean over the whole batches.
    """
    import torch

    ranks = ranks or Ranks()
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x in map(ranks.shard, batches):
            if not len(x):
                continue
            x = x.to(device)
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            n = x.shape[0] * (x.shape[1] - 1)
            total += float(loss.float().item()) * n
            count += n
    model.train(was_training)
    total, count = ranks.sum([total, count])
    return total / count
