"""The decoder layers of a model and the store units built from its parameters (nothing allocated)."""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from .units import Entry, Unit


class UnsupportedModelError(ValueError):
    """The model has no repeated decoder layer list megatrain can stream."""


def find_decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """Find the repeated decoder layer list: the largest ``ModuleList`` of same-class modules with parameters.

    Returns:
        ``(qualified_name, module_list)``.

    Raises:
        UnsupportedModelError: if there is none (names the model class and what is supported).
    """
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        classes = {type(m) for m in mod}
        if len(classes) != 1:
            continue
        if not any(True for _ in mod[0].parameters()):
            continue
        n = sum(p.numel() for p in mod.parameters())
        if best is None or n > best[2]:
            best = (name, mod, n)
    if best is None:
        raise UnsupportedModelError(
            f"megatrain.wrap: {type(model).__name__} has no repeated decoder layer list (an nn.ModuleList "
            "of same-class layers with parameters, like model.layers in Llama or transformer.h in GPT-2). "
            "Supported: Hugging Face causal LMs whose decoder layers live in one ModuleList "
            "(Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Mixtral, GPT-2, ...).")
    return best[0], best[1]


def _param_owners(root: nn.Module) -> dict:
    """Map id(parameter) -> list of (module, attribute) that hold it, under ``root``."""
    owners: dict = {}
    for mod in root.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    return owners


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


def model_units(model: nn.Module, layers_name: str, layers: nn.ModuleList) -> List[Unit]:
    """The store units of ``model``: one per decoder layer (in order), then the resident unit
    (every other parameter, tied weights once) if there is one. Nothing is allocated or changed;
    a parameter with ``requires_grad=False`` is a frozen entry. The parameters may be on the meta
    device (:func:`megatrain.estimate` plans the store of a model that is never built).

    Raises:
        UnsupportedModelError: a parameter shared between a decoder layer and another module.
    """
    owners = _param_owners(model)
    layer_param_ids = set()
    units: List[Unit] = []
    for li, layer in enumerate(layers):
        entries, rel = [], []
        for name, p in layer.named_parameters():
            layer_param_ids.add(id(p))
            entries.append(Entry(f"{layers_name}.{li}.{name}", tuple(p.shape), p.numel(), 0,
                                 owners[id(p)], p, frozen=not p.requires_grad))
            rel.append((name, tuple(p.shape)))
        template = (type(layer), tuple(rel))
        units.append(Unit(li, "layer", entries, 0, template, module=layer))
    res_entries = []
    for name, p in model.named_parameters():
        if id(p) in layer_param_ids:
            continue
        for mod, _ in owners[id(p)]:
            if any(mod is l or any(mod is s for s in l.modules()) for l in layers):
                raise UnsupportedModelError(
                    f"megatrain.wrap: parameter {name} is shared between a decoder layer and another module; "
                    "megatrain streams each decoder layer on its own and cannot share its weights")
        res_entries.append(Entry(name, tuple(p.shape), p.numel(), 0, owners[id(p)], p, frozen=not p.requires_grad))
    if res_entries:
        units.append(Unit(len(units), "resident", res_entries, 0, ("resident",)))
    return units


