"""Conversion and checks of ``megatrain train``'s configuration values.

:func:`coerce` turns a value from YAML or the command line into its key's type
(:mod:`megatrain.train.config`) and :func:`validate` checks the ranges and choices of a whole
:class:`~megatrain.train.config.Config`; both raise a one-line :class:`UsageError` naming the key, the
rule and what was found.
"""

from __future__ import annotations

import math
import typing
from typing import Any

from megatrain.byte_units import parse_bytes
from megatrain.train.config import (AutoSwitch, ByteSize, Config, DeviceMemoryLimit, PlacementCount, RowsMode,
                                    UsageError)


def _rows_mode(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and value >= 1:
        return str(value)
    if isinstance(value, str):
        v = value.strip().lower().replace("_", "")
        if v in ("auto", "true", "false"):
            return v
        if v.isdigit() and int(v) >= 1:
            return str(int(v))
    raise UsageError(f"{key} must be auto, true, false or a positive number of rows, got {describe_value(value)}")


def _placement_count(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "boundary"):
            return v
        if v.isdigit():  # (a number >= 0)
            return str(int(v))
    raise UsageError(f"{key} must be auto, boundary or a number of decoder layers >= 0, got {describe_value(value)}")


def _byte_size(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise UsageError(f"{key} must be a number of bytes (e.g. 120GiB), got {describe_value(value)}")
    try:  # (a count above 2**63 - 1, inf: no limit beyond the machine's, as megatrain.wrap reads it)
        return parse_bytes(value, saturate=True)
    except ValueError:
        raise UsageError(f"{key} must be a number of bytes > 0, e.g. 120GiB or 128000000000 (inf: no limit), "
                         f"got {describe_value(value)}") from None


def _device_memory_limit(key: str, value: Any):
    from megatrain.runtime.placement.device_state_plan import MIN_GPU_MEMORY_LIMIT_BYTES

    bad = UsageError(f"{key} must be GPU bytes >= 1MiB (e.g. 40GiB) or a fraction of the GPU's memory in (0, 1] "
                     f"(e.g. 0.5), got {describe_value(value)}")
    if isinstance(value, bool):
        raise bad
    fraction = value if isinstance(value, float) else None
    if isinstance(value, str) and "." in value and not any(c.isalpha() for c in value):
        try:
            fraction = float(value.strip())
        except ValueError:
            raise bad from None
    if fraction is not None:
        if 0.0 < fraction <= 1.0:
            return float(fraction)
        if not fraction.is_integer():
            raise bad
    try:
        n = _byte_size(key, value)
    except UsageError:
        raise bad from None
    if n < MIN_GPU_MEMORY_LIMIT_BYTES:
        raise bad
    return n


def _auto_switch(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "none", "null", ""):
            return "auto"
        if v in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return "true" if v in ("true", "yes", "on", "1") else "false"
    if value is None:
        return "auto"
    raise UsageError(f"{key} must be auto, true or false, got {describe_value(value)}")


def describe_value(value: Any) -> str:
    """``repr(value)`` cut to 60 characters: how an error message shows the value it refuses."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Converts ``value`` (from YAML or a command-line string) to ``tp`` or raises UsageError.

    Args:
        key: ``section.name``, for the error message.
        tp: the key's type in the schema (:mod:`megatrain.train.config`).
    """
    origin = typing.get_origin(tp)
    if tp is RowsMode:
        return _rows_mode(key, value)
    if tp is ByteSize:
        return _byte_size(key, value)
    if tp is PlacementCount:
        return _placement_count(key, value)
    if tp is DeviceMemoryLimit:
        return _device_memory_limit(key, value)
    if tp is AutoSwitch:
        return _auto_switch(key, value)
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "~", "")):
            return None
        return coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise UsageError(f"{key} must be true or false, got {describe_value(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise UsageError(f"{key} must be an integer, got {describe_value(value)}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.strip().replace("_", ""))
            except ValueError:
                number = None
            if number is not None and math.isfinite(number) and number.is_integer():
                return int(number)
        raise UsageError(f"{key} must be an integer, got {describe_value(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise UsageError(f"{key} must be a number, got {describe_value(value)}")
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                raise UsageError(f"{key} must be a number, got {describe_value(value)}") from None
        else:
            raise UsageError(f"{key} must be a number, got {describe_value(value)}")
        if not math.isfinite(number):
            raise UsageError(f"{key} must be a finite number, got {describe_value(value)}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UsageError(f"{key} must be a string, got {describe_value(value)}")
    if tp is list or origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        raise UsageError(f"{key} must be a list, got {describe_value(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise UsageError(f"{key} must be a mapping, got {describe_value(value)}")
    raise TypeError(f"unsupported config type {tp} for {key}")  # our own invariant


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: Config) -> None:
    """Checks value ranges and choices (no file system access; see megatrain.train.run_plan.prepare for that)."""
    m, d, t, r, e, lg = cfg.model, cfg.data, cfg.train, cfg.runtime, cfg.eval, cfg.log
    for key, value in [
        ("model.hidden_size", m.hidden_size),
        ("model.num_layers", m.num_layers),
        ("model.num_heads", m.num_heads),
        ("model.num_kv_heads", m.num_kv_heads),
        ("model.intermediate_size", m.intermediate_size),
        ("model.vocab_size", m.vocab_size),
        ("model.pad_vocab_to_multiple_of", m.pad_vocab_to_multiple_of),
        ("model.max_position_embeddings", m.max_position_embeddings),
        ("data.seq_len", d.seq_len),
        ("data.max_documents", d.max_documents),
        ("train.steps", t.steps),
        ("train.micro_batch_size", t.micro_batch_size),
        ("train.gradient_accumulation_steps", t.gradient_accumulation_steps),
        ("train.lr", t.lr),
        ("train.eps", t.eps),
        ("eval.every", e.every),
        ("eval.batches", e.batches),
        ("eval.batch_size", e.batch_size),
        ("log.every", lg.every),
        ("log.peak_tflops", lg.peak_tflops),
        ("train.keep_last", t.keep_last),
    ]:
        _positive(key, value)
    for key, value in [
        ("train.save_every", t.save_every),
        ("train.warmup_steps", t.warmup_steps),
        ("train.weight_decay", t.weight_decay),
        ("train.max_grad_norm", t.max_grad_norm),
    ]:
        _positive(key, value, allow_zero=True)
    if m.path is None and m.num_heads and m.hidden_size % m.num_heads:
        raise UsageError(f"model.hidden_size ({m.hidden_size}) must be divisible by model.num_heads ({m.num_heads})")
    if m.path is None and m.num_kv_heads and m.num_heads % m.num_kv_heads:
        raise UsageError(f"model.num_heads ({m.num_heads}) must be divisible by model.num_kv_heads ({m.num_kv_heads})")
    if m.path is None and d.seq_len > m.max_position_embeddings:
        raise UsageError(
            f"data.seq_len ({d.seq_len}) is above the model's limit max_position_embeddings "
            f"({m.max_position_embeddings}); lower data.seq_len or raise model.max_position_embeddings"
        )
    if d.seq_len < 2:
        raise UsageError(f"data.seq_len must be >= 2 (a next-token loss needs two tokens per row), got {d.seq_len}")
    if not 0.0 < d.eval_fraction < 1.0:
        raise UsageError(f"data.eval_fraction must be between 0 and 1 (exclusive), got {d.eval_fraction}")
    if not 0.0 <= t.beta1 < 1.0 or not 0.0 <= t.beta2 < 1.0:
        raise UsageError(f"train.beta1 and train.beta2 must be in [0, 1), got {t.beta1}, {t.beta2}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise UsageError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.nonfinite not in ("raise", "skip"):
        raise UsageError(f"train.nonfinite must be raise or skip, got {t.nonfinite!r}")
    if t.lr_schedule not in ("cosine", "linear", "constant"):
        raise UsageError(f"train.lr_schedule must be cosine, linear or constant, got {t.lr_schedule!r}")
    if r.compute_dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32"):
        raise UsageError(f"runtime.compute_dtype must be auto, bf16 or fp32, got {r.compute_dtype!r}")
    if not (r.device in ("auto", "cpu", "cuda") or (r.device.startswith("cuda:") and r.device[5:].isdigit())):
        raise UsageError(f"runtime.device must be auto, cpu, cuda or cuda:N, got {r.device!r}")
    from megatrain.runtime.model.wrap import check_activation_policy  # the rule of megatrain.wrap itself

    try:
        if r.activation_policy is not None:
            check_activation_policy(r.activation_policy, "runtime.activation_policy")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if r.offload_dir is not None:
        from megatrain.runtime.placement.disk_plan import check_offload_args  # megatrain.wrap's own rule

        try:
            check_offload_args(r.offload_dir, None, "runtime")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
