"""Filling a wrapped engine's host store at wrap (:class:`~.wrapped_engine.WrappedEngine`'s first step
after the engine is built): every unit's fp32 master and compute copy from the model's weights or a
``source``, zero Adam moments, the decoder layers' parameters replaced by meta placeholders."""

from __future__ import annotations

import torch
from torch import nn

from ..engine.units import Unit


def fill_store(eng, units, source) -> None:
    """Initialise the store: master (fp32) and compute copy, from the model's weights or from
    ``source`` (a checkpoint reader or a recorded initialisation; the model is on meta); then
    the layers' parameters become placeholders and the resident ones' CPU storage is freed.
    Data parallel: the ranks' models must agree; local rank 0 fills the node's shared store."""
    writer = eng.dp is None or eng.dp.fills_store
    if eng.dp is not None and source is None:
        eng.dp.check_same_weights(units)
    # The masters of the disk units and of the exclusive device-state units are written through their
    # tier's buffer, one unit at a time; a unit's compute copy is rebuilt from them when it is released
    # (its moments start as zeros).
    fill_window = eng.state_window(True, on_release=lambda u: compute_from_masters(eng, u))
    with torch.no_grad(), fill_window:
        if source is not None and writer:
            source.fill(eng)  # every master
        elif source is not None and hasattr(getattr(source, "index", None), "close"):
            source.index.close()  # a checkpoint reader another rank fills the shared store from
        for u in eng.units:
            if writer:
                _fill_unit(eng, u, source)
            if u.kind == "layer":
                placeholders(eng, u)  # the layer's own parameters are released here
            elif source is None:
                for e in u.entries:
                    if e.param.device.type == "cpu":
                        e.param.data = torch.empty(0, dtype=e.param.dtype)
    if eng.dp is not None:
        eng.dp.barrier("filling the shared host store")


def _fill_unit(eng, u: Unit, source) -> None:
    """Write unit ``u``'s sections from its parameters (no ``source``) and its masters: compute copy,
    zero moments (a disk unit: at release; a frozen entry: its compute copy only)."""
    for i, e in enumerate(u.entries):
        if e.frozen:  # compute copy only (written by the source directly)
            if source is None:
                eng.entry_view(u, i, "compute").copy_(e.param.detach())
            continue
        if source is None:
            eng.entry_view(u, i, "master").copy_(e.param.detach())
        if eng.state_tier(u) is not None:
            continue  # compute copy at release; a fresh tier unit is zeros
        if not u.master_streamed:  # (its compute copy is cast from the master at each load)
            eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))
        eng.entry_view(u, i, "exp_avg").zero_()
        eng.entry_view(u, i, "exp_avg_sq").zero_()


def compute_from_masters(eng, u: Unit) -> None:
    """Rewrite ``u``'s compute copy from its fp32 masters (a disk or exclusive unit held by a writing window)."""
    with torch.no_grad():
        for i, e in enumerate(u.entries):
            if not e.frozen and not u.compute_absent:  # none: cast from the master where it is loaded
                eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))


def placeholders(eng, u: Unit) -> None:
    """Replace layer unit ``u``'s parameters by meta placeholders (same shape, same ``requires_grad``)."""
    for k, e in enumerate(u.entries):
        ph = nn.Parameter(torch.empty(e.shape, dtype=torch.float32, device="meta"),
                          requires_grad=e.param.requires_grad)
        e.param = ph
        for mod, attr in e.owners:
            mod._parameters[attr] = ph
        eng.register_param(ph, u, k)
