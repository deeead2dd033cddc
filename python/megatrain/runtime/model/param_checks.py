"""The parameter checks a wrapped model runs at each forward and ``load_state_dict``: a parameter written
in place, given new storage or replaced since ``wrap``, or unfrozen (:class:`~.wrapped_engine.WrappedEngine`'s
``note_resident_params`` / ``check_resident_params`` / ``check_frozen``)."""

from __future__ import annotations

import torch
from torch import nn


def record_params(units, resident) -> list:
    """``(entry, id(param), param._version, data_ptr or None)`` for every entry of ``units``: the version
    counters (bumped only by in-place writes through them) of the resident parameters and of the
    decoder layers' placeholder parameters, and the storage of the ``resident`` unit's ones."""
    return [(e, id(e.param), e.param._version, e.param.data_ptr() if u is resident else None)
            for u in units for e in u.entries]


def check_params(recorded: list, where: str, overwritten=(), compute_dtype=torch.float32) -> None:
    """Raise if a parameter was written in place since ``recorded`` (:func:`record_params`): a resident one
    (embedding, final norm, LM head) or a decoder layer's placeholder (``torch.nn.init.zeros_(layer.weight)``,
    ``p.copy_``), or a resident one was given new storage (``p.data = tensor``), or a module's parameter was
    replaced by another tensor (``module.weight = nn.Parameter(...)``).

    A resident parameter's write changes only the compute copy it views on the device, a
    placeholder's (a meta tensor) changes nothing: the fp32 master in the host store (what the
    optimizer updates, checkpoints and ``state_dict()`` read) keeps its value, so the change
    would be lost or kept by half. ``overwritten``: names a ``model.load_state_dict`` is about to
    write (those may have changed). ``where``: named in the message (``"the forward"``, ...).
    ``compute_dtype``: the engine's; a frozen entry (no fp32 master) in a bf16 compute copy can be set
    through ``load_state_dict`` only (its ``state_dict()`` tensor is an fp32 copy), and the message says so.

    Raises:
        RuntimeError: one line naming up to three parameters, ``where``, and how to set weights instead.
    """
    # An assignment puts an nn.Parameter there (torch refuses a plain tensor); torch.func.functional_call's
    # temporary tensors (resident ones pass: functional_call_guard) are not Parameters.
    swapped = [e.name for e, _, _, _ in recorded for mod, attr in e.owners
               if isinstance(mod._parameters.get(attr), nn.Parameter) and mod._parameters[attr] is not e.param]
    if swapped:  # the wrapped model trains, streams and saves its own parameter objects
        raise RuntimeError(
            f"megatrain: {', '.join(swapped[:3])}{' ...' if len(swapped) > 3 else ''} was replaced by another tensor "
            f"after megatrain.wrap (seen at {where}); the wrapped model streams, trains and saves the parameters it "
            "was wrapped with, so the new one would be ignored or used by half. Set weights with "
            "model.load_state_dict(...) or model.state_dict()[name].copy_(...), or replace the parameter before "
            "megatrain.wrap")
    replaced = [e.name for e, pid, _, ptr in recorded
                if id(e.param) == pid and ptr is not None and e.param.data_ptr() != ptr]
    if replaced:  # `param.data = tensor`: the parameter no longer views the compute copy
        raise RuntimeError(
            f"megatrain: {', '.join(replaced[:3])}{' ...' if len(replaced) > 3 else ''} was given new storage "
            f"(`param.data = ...`) after megatrain.wrap (seen at {where}); the optimizer's updates would never reach "
            "it and state_dict() would not show it. Set weights with model.load_state_dict(...) or "
            "model.state_dict()[name].copy_(...) (both write the fp32 masters), or before megatrain.wrap")
    changed = [e.name for e, pid, v, _ in recorded if id(e.param) == pid and e.param._version != v]
    if changed and all(n in overwritten for n in changed):  # model.load_state_dict replaces them all
        return
    frozen = [e.name for e, pid, v, _ in recorded if id(e.param) == pid and e.param._version != v and e.frozen]
    if frozen and compute_dtype != torch.float32:  # no master: state_dict()[name] is a copy a write does not reach
        dt = str(compute_dtype).replace("torch.", "")
        raise RuntimeError(
            f"megatrain: {', '.join(frozen[:3])}{' ...' if len(frozen) > 3 else ''} was modified in place after "
            f"megatrain.wrap (seen at {where}), but it is frozen (requires_grad=False at megatrain.wrap): the host "
            f"store holds only its {dt} compute copy (no fp32 master), which did not change, and its "
            "model.state_dict() tensor is an fp32 copy that an in-place write does not reach. Set it with "
            f"model.load_state_dict(...) (it converts the value to {dt}), or change it before megatrain.wrap")
    if changed:
        raise RuntimeError(
            f"megatrain: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} was modified in place after "
            f"megatrain.wrap (seen at {where}); the fp32 master weights in the host store did not change (a decoder "
            "layer's parameter is a placeholder, a resident one views only the compute copy). Set weights with "
            "model.load_state_dict(...) or through model.state_dict()[name].copy_(...) (both write the masters), "
            "or change them before megatrain.wrap")


def refuse_unfrozen(units) -> None:
    """Raise if a parameter of ``units`` frozen at wrap time was unfrozen (it has no fp32 state to train).

    Raises:
        RuntimeError: names the parameter and says to set ``requires_grad`` before wrap.
    """
    for u in units:
        for e in u.entries:
            if e.frozen and e.param.requires_grad:
                raise RuntimeError(
                    f"megatrain: parameter {e.name} was frozen (requires_grad=False) when the model was wrapped, so "
                    "the host store holds only its compute copy (no master weights or Adam moments); it cannot "
                    "be unfrozen now. Set requires_grad before megatrain.wrap / from_pretrained")
