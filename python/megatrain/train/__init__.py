"""The command-line trainer's building blocks (``megatrain train``), in the order a run uses them.

Configuration:

* :mod:`megatrain.train.config`         — the YAML configuration's sections, keys and defaults
* :mod:`megatrain.train.config_checks`  — a value converted to its key's type; ranges and choices checked
* :mod:`megatrain.train.config_build`   — preset <- YAML file <- ``--set``, merged into a checked Config
* :mod:`megatrain.train.presets`        — the built-in presets

Input:

* :mod:`megatrain.train.text_tokenizer` — the byte tokenizer or a local Hugging Face one
* :mod:`megatrain.train.data`           — text files -> tokenized, packed, split rows
* :mod:`megatrain.train.model_build`    — the model's config and weights checked; the model built into the store

A run (:func:`megatrain.train.trainer.run`):

* :mod:`megatrain.train.run_plan`       — prepare(): every check and the memory rule, nothing written -> Plan
* :mod:`megatrain.train.checkpoints`    — out/checkpoints/step-N: written, pruned, found and loaded for --resume
* :mod:`megatrain.train.run_files`      — the output directory's first files, taken back on an early failure
* :mod:`megatrain.train.step_loop`      — the steps: micro batches, optimizer, log lines, evals, checkpoints
* :mod:`megatrain.train.signals`        — SIGINT / SIGTERM: a checkpoint at the step's end, then a stop
* :mod:`megatrain.train.final_model`    — out/model, written atomically
* :mod:`megatrain.train.run_summary`    — summary.json, the loss curve, the end-of-run table
* :mod:`megatrain.train.trainer`        — run(): the driver over these phases
* :mod:`megatrain.train.metrics`        — FLOPs/MFU, transfer rates, memory; JSONL + TensorBoard sinks
* :mod:`megatrain.train.distributed`    — the ranks under torchrun
* :mod:`megatrain.train.messages`       — one-line warnings and error texts
"""

from megatrain.train.config import Config, UsageError
from megatrain.train.config_build import build_config

__all__ = ["Config", "UsageError", "build_config"]
