"""The command-line trainer's building blocks (``megatrain train``).

* :mod:`megatrain.train.config`  — the YAML configuration's sections, keys and defaults
* :mod:`megatrain.train.config_checks` — a value converted to its key's type; ranges and choices checked
* :mod:`megatrain.train.config_build` — preset <- YAML file <- ``--set``, merged into a checked Config
* :mod:`megatrain.train.data`    — text files -> tokenized, packed, split rows
* :mod:`megatrain.train.metrics` — FLOPs/MFU, transfer rates, memory; JSONL + TensorBoard sinks
* :mod:`megatrain.train.trainer` — prepare (validate) and run (train, evaluate, save)
"""

from megatrain.train.config import Config, UsageError
from megatrain.train.config_build import build_config

__all__ = ["Config", "UsageError", "build_config"]
