"""The plan of a ``megatrain train`` run: :func:`prepare` checks everything that can be wrong with the
user's input — config values, model directory, data, sequence length vs the model's limit, output
directory, the memory the run needs (:func:`estimate_run`, the one rule of ``--dry-run`` and of the real
run) — and loads the data, without writing anything. The :class:`Plan` it returns is what
:func:`megatrain.train.trainer.run` trains.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional

from megatrain.state.checkpoint import existing_ancestor
from megatrain.train.checkpoints import ResumePoint, list_checkpoints
from megatrain.train.config import Config, UsageError
from megatrain.train.wrap_args import estimate_kwargs, wrap_options
from megatrain.train.data import STDLIB, TextData, load_text_data
from megatrain.train.distributed import Ranks
from megatrain.train.final_model import check_model_dest
from megatrain.train.messages import first_line, warn
from megatrain.train.model_build import check_checkpoint, has_safetensors, load_model_config
from megatrain.train.text_tokenizer import load_tokenizer


@dataclass
class Plan:
    """Everything :func:`megatrain.train.trainer.run` needs, checked by :func:`prepare`."""

    cfg: Config
    data: TextData
    model_config: object  # transformers.PretrainedConfig
    device: object  # torch.device
    compute_dtype: object  # torch.dtype
    out_dir: str
    resume: Optional[ResumePoint] = None  # continue this checkpoint's run (``--resume``)
    estimate: object = None  # megatrain.MemoryEstimate of the run (what --dry-run prints)
    ranks: Optional[Ranks] = None  # under torchrun: this process's rank (None: one process)


def resolve_device(spec: str):
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"runtime.device is {spec!r} but no CUDA GPU is available; use runtime.device=cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"runtime.device is {spec!r} but only {torch.cuda.device_count()} GPU(s) exist")
    return device


def _check_liger_kernel(value: str, device) -> None:
    """``runtime.liger_kernel=true`` needs CUDA and liger-kernel installed (else one line, before anything runs)."""
    from megatrain.runtime.model.fused_kernels import liger_installed

    if value == "true" and device.type != "cuda":
        raise UsageError(f"runtime.liger_kernel=true needs a CUDA device (Liger's kernels are Triton kernels), "
                         f"the run's is {str(device)!r}; use --liger-kernel auto (on when installed and on CUDA)")
    if value == "true" and not liger_installed():
        raise UsageError("runtime.liger_kernel=true, but liger-kernel is not installed: pip install liger-kernel, "
                         "or use --liger-kernel auto")


def resolve_dtype(spec: str, device):
    import torch

    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if spec in ("bf16", "bfloat16") else torch.float32


def check_writable(directory: str, out_dir: str) -> None:
    """Raises a one-line UsageError unless a file can be created in ``directory`` (tried: a
    temporary file, removed at once; permission bits do not tell for root, /proc or a read-only mount)."""
    from megatrain.state.atomic import write_probe_error

    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write output directory {out_dir!r}: {directory!r} is not writable; choose another --out")
    exc = write_probe_error(directory)
    if exc is not None:
        raise UsageError(f"cannot write output directory {out_dir!r}: creating a file in {directory!r} fails "
                         f"({exc.strerror}); choose another --out")


class DoesNotFit(UsageError):
    """The run's memory estimate does not fit this machine (``estimate``: the :class:`megatrain.MemoryEstimate`)."""

    def __init__(self, message: str, estimate):
        super().__init__(message)
        self.estimate = estimate


def estimate_run(cfg: Config, model_config, device, compute_dtype):
    """The run's memory (:func:`megatrain.estimate`, from the model config on the meta device: nothing
    is allocated) and the refusal when it does not fit: the one rule of ``--dry-run`` and of the
    real run.

    Refused unless everything the run allocates fits the memory available now: the host store,
    gradient staging, the accumulator and the disk tier's buffers, plus a margin of
    :data:`~megatrain.runtime.placement.estimate.RUN_HOST_MARGIN_BYTES` (1 GiB) kept free, in host memory; the
    layer slots, resident unit, activations and logits (rough) in GPU memory on CUDA, or in the host
    memory left beside the store and the margin on the CPU device; the disk tier's files on its disk.

    Raises:
        DoesNotFit: one line, the estimate attached.
        UsageError: transformers cannot build the model from this config, or ``runtime.gpu_memory_limit`` is below
            the streamed schedule's minimum (layer slots, resident unit, the activations' floor).
    """
    import megatrain
    from megatrain.runtime.placement.estimate import RUN_HOST_MARGIN_BYTES
    from megatrain.runtime.placement.streamed_minimum import GpuMemoryLimitError

    t = cfg.train
    try:
        est = megatrain.estimate(model_config, host_margin_bytes=RUN_HOST_MARGIN_BYTES,
                                 gradient_accumulation_steps=t.gradient_accumulation_steps,
                                 max_grad_norm=t.max_grad_norm or None, micro_batch_size=t.micro_batch_size,
                                 seq_len=cfg.data.seq_len,
                                 **estimate_kwargs(wrap_options(cfg, device, compute_dtype)))
    except megatrain.UnsupportedModelError as exc:
        raise UsageError(first_line(exc, 300)) from None
    except GpuMemoryLimitError as exc:  # the cap cannot hold even the streamed schedule
        raise UsageError(exc.message("megatrain train", "runtime.gpu_memory_limit")) from None
    except ValueError as exc:  # an option the model's own shape refuses (more device_state_layers than layers)
        if not str(exc).startswith(_DEVICE_STATE_REFUSAL):
            raise UsageError(_build_error(cfg, exc)) from None
        raise UsageError("runtime." + first_line(exc)[len("megatrain.estimate: "):]) from None
    except Exception as exc:  # noqa: BLE001
        raise UsageError(_build_error(cfg, exc)) from None
    if not est.fits:
        sizes = "" if cfg.model.path is not None else "; or lower model.hidden_size, model.num_layers, model.vocab_size"
        from megatrain.runtime.placement.estimate import _count

        raise DoesNotFit(f"the model ({_count(est.num_params)} parameters) does not fit this machine: "
                         f"{est.reason()}{sizes}", est)
    return est


_DEVICE_STATE_REFUSAL = "megatrain.estimate: device_state_layers="  # estimate's refusal of K above the layer count


def _build_error(cfg: Config, exc: BaseException) -> str:
    """The one line for a config transformers cannot build a model from (``exc``), naming ``model.extra``."""
    extra = ", ".join(f"{k}={v!r}" for k, v in sorted(cfg.model.extra.items()))
    return (f"cannot build a model from this config ({first_line(exc)}); check the model sizes and model.extra"
            + (f" ({extra})" if extra else ""))


def default_out_dir() -> str:
    return os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def prepare(cfg: Config, resume: Optional[ResumePoint] = None, dry_run: bool = False,
            ranks: Optional[Ranks] = None) -> Plan:
    """Checks the user's input, estimates the run's memory and loads the data; writes nothing.

    Args:
        resume: continue this checkpoint (:func:`~megatrain.train.checkpoints.find_resume_point`); the output
            directory may then be the run directory holding it. The data must be the checkpointed run's.
        dry_run: ``--dry-run``: the same checks and the same memory rule (:func:`estimate_run`) as a real run.
        ranks: under torchrun, this process's rank (:mod:`megatrain.train.distributed`); every rank
            runs ``prepare`` (through :meth:`Ranks.agree`) before any writes.

    Raises:
        UsageError: anything the user must fix, with a one-line message.
    """
    out_dir = cfg.log.out or default_out_dir()
    _check_out_dir(cfg, out_dir, resume)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    # The model config is cheap to check and catches a bad model before reading a big corpus.
    model_config = load_model_config(cfg, tokenizer.vocab_size, tokenizer.eos_token_id, weights=not dry_run,
                                     tokenizer=f"the tokenizer {tokenizer.source!r}")
    device = (ranks or Ranks()).device_for(resolve_device(cfg.runtime.device))
    compute_dtype = resolve_dtype(cfg.runtime.compute_dtype, device)
    _check_liger_kernel(cfg.runtime.liger_kernel, device)
    if cfg.model.path is not None and has_safetensors(cfg.model.path):
        check_checkpoint(cfg.model.path, model_config)
    text = load_text_data(cfg.data, cfg.train.seed, tokenizer)
    _check_data(cfg, text, model_config, resume)
    # Last, with the data loaded: the memory available now, which the model build and training take next.
    estimate = estimate_run(cfg, model_config, device, compute_dtype)
    if ranks is None or ranks.main:  # once the input is good: a refusal stays one line
        if getattr(tokenizer, "note", None):
            warn(tokenizer.note)
        if cfg.model.path is not None and cfg.data.path == "stdlib":
            warn(f"no --data given: fine-tuning {cfg.model.path!r} on the built-in corpus (the Python standard "
                 "library's own sources); pass --data PATH for your text")
    return Plan(
        cfg=cfg,
        data=text,
        model_config=model_config,
        device=device,
        compute_dtype=compute_dtype,
        out_dir=out_dir,
        resume=resume,
        estimate=estimate,
        ranks=ranks,
    )


def _check_out_dir(cfg: Config, out_dir: str, resume: Optional[ResumePoint]) -> None:
    """Refuses an output directory the run may not write (not empty, not a directory, not writable, the
    data directory, a model there the final save may not replace) and a checkpoint with nothing left to train."""
    same_run = (
        resume is not None and resume.run_dir is not None and os.path.isdir(out_dir)
        and os.path.samefile(out_dir, resume.run_dir)
    )
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise UsageError(f"output path {out_dir!r} exists and is not a directory; choose another --out")
        data = cfg.data.path
        if data and data != STDLIB and os.path.isdir(data) and os.path.samefile(out_dir, data):
            raise UsageError(f"output directory {out_dir!r} is the data directory: later runs would read this run's "
                             "files as data; choose another --out")
        if os.listdir(out_dir) and not cfg.log.overwrite and not same_run:
            held = " (it holds checkpoints: continue that run with --resume " + out_dir + ")" if list_checkpoints(
                out_dir) else ""
            raise UsageError(
                f"output directory {out_dir!r} is not empty{held}; choose another --out or pass --set log.overwrite=true"
            )
    if resume is not None and resume.step >= cfg.train.steps:
        raise UsageError(
            f"checkpoint {resume.path!r} is at step {resume.step} and train.steps is {cfg.train.steps}: nothing to "
            "train; raise --steps"
        )
    ancestor = out_dir if os.path.isdir(out_dir) else existing_ancestor(out_dir)
    if not os.path.isdir(ancestor):
        raise UsageError(f"cannot create output directory {out_dir!r}: {ancestor!r} is a file; choose another --out")
    check_writable(ancestor, out_dir)
    if cfg.log.save_model:
        check_model_dest(out_dir)


def _check_data(cfg: Config, text: TextData, model_config, resume: Optional[ResumePoint]) -> None:
    """Refuses data with token ids past the model's vocabulary, fewer rows than a micro batch, or other
    data than the checkpoint's (``resume``)."""
    if text.max_token_id() >= model_config.vocab_size:
        raise UsageError(
            f"the data has token id {text.max_token_id()} but the model's vocab_size is {model_config.vocab_size}; "
            "use the model's tokenizer"
        )
    if cfg.train.micro_batch_size > len(text.train):
        raise UsageError(
            f"train.micro_batch_size ({cfg.train.micro_batch_size}) is more than the {len(text.train)} training rows "
            f"of {cfg.data.seq_len} tokens the data holds (one micro batch would repeat rows); lower "
            "--micro-batch-size or add data"
        )
    if resume is not None:
        want = (resume.state.get("data") or {}).get("sha256")
        if want != text.fingerprint():
            raise UsageError(
                f"the training data differs from that of checkpoint {resume.path!r}; resume with the same data.path, "
                "data.seq_len, data.max_documents, data.eval_fraction, data.tokenizer and train.seed"
            )
