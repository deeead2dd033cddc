"""The final model of a ``megatrain train`` run: ``out/model``, written atomically, and the test of a
directory an earlier run saved (the only kind the final save ever replaces).
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatrain.train.config import UsageError
from megatrain.train.distributed import Ranks
from megatrain.train.signals import StopRequest

TRAIN_MARK = "megatrain_train.json"
MODEL_WHAT = "megatrain train: the final model"
MODEL_EXPECTED = "a model directory an earlier megatrain train run saved (megatrain_train.json lists its files)"


def is_train_model_dir(path: str) -> bool:
    """Whether ``path`` is a model directory :func:`save_model` wrote: ``megatrain_train.json``
    lists exactly the files there and the weights carry megatrain's producer mark. A model the user
    saved (a README, other weights, no list) is not one, and is never replaced."""
    from megatrain.state.checkpoint import CheckpointError
    from megatrain.state.export import EXPORT_PRODUCER
    from megatrain.state.safetensors_file import read_header

    try:
        with open(os.path.join(path, TRAIN_MARK)) as f:
            listed = json.load(f).get("files")
        names = set(os.listdir(path))
        if not isinstance(listed, list) or names != set(listed) | {TRAIN_MARK}:
            return False
        with open(os.path.join(path, "model.safetensors"), "rb") as f:
            header, _ = read_header(f, path)
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


def save_model(model, tokenizer, out_dir: str, plan) -> str:
    """Exports HF weights + tokenizer to ``out_dir/model``, written atomically
    (:func:`megatrain.state.atomic.atomic_directory`): a kill at any moment leaves the previous model or
    the new one there, complete. Only a directory an earlier run saved is ever replaced.

    Raises:
        UsageError: ``out_dir/model`` holds something megatrain did not write.
        OSError: the file system refused (ENOSPC, permissions); the previous model is intact.
    """
    import torch

    from megatrain.state.atomic import atomic_directory
    from megatrain.state.export import save_pretrained_streamed

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


def save_final_model(model, tokenizer, plan, ranks: Ranks, stop: StopRequest) -> Optional[str]:
    """The end of a run: the model saved to ``out/model`` (:func:`save_model`, on global rank 0) when
    ``log.save_model``; its path, or None when not saved.

    A signal during the export stops it at once (``stop`` is installed and not deferred); once the new
    model is in place a signal is only noted (``stop.deferred``) and the run completes. A signal that
    lands after the atomic swap keeps the new model and the run completes too.

    Raises:
        KeyboardInterrupt: a signal before the swap: the previous model (or none) is in place.
    """
    model_dir = None
    if plan.cfg.log.save_model:
        out_dir = plan.out_dir
        final = os.path.abspath(os.path.join(out_dir, "model"))
        before = _dir_id(final)
        try:
            model_dir = ranks.on_main(lambda: save_model(model, tokenizer, out_dir, plan), others=final)
            stop.deferred = True  # the model is in place: a signal from now on is noted, the run completes
        except KeyboardInterrupt:
            if not (ranks.main and before != _dir_id(final) and is_train_model_dir(final)):
                raise  # before the swap: the previous model (or none) is in place
            model_dir, stop.deferred = final, True  # after the swap: the new model is saved
    return model_dir


def _dir_id(path: str):
    """``(st_dev, st_ino)`` of directory ``path``, None if there is none: an atomic swap changes it."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if os.path.isdir(path) else None
