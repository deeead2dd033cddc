"""The training run behind ``megatrain train``: :func:`run` trains a :class:`~megatrain.train.run_plan.Plan`.

A run goes through these phases, each in its own module:

* plan      (:mod:`megatrain.train.run_plan`): every check of the input and the memory rule; writes nothing
* build     (:mod:`megatrain.train.model_build`, here): the model in the host store, optimizer, scheduler
* resume    (:mod:`megatrain.train.checkpoints`): the checkpoint ``--resume`` means, loaded
* start     (:mod:`megatrain.train.run_files`): the output directory's first files (taken back on an early failure)
* steps     (:mod:`megatrain.train.step_loop`, :mod:`megatrain.train.signals`): training, logs, evals, checkpoints
* finish    (:mod:`megatrain.train.final_model`, :mod:`megatrain.train.run_summary`): the model, summary.json

It writes:

    out/config.yaml      the resolved configuration
    out/metrics.jsonl    one JSON record per log line / eval (see docs/metrics.md)
    out/tensorboard/     the same scalars for TensorBoard
    out/summary.json     final numbers, incl. final_eval_loss
    out/loss_curve.png   train and held-out loss vs step, drawn from metrics.jsonl at the end of the run
    out/model/           HF-format model (megatrain.export_pretrained) + tokenizer files; written to
                         a temporary directory and renamed, so it is complete or absent
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import Optional

from megatrain.train import metrics as metrics_mod
from megatrain.train import model_build
from megatrain.train.checkpoints import load_resume_point
from megatrain.train.config import Config
from megatrain.train.distributed import Ranks
from megatrain.train.final_model import save_final_model
from megatrain.train.model_build import check_causal
from megatrain.train.run_files import open_run_files
from megatrain.train.run_plan import Plan, prepare
from megatrain.train.run_summary import (activation_policy, completed_summary, unfinished_summary, write_loss_curve,
                                         write_summary)
from megatrain.train.signals import StopRequest
from megatrain.train.step_loop import LoopState, NullBar, Training, begin, new_metrics_state, train_steps


def run(cfg: Config, plan: Optional[Plan] = None, echo=None, stop: Optional[StopRequest] = None) -> dict:
    """Trains per ``cfg`` and returns the summary (also written to ``out/summary.json``).

    With ``plan.resume`` it continues that checkpoint's run exactly (weights, Adam state, scheduler,
    data position, RNG, metrics so far). SIGINT / SIGTERM during training write a checkpoint at
    the end of the current step and raise :class:`~megatrain.train.signals.Interrupted`.

    Raises:
        UsageError: bad input (before anything is written).
        Interrupted: stopped by a signal (``summary.json`` says ``"status": "interrupted"``).
    """
    import torch

    plan = plan or prepare(cfg)
    ranks = plan.ranks or Ranks()
    say = (echo or (lambda s: _echo(s, None))) if ranks.main else (lambda s: None)
    tr = _build(cfg, plan, ranks, say, stop or StopRequest())
    st = _start_state(tr)
    _batches(tr, st)
    _say_start(tr, st)
    # Everything is checked; only now does anything get written (by global rank 0 under torchrun).
    added, tr.sink = open_run_files(cfg, plan.out_dir, ranks, resumed=plan.resume is not None)
    tr.stats = metrics_mod.StatsWindow(tr.engine)
    if plan.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(plan.device)
    summary: dict = {}
    start_time = time.perf_counter()
    failed_to_start: Optional[BaseException] = None  # the error of a run that failed before its first step
    final_signals = contextlib.ExitStack()  # the signal handlers of the final export, restored in `finally`
    stop = tr.stop
    try:
        begin(tr, st)
        train_steps(tr, st)
        st.bar.close()
        st.bar = NullBar()
        final_signals.enter_context(stop.installed())  # not deferred: a signal during the export stops it at once
        model_dir = save_final_model(tr.model, plan.data.tokenizer, plan, ranks, stop)
        stop.deferred = True
        loss_curve = write_loss_curve(tr.sink.path, plan.out_dir) if ranks.main else None
        st.status = "completed"
        summary = completed_summary(tr, st, model_dir, loss_curve, start_time)
        if stop.signum is not None:
            saved_to = f"the final model was saved to {model_dir}" if model_dir else "training had finished"
            say(f"megatrain train: {signal.Signals(stop.signum).name} arrived after {saved_to}; the run is complete")
        return summary
    except KeyboardInterrupt:
        st.status = "interrupted"
        raise
    except Exception as exc:
        if ranks.main and st.done_step == st.start_step and st.saved["path"] is None:
            failed_to_start = exc  # nothing was trained: out_dir is taken back to what it was
        raise
    finally:
        stop.deferred = st.status == "completed"  # a completed run's records are written whatever signal comes
        st.bar.close()
        tr.sink.close()
        if failed_to_start is not None:
            added.take_back(failed_to_start)
        elif not summary:
            summary = unfinished_summary(tr, st)
        try:
            if ranks.main and not added.taken_back:
                write_summary(plan.out_dir, summary)
        finally:
            final_signals.close()


def _build(cfg: Config, plan: Plan, ranks: Ranks, say, stop: StopRequest) -> Training:
    """The run's model (built into the host store, checked causal), its FLOPs and the MFU peak, the
    optimizer and the LR scheduler."""
    import torch

    import megatrain

    t, device = cfg.train, plan.device
    model = model_build.build_wrapped_model(plan)
    check_causal(model)
    params = metrics_mod.count_params(model)
    policy = activation_policy(model, cfg)
    flops = metrics_mod.flops_per_token(model.config, params, plan.data.seq_len, policy)
    peak = cfg.log.peak_tflops * 1e12 if cfg.log.peak_tflops else None
    peak_source = "config" if peak else None
    if peak is None and device.type == "cuda":
        try:
            peak = metrics_mod.measure_peak_flops(device, plan.compute_dtype)
            peak_source = "measured matmul"
        except Exception:  # noqa: BLE001
            peak, peak_source = metrics_mod.H200_BF16_PEAK_FLOPS, "H200 bf16 default"

    engine = getattr(model, "megatrain", None)
    optimizer = megatrain.optim.CPUAdamW(
        param_groups(model, t.weight_decay),
        lr=t.lr,
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm or None,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        nonfinite=t.nonfinite,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return Training(cfg=cfg, plan=plan, ranks=ranks, say=say, stop=stop, model=model, engine=engine,
                    optimizer=optimizer, scheduler=scheduler, params=params, policy=policy, flops=flops, peak=peak,
                    peak_source=peak_source)


def _start_state(tr: Training) -> LoopState:
    """Step 0, or where ``plan.resume`` stopped: its weights, optimizer and scheduler loaded and its metrics state."""
    # Metrics state: carried across a resume in the checkpoint, so the summary covers the whole run.
    ms = new_metrics_state()
    start_step = 0
    resume = tr.plan.resume
    if resume is not None:
        extra = load_resume_point(resume, tr.model, tr.optimizer, tr.scheduler)
        start_step = int(extra["step"])
        ms.update(extra.get("metrics") or {})
    return LoopState(ms=ms, start_step=start_step, done_step=start_step)


def _batches(tr: Training, st: LoopState) -> None:
    """The run's batch sizes and its batches: the fixed held-out ones, the training ones from the data position."""
    cfg, t, d, world = tr.cfg, tr.cfg.train, tr.plan.data, tr.ranks.world
    # Under torchrun a global micro-batch has world x micro_batch_size rows; this rank trains on its share.
    tr.tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * d.seq_len * world
    tr.rows_per_step = t.micro_batch_size * t.gradient_accumulation_steps * world
    tr.eval_bs = (cfg.eval.batch_size or t.micro_batch_size) * world  # rows per eval batch, all ranks
    tr.eval_batches = d.eval_batches(tr.eval_bs, cfg.eval.batches)
    tr.batches = d.train_batches(t.micro_batch_size * world, t.seed, start_row=st.ms["rows_consumed"])
    tr.fingerprint = d.fingerprint()


def _documents(d, eval_fraction: float) -> str:
    """The banner's data words: how many documents, and what is held out for evaluation (whole documents, or
    the tail of a single one: :func:`megatrain.train.data.load_text_data`)."""
    if d.num_documents == 1:
        return f"1 document (its last {eval_fraction:.0%} of tokens held out)"
    return f"{d.num_documents} documents ({d.num_eval_documents} held out)"


def _say_start(tr: Training, st: LoopState) -> None:
    """The run's first line: model, device, data, tokens per step, output directory."""
    plan, d, ranks, params, model = tr.plan, tr.plan.data, tr.ranks, tr.params, tr.model
    device, resume = plan.device, plan.resume
    tr.say(
        f"megatrain train: {params['total'] / 1e6:.2f}M params ({model.config.model_type}, "
        f"{model.config.num_hidden_layers} layers) on {device} in {str(plan.compute_dtype).replace('torch.', '')}, "
        f"{_documents(d, plan.cfg.data.eval_fraction)} -> {len(d.train)} train / "
        f"{len(d.eval)} eval rows of {d.seq_len} tokens; {tr.tokens_per_step} tokens/step"
        + (f" over {ranks.world} ranks" if ranks.world > 1 else "") + f"; out {plan.out_dir}"
        + (f"; resumed at step {st.start_step} from {resume.path}" if resume is not None else "")
    )
    if device.type == "cuda" and params["total"] < 100e6:
        tr.say("megatrain train: a model this small fits in GPU memory; `megatrain train --preset 1b` streams a 1B "
               "model's layers from host memory (about 2 minutes on an H200)")


def lr_lambda(cfg: Config):
    """Multiplier of train.lr at scheduler step s: linear warmup, then cosine/linear/constant."""
    t = cfg.train

    warmup = min(t.warmup_steps, t.steps)

    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if t.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, t.steps - warmup))
        if t.lr_schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            decay = 1.0 - progress
        return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * decay

    return fn


def param_groups(model, weight_decay: float) -> list:
    """AdamW groups: weight decay on matrices, none on biases and norm weights (1-D)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _echo(text: str, bar) -> None:
    try:
        from tqdm.auto import tqdm

        tqdm.write(text)
    except ImportError:  # pragma: no cover
        print(text)
