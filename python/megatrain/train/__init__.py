"""The command-line trainer's building blocks (``megatrain train``).

* :mod:`megatrain.train.config`  — the YAML configuration, its defaults and checks
* :mod:`megatrain.train.data`    — text files -> tokenized, packed, split rows
* :mod:`megatrain.train.metrics` — FLOPs/MFU, transfer rates, memory; JSONL + TensorBoard sinks
* :mod:`megatrain.train.trainer` — prepare (validate) and run (train, evaluate, save)
"""

from megatrain.train.config import Config, UsageError, build_config

__all__ = ["Config", "UsageError", "build_config"]
