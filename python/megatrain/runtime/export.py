"""Export a wrapped model's fp32 master weights as a standard Hugging Face model directory."""

from __future__ import annotations

import torch
from torch import nn


def master_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict:
    """Return ``{name: tensor}`` for every parameter of a wrapped model, from the host store.

    Tensors are CPU copies in ``dtype`` (fp32: the master weights themselves, not the compute
    copy). Tied parameters appear under every name that holds them (as ``model.state_dict()``
    does); Hugging Face's ``save_pretrained`` drops the tied duplicates.

    Raises:
        ValueError: if ``model`` was not wrapped by ``megatrain.wrap``.
    """
    eng = getattr(model, "megatrain", None)
    if eng is None:
        raise ValueError("megatrain.export_pretrained: the model is not wrapped by megatrain.wrap")
    eng.flush()
    by_id = {}
    for u in eng.units:
        for i, e in enumerate(u.entries):
            by_id[id(e.param)] = (u, i)
    sd = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        u, i = by_id[id(p)]
        sd[name] = eng.entry_view(u, i, "master").to(dtype=dtype, copy=True)
    for mname, mod in model.named_modules():  # persistent buffers only, as model.state_dict()
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                sd[f"{mname}.{bname}" if mname else bname] = b.detach().to("cpu", copy=True)
    return sd


def export_pretrained(model: nn.Module, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write ``config.json`` + safetensors weights that ``AutoModelForCausalLM.from_pretrained`` loads.

    Weights come from the fp32 master copies, streamed from the host store tensor by tensor
    (extra host memory: one tensor for bf16, none for fp32). The directory is written under a
    temporary name next to ``out_dir`` and swapped into place atomically
    (:func:`megatrain.atomic.atomic_directory`), so a crash leaves the old or the new model there.

    Args:
        model: a model wrapped by ``megatrain.wrap`` (a ``transformers.PreTrainedModel``).
        out_dir: destination directory: new, empty, or an earlier megatrain export (only
            ``config.json``, ``generation_config.json`` and megatrain-marked ``model.safetensors``),
            which is replaced. Any other model directory is refused (nothing is deleted).
        dtype: dtype of the saved weights (``torch.float32`` or ``torch.bfloat16``).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: the model is not wrapped, ``dtype`` is neither fp32 nor bf16, or ``out_dir``
            is a file or a non-empty directory that is not its own earlier export (it would be deleted).
    """
    from ..atomic import atomic_directory, check_replaceable
    from ..checkpoint import is_megatrain_export, save_pretrained_streamed

    if getattr(model, "megatrain", None) is None:
        raise ValueError("megatrain.export_pretrained: the model is not wrapped by megatrain.wrap")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"megatrain.export_pretrained: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    expected = ("an earlier megatrain.export_pretrained output (config.json, generation_config.json, "
                "model.safetensors marked by megatrain, nothing else)")
    out_dir = check_replaceable(out_dir, "megatrain.export_pretrained", is_megatrain_export, expected)
    with atomic_directory(out_dir, "megatrain.export_pretrained", is_megatrain_export, expected) as tmp:
        save_pretrained_streamed(model, tmp, dtype=dtype)
    return out_dir
