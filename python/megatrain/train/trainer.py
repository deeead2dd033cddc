"""The training loop behind ``megatrain train``.

:func:`prepare` checks everything that can be wrong with the user's input — config values, model
directory, data, sequence length vs the model's limit, output directory — and loads the data,
without writing anything. :func:`run` then creates the output directory and trains:

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
import datetime
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional

from megatrain.state.checkpoint import existing_ancestor
from megatrain.runtime.placement.estimate import has_weight_files
from megatrain.train.config import Config, UsageError, to_yaml
from megatrain.train.wrap_args import estimate_kwargs, wrap_options
from megatrain.train import data as data_mod
from megatrain.train import metrics as metrics_mod
from megatrain.train.distributed import Ranks



@dataclass
class Plan:
    """Everything :func:`run` needs, checked by :func:`prepare`."""

    cfg: Config
    data: data_mod.TextData
    model_config: object  # transformers.PretrainedConfig
    device: object  # torch.device
    compute_dtype: object  # torch.dtype
    out_dir: str
    resume: Optional["ResumePoint"] = None  # continue this checkpoint's run (``--resume``)
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


def resolve_dtype(spec: str, device):
    import torch

    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if spec in ("bf16", "bfloat16") else torch.float32


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, cut to ``limit`` characters (transformers' errors
    can hold a 12 KB list of model types on one line)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _check_arch(arch: str) -> None:
    """Raises a one-line UsageError if ``arch`` is not a transformers ``model_type``."""
    from transformers import CONFIG_MAPPING

    if arch in CONFIG_MAPPING:
        return
    import difflib

    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm
    except ImportError:  # pragma: no cover - moved in some transformers version: no suggestion then
        causal_lm = {}
    close = difflib.get_close_matches(arch.lower(), list(causal_lm), n=3, cutoff=0.7)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UsageError(
        f"model {arch!r} is neither a local model directory nor a transformers model_type{hint}; pass a local "
        "Hugging Face model directory (--model ./DIR, model.path) or an architecture such as llama, qwen2, "
        "mistral (model.arch)"
    )


def load_model_config(cfg: Config, vocab_size: int, eos_token_id: int, tokenizer: str = "the tokenizer",
                      weights: bool = True):
    """The HF config of the model to train (from ``model.path`` or built from ``model.arch``).

    Args:
        tokenizer: how the vocabulary check's error names the tokenizer.
        weights: require weights in ``model.path`` (False for ``--dry-run``: config.json is enough).

    Raises:
        UsageError: missing directory / config.json / weights, unknown architecture, bad sizes, a
            tokenizer with more tokens than the model's embedding has rows.
    """
    from transformers import AutoConfig

    m = cfg.model
    if m.path is not None:
        if not os.path.isdir(m.path):
            raise UsageError(f"model path {m.path!r} is not a directory; give a local Hugging Face model directory")
        if not os.path.isfile(os.path.join(m.path, "config.json")):
            raise UsageError(f"model directory {m.path!r} has no config.json; save the model with save_pretrained")
        if weights and not has_weight_files(m.path):
            raise UsageError(
                f"model directory {m.path!r} has no weights (*.safetensors or pytorch_model.bin); "
                "save the model with save_pretrained or build one from model.arch (--dry-run estimates the memory "
                "from config.json alone)"
            )
        try:
            config = AutoConfig.from_pretrained(m.path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"cannot read the config of model {m.path!r} ({_first_line(exc)})") from None
    else:
        vocab = m.vocab_size
        if vocab is None:
            mult = m.pad_vocab_to_multiple_of
            vocab = int(math.ceil(vocab_size / mult) * mult)
        kwargs = dict(
            hidden_size=m.hidden_size,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            vocab_size=vocab,
            max_position_embeddings=m.max_position_embeddings,
            tie_word_embeddings=m.tie_word_embeddings,
            bos_token_id=eos_token_id,
            eos_token_id=eos_token_id,
        )
        if m.num_kv_heads is not None:
            kwargs["num_key_value_heads"] = m.num_kv_heads
        if m.intermediate_size is not None:
            kwargs["intermediate_size"] = m.intermediate_size
        kwargs.update(m.extra)
        _check_arch(m.arch)
        try:
            config = AutoConfig.for_model(m.arch, **kwargs)
        except Exception as exc:  # noqa: BLE001
            raise UsageError(
                f"cannot build a {m.arch!r} model config ({_first_line(exc)}); "
                "model.arch must be a transformers model_type such as llama, qwen2, mistral"
            ) from None
        # A key the config class consumes (transformers 5 folds rope_theta into rope_parameters) is read even
        # though it is no attribute; only a key the config stores as it came, unknown to its class, is read by nothing.
        known = set(type(config)().to_dict())
        stored = config.to_dict()
        unknown = sorted(k for k in m.extra if k not in known and k in stored)
        if unknown:
            data_mod.warn(f"model.extra key(s) {', '.join(map(repr, unknown))} are not attributes of "
                          f"{type(config).__name__} (a typo?); they are stored in config.json but no layer reads them")
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise UsageError(
            f"model type {config.model_type!r} has no causal-LM class in transformers; use a decoder model such as llama"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise UsageError(
            f"data.seq_len ({cfg.data.seq_len}) is above the model's limit max_position_embeddings ({limit}); "
            "lower --seq-len"
        )
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and vocab_size > model_vocab:
        fix = ("pass the tokenizer the model was trained with: --tokenizer DIR" if m.path is not None
               else "raise model.vocab_size or pass a smaller tokenizer with --tokenizer")
        raise UsageError(
            f"{tokenizer} has {vocab_size} tokens but the model's embedding has {model_vocab} rows (vocab_size): "
            f"token ids past {model_vocab - 1} have no embedding; {fix}"
        )
    return config


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


def has_safetensors(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def check_checkpoint(path: str, model_config) -> None:
    """Refuse a model directory whose safetensors do not cover the model, from the headers alone
    (:func:`check_loading_info`'s messages; ``megatrain.from_pretrained`` refuses the same later).

    Raises:
        UsageError: a truncated / malformed file, a shard missing, a tensor missing or of the wrong shape.
    """
    from megatrain.state.loading import CheckpointError, CheckpointIndex, _aliases, meta_model

    try:
        index = CheckpointIndex(path)
        model = meta_model(model_config)
    except CheckpointError as exc:
        raise UsageError(f"cannot load model {path!r} ({_first_line(exc, 300)})") from None
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"cannot build a model from this config ({_first_line(exc)}); check the model sizes and "
                         "model.extra") from None
    prefix = getattr(model, "base_model_prefix", "")
    missing, mismatched, used = [], [], set()
    for first, names in _aliases(model).items():
        key = index.lookup(names, prefix)
        if key is None:
            missing.append(first)
            continue
        used.add(key)
        if tuple(index.tensors[key][1]["shape"]) != tuple(model.get_parameter(first).shape):
            mismatched.append(first)
    if mismatched:
        raise UsageError(f"model directory {path!r} holds weights whose shapes differ from its config.json "
                         f"({mismatched[0]} and {len(mismatched) - 1} more; another model size?); use the config.json "
                         "saved with these weights")
    buffers = {n for n, _ in model.named_buffers()}
    unexpected = [k for k in index.tensors if k not in used and index.lookup([k], prefix) not in used
                  and k not in buffers and not (prefix and f"{prefix}.{k}" in buffers)]
    check_loading_info(path, {"missing_keys": missing, "mismatched_keys": mismatched, "unexpected_keys": unexpected})


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
        UsageError: transformers cannot build the model from this config.
    """
    import megatrain
    from megatrain.runtime.placement.estimate import RUN_HOST_MARGIN_BYTES

    t = cfg.train
    try:
        est = megatrain.estimate(model_config, host_margin_bytes=RUN_HOST_MARGIN_BYTES,
                                 gradient_accumulation_steps=t.gradient_accumulation_steps,
                                 max_grad_norm=t.max_grad_norm or None, micro_batch_size=t.micro_batch_size,
                                 seq_len=cfg.data.seq_len,
                                 **estimate_kwargs(wrap_options(cfg, device, compute_dtype)))
    except megatrain.UnsupportedModelError as exc:
        raise UsageError(_first_line(exc, 300)) from None
    except Exception as exc:  # noqa: BLE001
        extra = ", ".join(f"{k}={v!r}" for k, v in sorted(cfg.model.extra.items()))
        raise UsageError(f"cannot build a model from this config ({_first_line(exc)}); check the model sizes and "
                         "model.extra" + (f" ({extra})" if extra else "")) from None
    if not est.fits:
        sizes = "" if cfg.model.path is not None else "; or lower model.hidden_size, model.num_layers, model.vocab_size"
        from megatrain.runtime.placement.estimate import _count

        raise DoesNotFit(f"the model ({_count(est.num_params)} parameters) does not fit this machine: "
                         f"{est.reason()}{sizes}", est)
    return est


def default_out_dir() -> str:
    return os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def prepare(cfg: Config, resume: Optional["ResumePoint"] = None, dry_run: bool = False,
            ranks: Optional[Ranks] = None) -> Plan:
    """Checks the user's input, estimates the run's memory and loads the data; writes nothing.

    Args:
        resume: continue this checkpoint (:func:`find_resume_point`); the output directory may then
            be the run directory holding it. The data must be the checkpointed run's.
        dry_run: ``--dry-run``: the same checks and the same memory rule (:func:`estimate_run`) as a real run.
        ranks: under torchrun, this process's rank (:mod:`megatrain.train.distributed`); every rank
            runs ``prepare`` (through :meth:`Ranks.agree`) before any writes.

    Raises:
        UsageError: anything the user must fix, with a one-line message.
    """
    out_dir = cfg.log.out or default_out_dir()
    same_run = (
        resume is not None and resume.run_dir is not None and os.path.isdir(out_dir)
        and os.path.samefile(out_dir, resume.run_dir)
    )
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise UsageError(f"output path {out_dir!r} exists and is not a directory; choose another --out")
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
    tokenizer = data_mod.load_tokenizer(cfg.data.tokenizer, cfg.model.path)
    # The model config is cheap to check and catches a bad model before reading a big corpus.
    model_config = load_model_config(cfg, tokenizer.vocab_size, tokenizer.eos_token_id, weights=not dry_run,
                                     tokenizer=f"the tokenizer {tokenizer.source!r}")
    device = (ranks or Ranks()).device_for(resolve_device(cfg.runtime.device))
    compute_dtype = resolve_dtype(cfg.runtime.compute_dtype, device)
    if cfg.model.path is not None and has_safetensors(cfg.model.path):
        check_checkpoint(cfg.model.path, model_config)
    text = data_mod.load_text_data(cfg.data, cfg.train.seed, tokenizer)
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
    # Last, with the data loaded: the memory available now, which the model build and training take next.
    estimate = estimate_run(cfg, model_config, device, compute_dtype)
    if ranks is None or ranks.main:  # once the input is good: a refusal stays one line
        if getattr(tokenizer, "note", None):
            data_mod.warn(tokenizer.note)
        if cfg.model.path is not None and cfg.data.path == "stdlib":
            data_mod.warn(f"no --data given: fine-tuning {cfg.model.path!r} on the built-in corpus (the Python standard "
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


def check_loading_info(path: str, info: dict) -> None:
    """Refuse a model directory whose weights do not cover the model (transformers would initialise
    the missing tensors at random and train on that) or do not fit it.

    Raises:
        UsageError: naming the first missing / mismatched tensors.
    """
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [k[0] if isinstance(k, (tuple, list)) else k for k in (info.get("mismatched_keys") or [])]
    unexpected = sorted(info.get("unexpected_keys") or [])
    if missing or mismatched:
        bad = missing or sorted(mismatched)
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        what = "has no weights for" if missing else "has weights of the wrong shape for"
        hint = f" (it holds {len(unexpected)} tensors the model does not use: a different architecture?)" if unexpected else ""
        raise UsageError(f"model directory {path!r} {what} {len(bad)} tensor(s) of the model: {shown}{hint}; they would "
                         "train from a random initialisation: use a complete checkpoint (its config.json must match)")
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        data_mod.warn(f"model directory {path!r} holds {len(unexpected)} tensor(s) the model does not use (ignored): "
                      f"{shown}")


def build_wrapped_model(plan: Plan):
    """The wrapped model, built straight into the host store: ``megatrain.from_pretrained(model.path)``
    (safetensors) or ``megatrain.from_config`` (the same values as ``torch.manual_seed(train.seed);
    AutoModelForCausalLM.from_config(config)``). The whole model never exists in memory; the store's
    budget check refuses a model that does not fit before anything large is allocated. A directory
    with only ``pytorch_model.bin`` is loaded with transformers first (:func:`build_model`).

    Raises:
        UsageError: the checkpoint cannot be loaded (names the file and tensor).
    """
    import torch

    import megatrain

    cfg = plan.cfg
    kw = wrap_options(cfg, plan.device, plan.compute_dtype).as_kwargs()  # megatrain.wrap's keywords
    torch.manual_seed(cfg.train.seed)
    if cfg.model.path is not None and not has_safetensors(cfg.model.path):
        data_mod.warn(f"model directory {cfg.model.path!r} has no safetensors weights: it is loaded whole with "
                      "transformers (4 B/param more while loading); save_pretrained writes safetensors")
        return megatrain.wrap(build_model(plan), **kw)
    if cfg.model.path is not None:
        try:
            return megatrain.from_pretrained(cfg.model.path, **kw)
        except megatrain.CheckpointError as exc:
            raise UsageError(f"cannot load model {cfg.model.path!r} ({_first_line(exc, 300)})") from None
    return megatrain.from_config(plan.model_config, seed=cfg.train.seed, **kw)


def build_model(plan: Plan):
    """The fp32 CPU model: ``from_pretrained(model.path)`` or random init from the seed (in memory;
    the trainer uses :func:`build_wrapped_model`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(plan.cfg.train.seed)
    if plan.cfg.model.path is not None:
        path = plan.cfg.model.path
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # its load report of missing keys: ours below is one line
        hf_logging.disable_progress_bar()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                               output_loading_info=True)
        except Exception as exc:  # noqa: BLE001
            if "ignore_mismatched_sizes" in str(exc):  # its "report above" is silenced: say it here
                raise UsageError(f"model directory {path!r} holds weights whose shapes differ from its config.json "
                                 "(another model size?); use the config.json saved with these weights") from None
            raise UsageError(f"cannot load model {path!r} ({_first_line(exc)})") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        check_loading_info(path, info)
        from megatrain.state.loading import count_nonfinite

        for name, p in model.named_parameters():
            bad = count_nonfinite(p)
            if bad:
                raise UsageError(f"cannot load model {path!r} (tensor {name} holds {bad} non-finite value(s) (NaN or "
                                 f"inf) of {p.numel()}; training would start from them: use an intact checkpoint)")
        return model
    return AutoModelForCausalLM.from_config(plan.model_config, dtype=torch.float32)


def check_causal(model) -> None:
    """Raises a one-line UsageError if the model's logits at a position depend on later tokens.

    ``AutoModelForCausalLM`` also builds encoder architectures (BERT, RoBERTa, ELECTRA, ...) as
    "causal" LM heads, which attend to the whole sequence unless their config sets
    ``is_decoder=True``: next-token training would then see the token it predicts. One forward of
    3 tokens in eval mode (no dropout) on the CPU model compares the first two positions' logits
    with the last token changed.
    """
    import torch

    was_training = model.training
    model.eval()
    engine = getattr(model, "megatrain", None)
    device = engine.device if engine is not None else torch.device("cpu")
    try:
        with torch.no_grad():
            x = torch.tensor([[1, 2, 3]], device=device)
            y = torch.tensor([[1, 2, 4]], device=device)
            a = model(input_ids=x).logits[0, :2].float()
            b = model(input_ids=y).logits[0, :2].float()
    except Exception as exc:  # noqa: BLE001 - a config transformers builds but cannot run (e.g. odd head_dim)
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise UsageError(f"model {kind!r} fails on a 3-token forward with this config ({_first_line(exc)}); check "
                         "the model sizes (e.g. hidden_size / num_heads must be even for rotary embeddings)") from None
    finally:
        model.train(was_training)
        if engine is not None and getattr(engine, "auto_decisions", None):
            engine.auto_decisions.clear()  # the probe's shape is not the run's (activation_policy=auto)
    # fp32: equal bit for bit in a causal model; bf16 kernels may round differently per call.
    exact = a.dtype == b.dtype and (engine is None or engine.compute_dtype == torch.float32)
    same = torch.equal(a, b) if exact else bool((a - b).abs().max() <= 1e-2 * max(1.0, float(a.abs().max())))
    if not same:
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise UsageError(
            f"model {kind!r} is not causal: its predictions at a position change with later tokens, so next-token "
            "training would see the answer. Use a decoder-only architecture (llama, qwen2, mistral, gpt2, ...)"
            + (", or set model.extra: {is_decoder: true}" if hasattr(model.config, "is_decoder") else "")
        )


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
            loss = model(input_ids=x, labels=x).loss
            n = x.shape[0] * (x.shape[1] - 1)
            total += float(loss.float().item()) * n
            count += n
    model.train(was_training)
    total, count = ranks.sum([total, count])
    return total / count


TRAIN_MARK = "megatrain_train.json"
MODEL_WHAT = "megatrain train: the final model"
MODEL_EXPECTED = "a model directory an earlier megatrain train run saved (megatrain_train.json lists its files)"


def is_train_model_dir(path: str) -> bool:
    """Whether ``path`` is a model directory :func:`save_model` wrote: ``megatrain_train.json``
    lists exactly the files there and the weights carry megatrain's producer mark. A model the user
    saved (a README, other weights, no list) is not one, and is never replaced."""
    from megatrain.state.checkpoint import EXPORT_PRODUCER, CheckpointError, _read_header

    try:
        with open(os.path.join(path, TRAIN_MARK)) as f:
            listed = json.load(f).get("files")
        names = set(os.listdir(path))
        if not isinstance(listed, list) or names != set(listed) | {TRAIN_MARK}:
            return False
        with open(os.path.join(path, "model.safetensors"), "rb") as f:
            header, _ = _read_header(f, path)
    except (OSError, ValueError, AttributeError, CheckpointError):
        return False
    return (header.get("__metadata__") or {}).get("producer") == EXPORT_PRODUCER


def check_model_dest(out_dir: str) -> str:
    """``out_dir/model`` if the final save may write there (new, empty, or an earlier run's model).

    Raises:
        UsageError: it holds something else (e.g. the user's own base model); nothing is written.
    """
    from megatrain.state.atomic import check_replaceable

    try:
        return check_replaceable(os.path.join(out_dir, "model"), MODEL_WHAT, is_train_model_dir, MODEL_EXPECTED)
    except ValueError as exc:
        raise UsageError(f"{exc} (choose another --out)") from None


def save_model(model, tokenizer, out_dir: str, plan: Plan) -> str:
    """Exports HF weights + tokenizer to ``out_dir/model``, written atomically
    (:func:`megatrain.state.atomic.atomic_directory`): a kill at any moment leaves the previous model or
    the new one there, complete. Only a directory an earlier run saved is ever replaced.

    Raises:
        UsageError: ``out_dir/model`` holds something megatrain did not write.
        OSError: the file system refused (ENOSPC, permissions); the previous model is intact.
    """
    import torch

    from megatrain.state.atomic import atomic_directory
    from megatrain.state.checkpoint import save_pretrained_streamed

    final = check_model_dest(out_dir)
    try:
        with atomic_directory(final, MODEL_WHAT, is_train_model_dir, MODEL_EXPECTED) as tmp:
            save_pretrained_streamed(model, tmp, dtype=torch.float32)
            tokenizer.save(tmp)
            with open(os.path.join(tmp, TRAIN_MARK), "w") as f:
                json.dump({"seq_len": plan.cfg.data.seq_len, "eos_token_id": tokenizer.eos_token_id,
                           "tokenizer": tokenizer.kind, "files": sorted(os.listdir(tmp))}, f)
    except ValueError as exc:
        if isinstance(exc, UsageError) or not str(exc).startswith(MODEL_WHAT):
            raise
        raise UsageError(f"{exc} (choose another --out)") from None  # it changed during the run
    return final


class _NullBar:
    def update(self, n=1):
        pass

    def set_postfix(self, *args, **kwargs):
        pass

    def close(self):
        pass


def _echo(text: str, bar) -> None:
    try:
        from tqdm.auto import tqdm

        tqdm.write(text)
    except ImportError:  # pragma: no cover
        print(text)


# ---------------------------------------------------------------------------- checkpoints and resume
CHECKPOINTS = "checkpoints"
TRAINER_TAG = "megatrain train"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_path(out_dir: str, step: int) -> str:
    """``out_dir/checkpoints/step-NNNNNNNN``: where the checkpoint after ``step`` steps goes."""
    return os.path.join(out_dir, CHECKPOINTS, f"step-{step:08d}")


def list_checkpoints(out_dir: str) -> list:
    """Complete checkpoints under ``out_dir/checkpoints`` as ``[(step, path)]``, oldest first."""
    root = os.path.join(out_dir, CHECKPOINTS)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = _STEP_DIR.match(name)
            path = os.path.join(root, name)
            if match and os.path.isfile(os.path.join(path, "manifest.json")):
                found.append((int(match.group(1)), path))
    return sorted(found)


@dataclass
class ResumePoint:
    """A ``megatrain train`` checkpoint to continue from (see :func:`find_resume_point`)."""

    path: str  # absolute checkpoint directory
    step: int  # optimizer steps done
    state: dict  # the trainer's ``extra`` dict: config, data position, metrics so far
    run_dir: Optional[str]  # the run's out directory when the checkpoint is <run>/checkpoints/step-N


def find_resume_point(path: str) -> ResumePoint:
    """The checkpoint ``--resume PATH`` means: PATH itself, or the newest complete one of a run directory.

    Reads only the manifest and ``state.json`` (the tensors are verified and loaded by :func:`run`).

    Raises:
        UsageError: PATH is neither, the checkpoint is damaged, or it was not written by ``megatrain train``.
    """
    from megatrain.state.checkpoint import CheckpointError, read_manifest

    if not os.path.exists(path):
        raise UsageError(f"--resume {path!r} does not exist; give a run's out directory or one of its checkpoints")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "manifest.json")):
        found = list_checkpoints(path)
        if not found:
            raise UsageError(
                f"--resume {path!r} holds no complete checkpoint ({CHECKPOINTS}/step-N/manifest.json); runs write "
                "them every train.save_every steps and on Ctrl-C/SIGTERM"
            )
        path = found[-1][1]
    path = os.path.abspath(path)
    try:
        read_manifest(path)
        with open(os.path.join(path, "state.json")) as f:
            extra = json.load(f).get("extra") or {}
    except CheckpointError as exc:
        raise UsageError(f"cannot resume from {path!r}: {_first_line(exc)}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot resume from {path!r}: state.json is unreadable ({_first_line(exc)})") from None
    if extra.get("trainer") != TRAINER_TAG or "step" not in extra or "config" not in extra:
        raise UsageError(
            f"checkpoint {path!r} was not written by megatrain train (it has no training position); load it with "
            "megatrain.load_checkpoint in your own loop"
        )
    parent = os.path.dirname(path)
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == CHECKPOINTS else None
    return ResumePoint(path=path, step=int(extra["step"]), state=extra, run_dir=run_dir)


def _prune_checkpoints(out_dir: str, step: int, keep_last: int) -> None:
    """Deletes all but the ``keep_last`` newest checkpoints at or before ``step`` (later ones, left by
    a run resumed from an earlier checkpoint, are replaced when training reaches their step)."""
    old = [p for s, p in list_checkpoints(out_dir) if s <= step]
    for path in old[: max(0, len(old) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


class StopRequest:
    """SIGINT / SIGTERM while training: finish the current step, write a checkpoint, stop.

    Installed by :func:`run` for the training loop (``deferred``). Outside it (loading, the first
    evaluation, the final export) and on a second signal, the signal raises KeyboardInterrupt at once.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self.deferred = False

    def __call__(self, signum, frame):
        if self.deferred and self.signum is None:
            self.signum = signum
            return
        self.signum = self.signum or signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGINT and SIGTERM while the block runs (main thread only; elsewhere: no change)."""
        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal at a step boundary; ``checkpoint`` resumes it (None if none was written)."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


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


def _activation_policy(model, cfg: Config) -> Optional[str]:
    """The activation policy the run uses: ``runtime.activation_policy``, or wrap's default it resolved to."""
    engine = getattr(model, "megatrain", None)
    return getattr(engine, "activation_policy", None) or cfg.runtime.activation_policy


def _long_context(engine, cfg: Config) -> dict:
    """``runtime.chunked_loss`` / ``runtime.tile_mlp`` and what the last forward used: ``loss_rows``
    (rows per loss chunk, None: full logits), ``mlp_rows`` (rows per MLP tile, None: untiled), ``tokens``."""
    lc = getattr(engine, "long_context", None)
    last = dict(lc.last) if lc is not None else {}
    return {"chunked_loss": cfg.runtime.chunked_loss, "tile_mlp": cfg.runtime.tile_mlp, **last}


def run(cfg: Config, plan: Optional[Plan] = None, echo=None, stop: Optional[StopRequest] = None) -> dict:
    """Trains per ``cfg`` and returns the summary (also written to ``out/summary.json``).

    With ``plan.resume`` it continues that checkpoint's run exactly (weights, Adam state, scheduler,
    data position, RNG, metrics so far). SIGINT / SIGTERM during training write a checkpoint at
    the end of the current step and raise :class:`Interrupted`.

    Raises:
        UsageError: bad input (before anything is written).
        Interrupted: stopped by a signal (``summary.json`` says ``"status": "interrupted"``).
    """
    import torch

    import megatrain
    from megatrain.state.checkpoint import CheckpointError

    plan = plan or prepare(cfg)
    t, d = cfg.train, plan.data
    device = plan.device
    ranks = plan.ranks or Ranks()
    say = (echo or (lambda s: _echo(s, None))) if ranks.main else (lambda s: None)
    stop = stop or StopRequest()
    resume = plan.resume

    model = build_wrapped_model(plan)
    check_causal(model)
    params = metrics_mod.count_params(model)
    policy = _activation_policy(model, cfg)
    flops = metrics_mod.flops_per_token(model.config, params, d.seq_len, policy)
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

    # Metrics state: carried across a resume in the checkpoint, so the summary covers the whole run.
    ms = {
        "evals": [], "train_time_s": 0.0, "last_window_loss": None, "windows": 0,
        "first_window": [0.0, 0.0], "steady": [0.0, 0.0],  # [sum of tokens/step, sum of step_time_s]
        "window_steps": 0, "window_loss": 0.0, "window_time_s": 0.0, "rows_consumed": 0,
    }
    start_step = 0
    if resume is not None:
        try:
            extra = megatrain.load_checkpoint(resume.path, model, optimizer, scheduler)
        except (CheckpointError, ValueError) as exc:
            raise UsageError(f"cannot resume from {resume.path!r}: {_first_line(exc)}") from None
        start_step = int(extra["step"])
        ms.update(extra.get("metrics") or {})

    out_dir = plan.out_dir
    # Under torchrun a global micro-batch has world x micro_batch_size rows; this rank trains on its share.
    tokens_per_step = t.micro_batch_size * t.gradient_accumulation_steps * d.seq_len * ranks.world
    rows_per_step = t.micro_batch_size * t.gradient_accumulation_steps * ranks.world
    eval_bs = (cfg.eval.batch_size or t.micro_batch_size) * ranks.world  # rows per eval batch, all ranks
    eval_batches = d.eval_batches(eval_bs, cfg.eval.batches)
    batches = d.train_batches(t.micro_batch_size * ranks.world, t.seed, start_row=ms["rows_consumed"])
    fingerprint = d.fingerprint()

    say(
        f"megatrain train: {params['total'] / 1e6:.2f}M params ({model.config.model_type}, "
        f"{model.config.num_hidden_layers} layers) on {device} in {str(plan.compute_dtype).replace('torch.', '')}, "
        f"{d.num_documents} documents ({d.num_eval_documents} held out) -> {len(d.train)} train / "
        f"{len(d.eval)} eval rows of {d.seq_len} tokens; {tokens_per_step} tokens/step"
        + (f" over {ranks.world} ranks" if ranks.world > 1 else "") + f"; out {out_dir}"
        + (f"; resumed at step {start_step} from {resume.path}" if resume is not None else "")
    )
    if device.type == "cuda" and params["total"] < 100e6:
        say("megatrain train: a model this small fits in GPU memory; `megatrain train --preset 1b` streams a 1B "
            "model's layers from host memory (about 2 minutes on an H200)")

    # Everything is checked; only now does anything get written (by global rank 0 under torchrun).
    added = RunFiles(out_dir)  # what this run adds to out_dir: taken back if the run fails before its first step
    sink = _NullSink()
    if ranks.main:
        try:
            os.makedirs(out_dir, exist_ok=True)
            if resume is None:  # a new run in a reused (log.overwrite) directory: nothing of the old run is mixed in
                for name in (CHECKPOINTS, "tensorboard"):
                    shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            write_text_atomic(os.path.join(out_dir, "config.yaml"), to_yaml(cfg))
            sink = metrics_mod.MetricsSink(out_dir, tensorboard=cfg.log.tensorboard, append=resume is not None)
        except BaseException as exc:
            added.take_back(exc)
            raise
    stats = metrics_mod.StatsWindow(engine)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    evals = ms["evals"]
    status = "failed"
    summary: dict = {}
    bar = _NullBar()
    start_time = time.perf_counter()
    done_step = start_step  # optimizer steps completed
    failed_to_start: Optional[BaseException] = None  # the error of a run that failed before its first step
    final_signals = contextlib.ExitStack()  # the signal handlers of the final export, restored in `finally`
    saved = {"step": None, "path": None}  # the newest checkpoint this process wrote

    def save(at_step: int, window_time_s: float) -> str:
        state = dict(ms, evals=evals, window_time_s=window_time_s)
        extra = {
            "trainer": TRAINER_TAG,
            "step": at_step,
            "epoch": state["rows_consumed"] // len(d.train),  # informational; rows_consumed is the position
            "config": cfg.to_dict(),
            "data": {"sha256": fingerprint, "train_rows": len(d.train), "seq_len": d.seq_len},
            "metrics": state,
        }
        path = megatrain.save_checkpoint(checkpoint_path(out_dir, at_step), model, optimizer, scheduler, extra=extra)
        if ranks.main:
            _prune_checkpoints(out_dir, at_step, t.keep_last)
        saved.update(step=at_step, path=path)
        return path

    try:
        if resume is None:
            loss0 = evaluate(model, eval_batches, device, ranks)
            evals.append({"step": 0, "eval_loss": loss0})
            sink.write({"step": 0, "eval_loss": loss0}, prefix="eval")
            say(f"step 0 | eval loss {loss0:.4f}")
        else:
            sink.write({"step": start_step, "checkpoint": resume.path}, prefix="resume")
        if cfg.log.progress and ranks.main:
            from tqdm.auto import tqdm

            bar = tqdm(total=t.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
        model.train()
        window_start = time.perf_counter() - ms["window_time_s"]
        stats.reset()  # the initial eval's copies are not training's
        with stop.installed():
            stop.deferred = True
            for step in range(start_step + 1, t.steps + 1):
                step_loss = 0.0
                for _ in range(t.gradient_accumulation_steps):
                    x = ranks.shard(next(batches)).to(device, non_blocking=True)
                    loss = model(input_ids=x, labels=x).loss / t.gradient_accumulation_steps
                    loss.backward()
                    step_loss += loss.detach().float()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                ms["rows_consumed"] += rows_per_step
                done_step = step
                # syncs: the step's work is done when this returns. Under torchrun: the mean over the
                # ranks, and a signal any rank got stops every rank after this step.
                last_loss, stopping = _step_outcome(ranks, step_loss, stop.signum)
                if not math.isfinite(last_loss):
                    if t.nonfinite == "raise":
                        raise FloatingPointError(f"loss is {last_loss} at step {step}; lower train.lr (or set "
                                                 "train.nonfinite=skip to skip such steps)")
                    say(f"step {step} | loss {last_loss}: non-finite, the update was skipped "
                        f"({optimizer.skipped_steps} skipped so far)")
                    bar.update(1)
                    continue
                ms["window_steps"] += 1
                ms["window_loss"] += last_loss
                now = time.perf_counter()
                rate = ms["window_steps"] * tokens_per_step / max(now - window_start, 1e-12)
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{rate:.0f}")

                if step % cfg.log.every == 0 or step == t.steps:
                    wall = now - window_start
                    n = ms["window_steps"]
                    ms["train_time_s"] += wall
                    step_s = wall / n
                    tok_s = n * tokens_per_step / wall
                    rec = {
                        "step": step,
                        "loss": ms["window_loss"] / n,
                        "lr": scheduler.get_last_lr()[0],
                        # global gradient L2 norm before clipping, last step (CPUAdamW with max_grad_norm)
                        "grad_norm": getattr(optimizer, "last_grad_norm", None),
                        "skipped_steps": optimizer.skipped_steps,  # non-finite loss / gradient: update skipped
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
                    rec.update(stats.step(wall))
                    sink.write(rec)
                    say(metrics_mod.log_line(rec))
                    # Steady state for the summary: every log window but the first (warm-up), if any.
                    ms["windows"] += 1
                    acc = ms["first_window"] if ms["windows"] == 1 else ms["steady"]
                    acc[0] += tokens_per_step
                    acc[1] += step_s
                    ms["last_window_loss"] = rec["loss"]
                    ms["window_steps"], ms["window_loss"] = 0, 0.0
                    window_start = time.perf_counter()

                if step % cfg.eval.every == 0 or step == t.steps:
                    eval_start = time.perf_counter()
                    ev = evaluate(model, eval_batches, device, ranks)
                    evals.append({"step": step, "eval_loss": ev})
                    sink.write({"step": step, "eval_loss": ev}, prefix="eval")
                    say(f"step {step} | eval loss {ev:.4f}")
                    window_start += time.perf_counter() - eval_start  # eval time is not training time
                    if ms["window_steps"] == 0:  # eval right after a log line: keep its copies out of the next window
                        stats.reset()

                periodic = t.save_every and (step % t.save_every == 0 or step == t.steps)
                if periodic or stopping is not None:
                    save_start = time.perf_counter()
                    path = save(step, save_start - window_start)
                    window_start += time.perf_counter() - save_start  # nor is saving
                    if periodic:
                        say(f"step {step} | checkpoint {path}")
                if stopping is not None:
                    raise Interrupted(stopping, step, saved["path"])
            stop.deferred = False
        bar.close()
        bar = _NullBar()
        model_dir = None
        final_signals.enter_context(stop.installed())  # not deferred: a signal during the export stops it at once
        if cfg.log.save_model:
            final = os.path.abspath(os.path.join(out_dir, "model"))
            before = _dir_id(final)
            try:
                model_dir = ranks.on_main(lambda: save_model(model, d.tokenizer, out_dir, plan), others=final)
                stop.deferred = True  # the model is in place: a signal from now on is noted, the run completes
            except KeyboardInterrupt:
                if not (ranks.main and before != _dir_id(final) and is_train_model_dir(final)):
                    raise  # before the swap: the previous model (or none) is in place
                model_dir, stop.deferred = final, True  # after the swap: the new model is saved
        stop.deferred = True
        loss_curve = write_loss_curve(sink.path, out_dir) if ranks.main else None
        status = "completed"
        first, steady = ms["first_window"], ms["steady"]
        tok_tot, time_tot, count = (steady[0], steady[1], ms["windows"] - 1) if ms["windows"] > 1 else (
            first[0], first[1], ms["windows"])
        tok_s = tok_tot / time_tot if time_tot else None
        summary = {
            "status": status,
            "steps": t.steps,
            "tokens": t.steps * tokens_per_step,
            "tokens_per_step": tokens_per_step,
            "initial_eval_loss": evals[0]["eval_loss"],
            "final_eval_loss": evals[-1]["eval_loss"],
            "final_train_loss": ms["last_window_loss"],
            "eval_history": evals,
            "eval_batches": len(eval_batches),
            "eval_batch_size": eval_bs,
            "train_time_s": ms["train_time_s"],
            "wall_time_s": time.perf_counter() - start_time,
            "tokens_per_s": tok_s,
            "step_time_s": (time_tot / count) if count else None,
            "model_tflops": flops.model * tok_s / 1e12 if tok_s else None,
            "recompute_tflops": flops.recompute * tok_s / 1e12 if tok_s else None,
            "mfu": flops.model * tok_s / peak if (peak and tok_s) else None,
            "peak_tflops": peak / 1e12 if peak else None,
            "peak_source": peak_source,
            "model_flops_per_token": flops.model,
            "recompute_flops_per_token": flops.recompute,
            "params": params,
            "device": str(device),
            "world_size": ranks.world,
            "compute_dtype": str(plan.compute_dtype).replace("torch.", ""),
            "activation_policy": policy,
            "auto_decisions": _auto_decisions(engine),
            "placement": engine.placement() if engine is not None else None,
            "long_context": _long_context(engine, cfg),
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "host_rss_bytes": metrics_mod.host_rss_bytes(),
            "engine_stats": stats.read(),
            "model_dir": model_dir,
            "tokenizer": d.tokenizer.source,
            "loss_curve": loss_curve,
            "metrics_file": sink.path,
            "tensorboard_dir": sink.tensorboard_dir,
            "checkpoints": [p for _, p in list_checkpoints(out_dir)],
            "resumed_from": {"step": start_step, "checkpoint": resume.path} if resume is not None else None,
            "out_dir": out_dir,
        }
        if stop.signum is not None:
            saved_to = f"the final model was saved to {model_dir}" if model_dir else "training had finished"
            say(f"megatrain train: {signal.Signals(stop.signum).name} arrived after {saved_to}; the run is complete")
        return summary
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as exc:
        if ranks.main and done_step == start_step and saved["path"] is None:
            failed_to_start = exc  # nothing was trained: out_dir is taken back to what it was
        raise
    finally:
        stop.deferred = status == "completed"  # a completed run's records are written whatever signal comes
        bar.close()
        sink.close()
        if failed_to_start is not None:
            added.take_back(failed_to_start)
        elif not summary:
            summary = {
                "status": status,
                "step": done_step,
                "checkpoint": saved["path"] if saved["step"] == done_step else None,
                "eval_history": evals,
                "activation_policy": _activation_policy(model, cfg),
                "auto_decisions": _auto_decisions(engine),
                "resumed_from": {"step": start_step, "checkpoint": resume.path} if resume is not None else None,
                "out_dir": out_dir,
            }
            if summary["checkpoint"]:
                summary["resume_command"] = f"megatrain train --resume {out_dir}"
        try:
            if ranks.main and not added.taken_back:
                with open(os.path.join(out_dir, "summary.json"), "w") as f:
                    json.dump(summary, f, indent=2, default=metrics_mod._json_default)
        finally:
            final_signals.close()


def _step_outcome(ranks: Ranks, step_loss, signum: Optional[int]):
    """``(loss, signal to stop on)`` of a step: under torchrun the mean loss over the ranks and the signal
    any rank got (so every rank saves and stops after the same step), else this process's."""
    if ranks.world == 1:
        return float(step_loss), signum
    loss, sigint, sigterm = ranks.sum([float(step_loss), float(signum == signal.SIGINT),
                                       float(signum is not None and signum != signal.SIGINT)])
    return loss / ranks.world, (signal.SIGTERM if sigterm else signal.SIGINT if sigint else None)


def write_loss_curve(metrics_path: str, out_dir: str) -> Optional[str]:
    """``out_dir/loss_curve.png`` drawn from ``metrics_path`` (:func:`metrics.plot_loss_curve`); its path,
    or None after one warning line when it cannot be drawn (the trained model is not lost over a plot)."""
    path = os.path.join(out_dir, metrics_mod.LOSS_CURVE_FILE)
    try:
        return metrics_mod.plot_loss_curve(metrics_path, path, title=f"megatrain train: {out_dir}")
    except Exception as exc:  # noqa: BLE001 - matplotlib missing / broken, a full disk
        data_mod.warn(f"the loss curve {path!r} was not written ({_first_line(exc)}); metrics.jsonl holds the losses")
        return None


def _dir_id(path: str):
    """``(st_dev, st_ino)`` of directory ``path``, None if there is none: an atomic swap changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None


def write_text_atomic(path: str, text: str) -> None:
    """Writes ``path`` through a temporary file beside it and one rename: a full disk or a kill leaves
    the old file (or none), never an empty or half-written one.

    Raises:
        OSError: the file system refused (ENOSPC, permissions); the temporary file is removed.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror, path) from None  # a failed write() names no file: name it
        raise


class RunFiles:
    """What a new run adds to its output directory, so that a run that fails before its first step
    leaves ``--out`` as it found it (a rerun is then not refused as "not empty").

    Files the run replaced (``log.overwrite``, ``--resume``) stay; only what did not exist is
    removed, and the directories the run created, if they are empty again.
    """

    NAMES = ("config.yaml", "metrics.jsonl", "tensorboard", "summary.json")

    def __init__(self, out_dir: str):
        self.out_dir = os.path.abspath(out_dir)
        self.ancestor = self.out_dir if os.path.isdir(self.out_dir) else existing_ancestor(self.out_dir)
        self.new = [n for n in self.NAMES if not os.path.lexists(os.path.join(self.out_dir, n))]
        self.taken_back = False

    def take_back(self, exc: Optional[BaseException] = None) -> None:
        """Removes what this run added; marks ``exc`` (``out_left_as_found = True``) for the message."""
        for name in self.new:
            path = os.path.join(self.out_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        d = self.out_dir
        while d != self.ancestor and len(d) > len(self.ancestor):
            try:
                os.rmdir(d)  # only an empty directory: never anything the user put there
            except OSError:
                break
            d = os.path.dirname(d)
        self.taken_back = True
        if exc is not None:
            with contextlib.suppress(AttributeError, TypeError):
                exc.out_left_as_found = True


class _NullSink:
    """The metrics sink of ranks other than 0 under torchrun (rank 0 writes the metrics)."""

    path = None
    tensorboard_dir = None

    def write(self, record: dict, prefix: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


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
        rows.append(("host bytes/param", f(stats["bytes_per_param"], ".2f")))
    rows.append(("wall time", f"{summary['wall_time_s']:.1f} s"))
    rows.append(("model saved to", summary.get("model_dir") or "(not saved)"))
    rows.append(("tokenizer", summary.get("tokenizer") or "n/a"))
    rows.append(("loss curve", summary.get("loss_curve") or "(not written)"))
    rows.append(("metrics", summary.get("metrics_file") or "n/a"))
    rows.append(("TensorBoard logs", summary.get("tensorboard_dir") or "(off: log.tensorboard=false or not installed)"))
    if summary.get("out_dir"):
        rows.append(("summary", os.path.join(summary["out_dir"], "summary.json")))
    return rows
