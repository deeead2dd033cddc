"""Configuration of the command-line trainer (``megatrain train``).

A configuration is a YAML mapping with six sections (``model``, ``data``, ``train``, ``runtime``,
``eval``, ``log``). Every key has a default (presets: :mod:`megatrain.train.presets`), so an empty file
— or no file — is the built-in default run. Unknown sections or keys are errors, and values are
converted and checked here, at the boundary, so that a bad value is reported as one line naming the
key, the rule, and what was found ("train.lr must be a number, got 'abc'") before anything is loaded
or written.

Example::

    model: {arch: llama, hidden_size: 256, num_layers: 4}
    data: {path: ./corpus, seq_len: 512}
    train: {steps: 1000, lr: 3.0e-4}
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from megatrain.train.presets import PRESETS


class UsageError(ValueError):
    """A problem the user must fix (bad config value, missing file, ...).

    The CLI prints ``megatrain: error: <message>`` as one line and exits with status 2; the message
    therefore says what is wrong and what to change, on one line.
    """


@dataclass
class ModelConfig:
    """Which model to train.

    Either ``path`` (a local Hugging Face model directory: config.json + weights, loaded with
    ``megatrain.from_pretrained``) or ``arch`` plus sizes (a transformers ``model_type``
    such as ``llama``, ``qwen2``, ``mistral``; initialised from ``seed`` straight into the store by
    ``megatrain.from_config``).
    """

    path: Optional[str] = None
    arch: str = "llama"
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: Optional[int] = 2
    intermediate_size: Optional[int] = 704
    vocab_size: Optional[int] = None  # None: the tokenizer's, rounded up to pad_vocab_to_multiple_of
    pad_vocab_to_multiple_of: int = 64
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # more keyword arguments for the config class


@dataclass
class DataConfig:
    """Training text: a file, a directory (recursive, sorted), or ``stdlib``.

    ``stdlib`` is the Python standard library's own ``*.py`` sources (site-packages excluded), the
    corpus of the built-in default run. ``.jsonl`` files hold one document per line in
    ``text_field``; any other file is one document.
    """

    path: str = "stdlib"
    include: list = field(default_factory=lambda: ["*.txt", "*.md", "*.jsonl"])
    text_field: str = "text"
    tokenizer: Optional[str] = None  # None: model.path's own, else bytes; "byte": 256 bytes + EOS; or a local dir
    seq_len: int = 256
    eval_fraction: float = 0.05
    max_documents: Optional[int] = None  # cap after the seeded shuffle (quick runs on big corpora)


@dataclass
class TrainSection:
    """Optimization: steps, batch, AdamW, LR schedule."""

    steps: int = 200
    micro_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    lr: float = 3.0e-3
    lr_schedule: str = "cosine"  # cosine | linear | constant (all after linear warmup)
    warmup_steps: int = 20  # capped at steps
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine, linear)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1.0e-8
    max_grad_norm: Optional[float] = 1.0  # None or 0: no clipping
    nonfinite: str = "raise"  # NaN/inf loss or gradient: raise (stop, one line) | skip (skip the step, warn)
    seed: int = 0
    save_every: int = 0  # steps between checkpoints in out/checkpoints/ (0: none; SIGINT/SIGTERM always save)
    keep_last: int = 2  # checkpoints kept (the oldest are deleted once a newer one is complete)


class RowsMode(str):
    """Type of ``runtime.chunked_loss`` / ``runtime.tile_mlp``: ``auto`` | ``true`` | ``false`` | N rows
    (a positive integer). Stored as a plain string; :func:`wrap_rows_mode` gives ``megatrain.wrap``'s value."""


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
    raise UsageError(f"{key} must be auto, true, false or a positive number of rows, got {_describe(value)}")


class PlacementCount(str):
    """Type of ``runtime.device_state_layers``: ``auto``, ``boundary`` or a number of decoder layers (>= 0), as
    ``megatrain.wrap(device_state_layers=)``; stored as a string, :func:`wrap_device_state_layers` converts."""


def _placement_count(key: str, value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str):
        v = value.strip().lower()
        if v in ("auto", "boundary"):
            return v
        if v.isdigit():  # (a number >= 0)
            return str(int(v))
    raise UsageError(f"{key} must be auto, boundary or a number of decoder layers >= 0, got {_describe(value)}")


def wrap_device_state_layers(value: Optional[str]):
    """``runtime.device_state_layers`` as ``megatrain.wrap`` takes it: None (its default), ``"auto"``,
    ``"boundary"`` or an int."""
    return None if value is None else value if value in ("auto", "boundary") else int(value)


class ByteSize(int):
    """Type of ``runtime.host_memory_limit``: a number of bytes, as an integer or with a unit
    (``120GiB``, ``64 GB``, ``512MiB``; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB of 10)."""


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _byte_size(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise UsageError(f"{key} must be a number of bytes (e.g. 120GiB), got {_describe(value)}")
    if isinstance(value, int) and value > 0:
        return value
    if isinstance(value, float) and value.is_integer() and value > 0:
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _BYTE_UNITS:
            n = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
            if n >= 1 and (n.is_integer() or _BYTE_UNITS[m.group(2).lower()] > 1):  # no fraction of a byte
                return int(n)
    raise UsageError(f"{key} must be a number of bytes > 0, e.g. 120GiB or 128000000000, got {_describe(value)}")


class DeviceMemoryLimit(float):
    """Type of ``runtime.gpu_memory_limit``: GPU bytes (an integer, or with a unit: ``40GiB``) or a fraction of
    the GPU's memory in (0, 1] (``0.5``), as ``megatrain.wrap(gpu_memory_limit=)`` takes it (int / float)."""


def _device_memory_limit(key: str, value: Any):
    from megatrain.runtime.placement.device_state_plan import MIN_GPU_MEMORY_LIMIT_BYTES

    bad = UsageError(f"{key} must be GPU bytes >= 1MiB (e.g. 40GiB) or a fraction of the GPU's memory in (0, 1] "
                     f"(e.g. 0.5), got {_describe(value)}")
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


class AutoSwitch(str):
    """Type of ``runtime.liger_kernel``: ``auto`` | ``true`` | ``false`` (stored as that string);
    :func:`wrap_auto_switch` gives ``megatrain.wrap``'s None / True / False."""


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
    raise UsageError(f"{key} must be auto, true or false, got {_describe(value)}")


def wrap_auto_switch(value: str):
    """``runtime.liger_kernel`` as ``megatrain.wrap`` takes it: None (auto), True or False."""
    return {"auto": None, "true": True, "false": False}[value]


def wrap_rows_mode(value: str):
    """``runtime.chunked_loss`` / ``runtime.tile_mlp`` (as checked by the config) as ``megatrain.wrap``
    takes it: ``"auto"``, ``True``, ``False`` or an int of rows."""
    named = {"auto": "auto", "true": True, "false": False}
    return named[value] if value in named else int(value)


@dataclass
class RuntimeConfig:
    """Where and how the model runs (arguments of ``megatrain.wrap``)."""

    device: str = "auto"  # auto (cuda if available, else cpu) | cpu | cuda | cuda:N
    compute_dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bf16 | fp32
    # recompute | store | auto | offload | block:K (as megatrain.wrap); none: wrap's default, auto on CUDA (the
    # placement planner, the fastest exact schedule it finds) and recompute on the CPU. docs/placement.md.
    activation_policy: Optional[str] = None
    # LM head + loss over row chunks without the full logits / each layer's MLP over row tiles:
    # auto (when they would not fit in 1/16 of the free device memory) | true | false | N rows
    chunked_loss: RowsMode = "auto"
    tile_mlp: RowsMode = "auto"
    # The disk tier (megatrain.wrap's offload_dir / host_memory_limit): a directory on a local disk for
    # the fp32 state of the layers that do not fit in host memory, and the host bytes megatrain may use.
    offload_dir: Optional[str] = None
    host_memory_limit: Optional[ByteSize] = None
    # Decoder layers (from layer 0) whose whole training state stays on the GPU: auto | N; none: wrap's
    # default ("auto" under activation_policy auto on CUDA, else 0). docs/placement.md.
    device_state_layers: Optional[PlacementCount] = None
    # GPU memory the planner may use: bytes (40GiB) or a fraction of the GPU's memory (0.5); none: all of it
    gpu_memory_limit: Optional[DeviceMemoryLimit] = None
    # Liger-Kernel's fused kernels (pip install megatrain[kernels]): auto (when installed, on CUDA) | true | false
    liger_kernel: AutoSwitch = "auto"


@dataclass
class EvalConfig:
    """Held-out loss: every ``every`` steps (and at step 0 and at the end) on ``batches`` batches."""

    every: int = 50
    batches: int = 8
    batch_size: Optional[int] = None  # None: train.micro_batch_size


@dataclass
class LogConfig:
    """Where results go and how progress is shown."""

    out: Optional[str] = None  # None: runs/<YYYYmmdd-HHMMSS>
    every: int = 10
    progress: bool = True  # tqdm progress bar
    tensorboard: bool = True
    peak_tflops: Optional[float] = None  # MFU denominator; None: measured bf16/fp32 matmul on CUDA
    overwrite: bool = False  # reuse a non-empty out directory: a new run replaces its metrics, logs, checkpoints
    save_model: bool = True


@dataclass
class Config:
    """The whole trainer configuration (one attribute per YAML section)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainSection,
    "runtime": RuntimeConfig,
    "eval": EvalConfig,
    "log": LogConfig,
}


def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Converts ``value`` (from YAML or a command-line string) to ``tp`` or raises UsageError."""
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
        return _coerce(key, value, args[0])
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise UsageError(f"{key} must be true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise UsageError(f"{key} must be an integer, got {_describe(value)}")
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
        raise UsageError(f"{key} must be an integer, got {_describe(value)}")
    if tp is float:
        if isinstance(value, bool):
            raise UsageError(f"{key} must be a number, got {_describe(value)}")
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())  # YAML 1.1 reads "3e-4" as a string
            except ValueError:
                raise UsageError(f"{key} must be a number, got {_describe(value)}") from None
        else:
            raise UsageError(f"{key} must be a number, got {_describe(value)}")
        if not math.isfinite(number):
            raise UsageError(f"{key} must be a finite number, got {_describe(value)}")
        return number
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UsageError(f"{key} must be a string, got {_describe(value)}")
    if tp is list or origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return [str(v) for v in value]
        raise UsageError(f"{key} must be a list, got {_describe(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise UsageError(f"{key} must be a mapping, got {_describe(value)}")
    raise TypeError(f"unsupported config type {tp} for {key}")  # our own invariant


def _all_keys() -> dict:
    """Maps every bare key name to the sections that have it (for ``--set lr=...``)."""
    out: dict = {}
    for section, cls in _SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, []).append(section)
    return out


def resolve_key(key: str) -> tuple:
    """Turns ``"train.lr"`` or an unambiguous bare ``"lr"`` into ``("train", "lr")``."""
    key = key.strip().replace("-", "_")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in _SECTION_CLASSES:
            raise UsageError(
                f"unknown config section {section!r} in {key!r}; sections are: {', '.join(_SECTION_CLASSES)}"
            )
        names = [f.name for f in dataclasses.fields(_SECTION_CLASSES[section])]
        if name not in names:
            raise UsageError(f"unknown config key {key!r}; {section} keys are: {', '.join(names)}")
        return section, name
    owners = _all_keys().get(key)
    if not owners:
        raise UsageError(f"unknown config key {key!r}; use section.key, e.g. train.lr (see `megatrain train --print-config`)")
    if len(owners) > 1:
        raise UsageError(f"config key {key!r} is ambiguous; write one of: {', '.join(s + '.' + key for s in owners)}")
    return owners[0], key


def merge(base: dict, overrides: dict, where: str) -> dict:
    """Deep-merges a user mapping into ``base`` (a ``Config.to_dict()``), rejecting unknown keys."""
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise UsageError(f"{where} must be a mapping of sections ({', '.join(_SECTION_CLASSES)}), got {_describe(overrides)}")
    out = copy.deepcopy(base)
    for section, values in overrides.items():
        if section not in _SECTION_CLASSES:
            raise UsageError(
                f"unknown config section {section!r} in {where}; sections are: {', '.join(_SECTION_CLASSES)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UsageError(f"config section {section!r} in {where} must be a mapping, got {_describe(values)}")
        for name, value in values.items():
            resolve_key(f"{section}.{name}")  # raises on unknown keys
            out[section][name] = value
    return out


def from_dict(raw: dict) -> Config:
    """Builds a checked :class:`Config` from a fully merged mapping."""
    sections = {}
    for section, cls in _SECTION_CLASSES.items():
        types = _field_types(cls)
        values = raw.get(section, {})
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in values:
                kwargs[f.name] = _coerce(f"{section}.{f.name}", values[f.name], types[f.name])
        sections[section] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: Config) -> None:
    """Checks value ranges and choices (no file system access; see trainer.prepare for that)."""
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


def load_yaml(path: str) -> dict:
    """Reads a YAML config file; a missing or malformed file is a UsageError."""
    import yaml

    if os.path.isdir(path):
        saved = os.path.join(path, "config.yaml")  # a run's output directory holds its resolved config
        hint = f", such as {saved!r}" if os.path.isfile(saved) else ""
        raise UsageError(f"config path {path!r} is a directory; --config expects a YAML file{hint}")
    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} does not exist; pass an existing YAML file to --config")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UsageError(f"config file {path!r} is not valid YAML{where}; fix its syntax") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"config file {path!r} is not UTF-8 text (byte {exc.start}); pass a YAML file") from None
    return raw or {}


def parse_override(text: str) -> tuple:
    """Parses one ``--set section.key=value`` (value read as YAML: numbers, lists, null)."""
    import yaml

    if "=" not in text:
        raise UsageError(f"--set expects key=value (e.g. train.lr=1e-3), got {text!r}")
    key, value = text.split("=", 1)
    section, name = resolve_key(key)
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return section, name, parsed


def preset_dict(name: str) -> dict:
    """The merged mapping (dataclass defaults <- preset) for preset ``name``.

    Raises:
        UsageError: unknown preset.
    """
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    raw = Config().to_dict()
    for section, values in PRESETS[name].items():
        raw[section].update(copy.deepcopy(values))
    return raw


def build_config(
    config_path: Optional[str] = None,
    preset: str = "default",
    overrides: Optional[list] = None,
    base: Optional[dict] = None,
) -> Config:
    """Preset defaults <- YAML file <- overrides (``[(section, key, value), ...]``), checked.

    Args:
        base: a configuration mapping used instead of the preset (a checkpoint's configuration,
            for ``--resume``); keys it lacks keep their defaults.

    Raises:
        UsageError: unknown section/key, a value of the wrong type or out of range.
    """
    if base is not None:
        raw = merge(Config().to_dict(), base, where="the checkpoint's configuration")
    else:
        raw = preset_dict(preset)
    if config_path is not None:
        raw = merge(raw, load_yaml(config_path), where=repr(config_path))
    for section, name, value in overrides or []:
        raw[section][name] = value
    return from_dict(raw)


def to_yaml(cfg: Config) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
