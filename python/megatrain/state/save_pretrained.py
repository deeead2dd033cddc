"""``save_pretrained`` of a wrapped model: transformers' own, with safetensors shards streamed from the masters."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

from ..runtime.engine.state_access import StateAccess
from ..runtime.model.model_config import cache_flags, set_cache_flags
from .safetensors_file import write_safetensors


def stream_safetensors(tensors: dict, filename: str, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file`` that writes each tensor's bytes straight from its memory.

    Args:
        tensors: ``{name: tensor}``; CPU contiguous tensors are written without a copy, others are
            moved / made contiguous one at a time.
        filename: destination file (overwritten).
        metadata: string-to-string ``__metadata__``.

    Raises:
        ValueError: a dtype safetensors has no code for here (the caller falls back to safetensors).
    """
    # safetensors' own order: larger elements first (every tensor stays aligned), then by name
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    write_safetensors(filename, [(k, tensors[k]) for k in names], metadata, sync=False, hashing=False)


@contextlib.contextmanager
def _streamed_shards():
    """Within: transformers' ``save_pretrained`` writes safetensors shards with :func:`stream_safetensors`."""
    import transformers.modeling_utils as mu

    orig = getattr(mu, "safe_save_file", None)
    if orig is None:
        yield
        return

    def save(tensors, filename, metadata=None):
        try:
            stream_safetensors(tensors, filename, metadata)
        except ValueError:
            orig(tensors, filename, metadata=metadata)

    mu.safe_save_file = save
    try:
        yield
    finally:
        mu.safe_save_file = orig


def _save_pretrained(self, save_directory, *args, **kwargs):
    """transformers' ``save_pretrained`` over the fp32 master weights (see the module docstring)."""
    access = StateAccess(self.megatrain)
    access.sync_before_read()
    cfg = getattr(self, "config", None)
    training_flags = cache_flags(cfg)
    # wrap() switched use_cache off (nested configs too) for training; a saved model keeps the user's flags
    set_cache_flags(cfg, access.user_cache_flags if access.user_cache_flags is not None else {path: True for path in training_flags})
    try:
        with _streamed_shards():
            out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    finally:
        set_cache_flags(cfg, training_flags)
    path = os.path.join(str(save_directory), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            c = json.load(f)
        for k in ("dtype", "torch_dtype"):
            if k in c:
                c[k] = "float32"  # the masters' dtype (model.dtype is the compute copy's)
        with open(path, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")
    return out

