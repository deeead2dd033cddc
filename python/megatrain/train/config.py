"""Configuration of the command-line trainer (``megatrain train``).

A configuration is a YAML mapping with six sections (``model``, ``data``, ``train``, ``runtime``,
``eval``, ``log``). Every key has a default (presets: :mod:`megatrain.train.presets`), so an empty file
— or no file — is the built-in default run. Unknown sections or keys are errors, and values are
converted and checked at the boundary (:mod:`megatrain.train.config_checks`), so that a bad value
is reported as one line naming the key, the rule, and what was found ("train.lr must be a number, got 'abc'") before anything is loaded
or written.

This module is the schema: the sections, their keys and defaults, and the types of the values.
:mod:`megatrain.train.config_checks` converts and checks values; :mod:`megatrain.train.config_build`
merges presets, a YAML file and ``--set`` overrides into a checked :class:`Config`.

Example::

    model: {arch: llama, hidden_size: 256, num_layers: 4}
    data: {path: ./corpus, seq_len: 512}
    train: {steps: 1000, lr: 3.0e-4}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional


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


class PlacementCount(str):
    """Type of ``runtime.device_state_layers``: ``auto``, ``boundary`` or a number of decoder layers (>= 0), as
    ``megatrain.wrap(device_state_layers=)``; stored as a string, :func:`wrap_device_state_layers` converts."""


def wrap_device_state_layers(value: Optional[str]):
    """``runtime.device_state_layers`` as ``megatrain.wrap`` takes it: None (its default), ``"auto"``,
    ``"boundary"`` or an int."""
    return None if value is None else value if value in ("auto", "boundary") else int(value)


class ByteSize(int):
    """Type of ``runtime.host_memory_limit``: a number of bytes, as an integer or with a unit
    (``120GiB``, ``64 GB``, ``512MiB``; KiB/MiB/GiB/TiB are powers of 2, KB/MB/GB/TB of 10)."""


class DeviceMemoryLimit(float):
    """Type of ``runtime.gpu_memory_limit``: GPU bytes (an integer, or with a unit: ``40GiB``) or a fraction of
    the GPU's memory in (0, 1] (``0.5``), as ``megatrain.wrap(gpu_memory_limit=)`` takes it (int / float)."""


class AutoSwitch(str):
    """Type of ``runtime.liger_kernel``: ``auto`` | ``true`` | ``false`` (stored as that string);
    :func:`wrap_auto_switch` gives ``megatrain.wrap``'s None / True / False."""


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
    # Liger-Kernel's fused kernels (pip install liger-kernel): auto (when installed, on CUDA) | true | false
    liger_kernel: AutoSwitch = "auto"
    # A bf16 compute copy per decoder layer in host memory: auto (unless the host store does not fit: then the
    # deepest layers stream from their fp32 master, 12 B/param) | true | false (every eligible layer streams)
    host_compute_copy: AutoSwitch = "auto"


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
SECTION_CLASSES = {  # section name -> its dataclass
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainSection,
    "runtime": RuntimeConfig,
    "eval": EvalConfig,
    "log": LogConfig,
}
