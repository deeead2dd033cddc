"""The decoder layers of a model and the store units built from its parameters (nothing allocated)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import List, Tuple

import torch
from torch import nn

from ..engine.units import Entry, Unit


class UnsupportedModelError(ValueError):
    """The model has no repeated decoder layer list megatrain can stream."""


def _methods(cls: type):
    """The functions of ``cls`` and its bases below ``nn.Module`` (``forward`` first), each once."""
    seen, out = set(), []
    for fn in [getattr(cls, "forward", None)] + [v for k in cls.__mro__ if k not in (nn.Module, object)
                                                 for _, v in sorted(vars(k).items())]:
        code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
        if code is not None and code not in seen:
            seen.add(code)
            out.append(inspect.unwrap(fn))
    return out


def _reads_self(node, attr: str) -> bool:
    return any(isinstance(sub, ast.Attribute) and sub.attr == attr and isinstance(sub.value, ast.Name)
               and sub.value.id == "self" for sub in ast.walk(node))


def _indexed_by_target(loop: ast.For, attr: str) -> bool:
    """Whether the body of ``loop`` indexes ``self.<attr>`` with the loop variable
    (``for i in range(self.n_layers): x = self.attentions[i](x)``, XLM)."""
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for stmt in loop.body:
        for sub in ast.walk(stmt):
            if (isinstance(sub, ast.Subscript) and _reads_self(sub.value, attr) and isinstance(sub.value, ast.Attribute)
                    and any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(sub.slice))):
                return True
    return False


def _uses(cls: type, attr: str) -> tuple:
    """How the methods of ``cls`` use ``self.<attr>``: ``(looped, handed_to_function)``: a ``for`` loop or
    comprehension iterates over it (``for layer in self.layers[:n]``, ``enumerate(self.h)``) or a ``for``
    loop's body indexes it with the loop variable (``self.attentions[i]``); it is an
    argument of a ``<Function>.apply(...)`` call (an autograd Function that runs the layers itself)."""
    looped = handed = False
    for fn in _methods(cls):
        if attr not in fn.__code__.co_names:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.For, ast.comprehension)) and _reads_self(node.iter, attr):
                looped = True
            if isinstance(node, ast.For) and _indexed_by_target(node, attr):
                looped = True
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "apply"
                    and any(_reads_self(a, attr) for a in node.args)):
                handed = True
    return looped, handed


def _decoder_of(model: nn.Module):
    """``model.get_decoder()`` (transformers: the text decoder of a causal or multimodal LM) when it is a
    module under ``model``, else None."""
    get = getattr(model, "get_decoder", None)
    try:
        dec = get() if callable(get) else None
    except Exception:  # noqa: BLE001 - not every model implements it
        return None
    return dec if isinstance(dec, nn.Module) and any(dec is m for m in model.modules()) else None


def find_decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """Find the decoder layer list: the ``nn.ModuleList`` that the model's forward runs the hidden states through.

    Chosen by role, not by size or by class: the candidates are the ``ModuleList`` s (with
    parameters in their entries) that a method of the module holding them iterates over (a ``for``
    loop or comprehension over ``self.<name>`` in its source: ``for layer in self.layers[:n]``,
    ``enumerate(self.h)``, or a loop body indexing it with the loop variable:
    ``for i in range(n): self.ffns[i](x)``); an adapter list indexed by a layer number
    (``self.adapters[layer_idx]``, Zamba 2) or a list only called by index is not one. Among
    those, the ones under ``model.get_decoder()`` when transformers names a decoder (a multimodal
    model's text decoder, not its vision encoder), and of these the list with the most
    parameters. The entries may be of different classes (hybrid models: attention and
    state-space layers); each structure (class + own parameters' names, shapes and dtypes) gets
    its own slot pool (see :func:`model_units`). When no module's source can be read
    (a model built by ``exec``), the largest list of same-class entries is taken instead.

    Returns:
        ``(qualified_name, module_list)``.

    Raises:
        UnsupportedModelError: no such list (names the model class and what is supported), or a
            layer list is an argument of an autograd ``Function.apply`` or its layers have a
            ``backward_pass`` (reversible layers that run their own backward, e.g. Reformer).
    """
    candidates, sourceless = [], []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        if not any(True for m in mod for _ in m.parameters()):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if name else model
        n = sum(p.numel() for p in mod.parameters())
        try:
            inspect.getsource(type(parent))
        except (OSError, TypeError):
            if len({type(m) for m in mod}) == 1:
                sourceless.append((n, name, mod))
            continue
        looped, handed = _uses(type(parent), attr)
        if handed or any(callable(getattr(type(m), "backward_pass", None)) for m in mod):
            raise UnsupportedModelError(
                f"megatrain.wrap: {type(model).__name__}'s layer list {name} ({type(mod[0]).__name__}) runs its own "
                "backward (reversible layers that recompute their inputs from their outputs in an autograd "
                "Function), which streamed layers cannot host; train this model without megatrain")
        if looped:
            candidates.append((n, name, mod))
    decoder = _decoder_of(model)
    if decoder is not None:  # a multimodal model's text decoder, not its vision encoder
        inside = {id(m) for m in decoder.modules()}
        candidates = [c for c in candidates if id(c[2]) in inside] or candidates
    chosen = max(candidates, key=lambda c: c[0]) if candidates else (
        max(sourceless, key=lambda c: c[0]) if sourceless else None)
    if chosen is None:
        raise UnsupportedModelError(
            f"megatrain.wrap: {type(model).__name__} has no repeated decoder layer list (an nn.ModuleList of "
            "layers with parameters that the model's forward loops over, like model.layers in Llama or "
            "transformer.h in GPT-2). Supported: Hugging Face causal LMs whose decoder layers live in one "
            "ModuleList (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Mixtral, GPT-2, Gemma 3, Jamba, ...).")
    return chosen[1], chosen[2]


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

    A parameter that several decoder layers hold (a block shared by them, as Zamba's shared
    transformer) is resident: loaded once per step, used in place by each of those layers, its
    gradient the sum of theirs; ``Unit.shared`` of such a layer lists its resident entry indices.
    A layer unit's ``template`` (its slot pool) is its structure: class + its own parameters'
    names, shapes and dtypes.

    Raises:
        UnsupportedModelError: a parameter shared between a decoder layer and a module outside
            the decoder layers.
    """
    owners = _param_owners(model)
    holders: dict = {}  # id(parameter) -> the decoder layers that hold it
    for li, layer in enumerate(layers):
        for p in layer.parameters():
            holders.setdefault(id(p), []).append(li)
    shared_ids = {pid for pid, held in holders.items() if len(held) > 1}
    units: List[Unit] = []
    for li, layer in enumerate(layers):
        entries, structure = [], []
        for name, p in layer.named_parameters():
            if id(p) in shared_ids:
                continue
            entries.append(Entry(f"{layers_name}.{li}.{name}", tuple(p.shape), p.numel(), 0,
                                 owners[id(p)], p, frozen=not p.requires_grad))
            structure.append((name, tuple(p.shape), p.dtype))
        units.append(Unit(li, "layer", entries, 0, (type(layer), tuple(structure)), module=layer))
    res_entries = []
    for name, p in model.named_parameters():
        if id(p) in holders and id(p) not in shared_ids:
            continue
        if id(p) not in shared_ids:
            for mod, _ in owners[id(p)]:
                if any(mod is l or any(mod is s for s in l.modules()) for l in layers):
                    raise UnsupportedModelError(
                        f"megatrain.wrap: parameter {name} is shared between a decoder layer and another module; "
                        "megatrain streams each decoder layer on its own and cannot share its weights")
        else:
            for li in holders[id(p)]:
                units[li].shared.append(len(res_entries))
        res_entries.append(Entry(name, tuple(p.shape), p.numel(), 0, owners[id(p)], p, frozen=not p.requires_grad))
    if res_entries:
        units.append(Unit(len(units), "resident", res_entries, 0, ("resident",)))
    return units
