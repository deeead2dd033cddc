"""``torch.autograd.grad`` / ``torch.autograd.backward`` refuse a wrapped model's decoder-layer
placeholders (installed at the first ``megatrain.wrap``, :mod:`.torch_patches`).

A streamed layer's parameters are meta-device placeholders that never enter the autograd graph:
megatrain computes their gradients inside its own autograd Function, on leaf views of a device
slot, and sends them to the host store. Named as ``inputs``, torch's ``grad`` returned ``None`` for
every one of them with ``allow_unused=True`` (zeros on the meta device with
``materialize_grads=True``), raised "One of the differentiated Tensors appears to not have been
used in the graph" without it, and ``backward(inputs=...)`` / ``loss.backward(inputs=...)`` computed
no gradient for them and said nothing. The wrappers below raise before torch does anything; every
other call goes to torch's own function unchanged (megatrain's own ``torch.autograd.grad`` calls
name leaf views of the slots, never placeholders). The resident unit's parameters (embedding, final
norm, LM head) are real device tensors in the graph: torch gives their gradients as on the plain
model, so they pass.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch.autograd.graph import GradientEdge

from ..engine.core import locate


_torch_grad = torch.autograd.grad
_torch_backward = torch.autograd.backward

_MSG = ("megatrain: torch.autograd.{call}() cannot differentiate with respect to {name}: a decoder-layer parameter "
        "of a model wrapped by megatrain.wrap is a meta placeholder outside the autograd graph (its gradient is "
        "computed inside megatrain's backward, sent to host memory and never materialised on the device); train "
        "with loss.backward() then megatrain.optim.CPUAdamW.step(), and take gradient norms from "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or CPUAdamW(max_grad_norm=...).last_grad_norm")


def _placeholder_name(t) -> str | None:
    """The name of the wrapped model's layer parameter ``t`` (a tensor or a ``GradientEdge``), or None
    for anything else (a resident parameter, an activation, any tensor of an unwrapped model)."""
    if isinstance(t, GradientEdge):  # get_gradient_edge(p) of a leaf: its AccumulateGrad node holds p
        t = getattr(t.node, "variable", None)
    ref = locate(t) if t is not None else None
    if ref is None or ref[1].kind == "resident":
        return None
    unit, i = ref[1], ref[2]
    return getattr(unit.entries[i], "name", None) or f"entry {i} of layer {unit.index}"


def _check_inputs(inputs, call: str):
    """Raise if ``inputs`` (as torch takes it: a tensor, a ``GradientEdge``, a dict of them, or an
    iterable) names a placeholder; return it, as a tuple if it was a one-pass iterable (a generator
    such as ``model.parameters()``, which this check would otherwise consume)."""
    if isinstance(inputs, (torch.Tensor, GradientEdge)):
        seq = (inputs,)
    elif type(inputs) is dict:
        seq = inputs.values()
    elif isinstance(inputs, Mapping):  # torch refuses any other mapping: leave it to say so
        return inputs
    else:
        if not isinstance(inputs, (list, tuple)):
            inputs = tuple(inputs)
        seq = inputs
    for t in seq:
        name = _placeholder_name(t)
        if name is not None:
            raise RuntimeError(_MSG.format(call=call, name=name))
    return inputs


@functools.wraps(_torch_grad, assigned=("__name__", "__qualname__"), updated=())
def grad(*args, **kwargs):
    """``torch.autograd.grad``; refuses the placeholders of a wrapped model's decoder layers.

    Raises:
        RuntimeError: ``inputs`` holds a decoder-layer parameter of a model wrapped by
            ``megatrain.wrap`` (before anything is computed). Otherwise torch's own, with the
            same arguments (a generator given as ``inputs`` is passed on as a tuple).
    """
    if len(args) > 1:
        inputs = _check_inputs(args[1], "grad")
        if inputs is not args[1]:
            args = (args[0], inputs) + args[2:]
    elif "inputs" in kwargs:
        kwargs["inputs"] = _check_inputs(kwargs["inputs"], "grad")
    return _torch_grad(*args, **kwargs)


@functools.wraps(_torch_backward, assigned=("__name__", "__qualname__"), updated=())
def backward(*args, **kwargs):
    """``torch.autograd.backward`` (and so ``Tensor.backward``); refuses ``inputs`` naming the
    placeholders of a wrapped model's decoder layers. Without ``inputs`` (``loss.backward()``) it
    calls torch's own at once.

    Raises:
        RuntimeError: ``inputs`` holds a decoder-layer parameter of a model wrapped by
            ``megatrain.wrap`` (before anything is computed).
    """
    if len(args) > 5:
        if args[5] is not None:
            inputs = _check_inputs(args[5], "backward")
            if inputs is not args[5]:
                args = args[:5] + (inputs,) + args[6:]
    elif kwargs.get("inputs") is not None:
        kwargs["inputs"] = _check_inputs(kwargs["inputs"], "backward")
    return _torch_backward(*args, **kwargs)


grad._megatrain = True
backward._megatrain = True


def install_autograd_guard() -> None:
    """Route ``torch.autograd.grad`` / ``torch.autograd.backward`` through :func:`grad` / :func:`backward`
    (idempotent). ``Tensor.backward`` calls ``torch.autograd.backward`` by that name, so it is routed too;
    a reference taken before the first ``wrap`` (``from torch.autograd import grad``) keeps torch's."""
    if torch.autograd.grad is _torch_grad:
        torch.autograd.grad = grad
    if torch.autograd.backward is _torch_backward:
        torch.autograd.backward = backward
