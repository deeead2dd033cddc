"""What ``megatrain.estimate`` reads of a model: the model to plan and the sizes of its config.

:func:`model_to_plan` turns an ``nn.Module``, a ``transformers`` config or a local model directory
into the module whose units are planned (a meta model for a config or a directory: only
``config.json`` and the safetensors headers are read); :class:`~.model_dims.ModelShape` (re-exported here)
holds the config sizes the rough activation and logits estimates use.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .model_dims import ModelShape  # noqa: F401 - public here too

# Weight files of a Hugging Face model directory (any of them: not "config.json alone").
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def has_weight_files(path: str) -> bool:
    """Whether model directory ``path`` holds weight files (:data:`WEIGHT_FILES`); without, it is
    estimated from its ``config.json`` alone (before the weights are downloaded)."""
    import glob

    return any(glob.glob(os.path.join(glob.escape(path), p)) for p in WEIGHT_FILES)


def _meta(meta_model, config, model_kwargs: dict):
    """``meta_model(config, **model_kwargs)``; a keyword the model's constructor refuses (a config field such as
    ``hidden_size``, a typo) raises one line saying where such a change goes."""
    try:
        return meta_model(config, **model_kwargs)
    except TypeError as e:
        if not model_kwargs:
            raise
        names = ", ".join(sorted(model_kwargs))
        raise TypeError(f"megatrain.estimate: the model's constructor refused {names} (extra keywords go to "
                        f"AutoModelForCausalLM.from_config: {e}); to change the config, pass a transformers config "
                        f"with them set (transformers.AutoConfig.from_pretrained(path, {names.split(', ')[0]}=...))") from None


def model_to_plan(model, model_kwargs: dict, transform):
    """``(module, config, in_memory)``: the model to plan (meta for a config / directory), its config, and
    whether its weights are in memory (an ``nn.Module``: their bytes are freed while the store is filled).

    Raises:
        ValueError: an already wrapped module, or ``transform`` with a module.
        TypeError: ``model_kwargs`` with a module (nothing to pass them to: a misspelt option).
        CheckpointError: a path that is not a local directory, without ``config.json``, or whose
            safetensors lack a parameter of the model.
        TypeError: anything else than a module, a config or a path.
    """
    from ...state.loading import CheckpointError, CheckpointIndex, _CheckpointSource, _load_config, meta_model

    if isinstance(model, nn.Module):
        if getattr(model, "megatrain", None) is not None:
            raise ValueError("megatrain.estimate: this model is already wrapped; its store is "
                             "model.megatrain.store.section_bytes (and model.megatrain.placement() says where each layer's state is)")
        if transform is not None:
            raise ValueError("megatrain.estimate: transform= applies to a config or a model directory; transform "
                             "the module before estimating it")
        if model_kwargs:  # they would go to AutoModelForCausalLM.from_config: a module has none, a typo is not ignored
            raise TypeError(f"megatrain.estimate: unexpected keyword argument(s) {', '.join(sorted(model_kwargs))} "
                            "(model keyword arguments apply to a config or a model directory, not an nn.Module)")
        return model, getattr(model, "config", None), True
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise CheckpointError(f"megatrain.estimate: {path} is not a local directory (give a model directory, a "
                                  "transformers config or an nn.Module)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"megatrain.estimate: {path} has no config.json")
        weights = has_weight_files(path)
        index = CheckpointIndex(path) if weights else None  # headers only
        config = _load_config(path)
        meta = _meta(meta_model, config, model_kwargs)
        if index is not None:
            _CheckpointSource(meta, index)  # every parameter present with its shape (headers only)
    else:
        from transformers import PretrainedConfig

        if not isinstance(model, PretrainedConfig):
            raise TypeError(f"megatrain.estimate: expected an nn.Module, a transformers config or a local model "
                            f"directory, got {type(model).__name__}")
        config = model
        meta = _meta(meta_model, config, model_kwargs)
    if transform is not None:
        with torch.device("meta"):
            meta = transform(meta)
    return meta, config, False
