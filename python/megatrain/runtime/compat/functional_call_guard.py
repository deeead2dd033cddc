"""``torch.func.functional_call`` refuses to replace a parameter or buffer of a wrapped model's decoder
layers, and ``torch.nn.utils.parametrize.register_parametrization`` to parametrize one of their modules
(installed at the first ``megatrain.wrap``, :mod:`.torch_patches`).

functional_call (also ``torch.nn.utils.stateless.functional_call`` and any other swap through
``torch.nn.utils._named_member_accessor``) puts the given tensors into the modules' ``_parameters`` /
``_buffers`` for the call and the old ones back after it. A streamed decoder layer binds views of its
device slot over its parameters when it runs and its placeholders after: a tensor swapped in for
one was ignored and the layer ran on the stored weights, silently (a buffer swapped in would be used
by the forward but not by the layer's re-run in backward, after the call). The wrappers below raise
before that tensor is swapped (torch swaps back the ones it already swapped); every other swap is
torch's own. The resident unit's parameters (embedding, final norm, LM head) are real tensors used
as they are: replacing them gives torch's result, so they pass. megatrain's own swaps over a
layer's modules (slot views, in a layer's backward) run inside :func:`streamed_swap`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch.nn.utils._named_member_accessor as _accessor
import torch.nn.utils.parametrize as _parametrize
from torch import nn


_torch_swap_tensor = _accessor.swap_tensor
_torch_set_tensor = _accessor.set_tensor
_torch_register_parametrization = _parametrize.register_parametrization
_streamed: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module of a streamed layer -> its name
_local = threading.local()  # _local.allowed: inside streamed_swap()

_MSG = ("megatrain: torch.func.functional_call cannot replace {name}: a decoder layer of a model wrapped by "
        "megatrain.wrap runs on the weights megatrain streams into it (and runs again in backward, after the call), "
        "so the tensor given would be ignored; replace only resident parameters (embedding, final norm, LM head), "
        "or use functional transforms on the unwrapped model")


_PARAMETRIZE_MSG = ("megatrain: torch.nn.utils.parametrize cannot parametrize {name}: a decoder layer of a model wrapped "
                    "by megatrain.wrap runs on weights bound at each call (and runs again in backward), so the "
                    "parametrization would not apply to the weights that train; parametrize only the embedding, final "
                    "norm or LM head, and before wrap")


def note_streamed_layer(layer: nn.Module, name: str) -> None:
    """Record the modules of streamed decoder layer ``layer``, named ``name`` in the wrapped model."""
    for sub_name, sub in layer.named_modules(prefix=name):
        _streamed[sub] = sub_name


@contextlib.contextmanager
def streamed_swap():
    """Within it, megatrain's own swaps of a streamed layer's tensors (views of its slot) pass."""
    _local.allowed = True
    try:
        yield
    finally:
        _local.allowed = False


def _layer_name(module):
    """The name of ``module`` in its wrapped model when it belongs to a streamed decoder layer, else None."""
    return _streamed.get(module) if isinstance(module, nn.Module) else None


def _check(module, name: str, tensor) -> None:
    prefix = _layer_name(module)
    if prefix is None or getattr(_local, "allowed", False):
        return
    for d in (module._parameters, module._buffers):
        if name in d and d[name] is not tensor:
            raise RuntimeError(_MSG.format(name=f"{prefix}.{name}"))


@functools.wraps(_torch_swap_tensor, assigned=("__name__", "__qualname__"), updated=())
def swap_tensor(module, name, tensor, allow_missing=False):
    """torch's ``swap_tensor``; refuses a parameter or buffer of a wrapped model's decoder layer.

    Raises:
        RuntimeError: ``tensor`` would replace a parameter or buffer of a streamed decoder layer
            (before anything is swapped). Otherwise torch's own.
    """
    _check(module, name, tensor)
    return _torch_swap_tensor(module, name, tensor, allow_missing=allow_missing)


@functools.wraps(_torch_set_tensor, assigned=("__name__", "__qualname__"), updated=())
def set_tensor(module, name, tensor):
    """torch's ``set_tensor``; refuses a parameter or buffer of a wrapped model's decoder layer.

    Raises:
        RuntimeError: as :func:`swap_tensor`.
    """
    _check(module, name, tensor)
    return _torch_set_tensor(module, name, tensor)


def install_functional_call_guard() -> None:
    """Route ``torch.nn.utils._named_member_accessor``'s ``swap_tensor`` / ``set_tensor`` (what
    ``NamedMemberAccessor``, and so ``functional_call``, calls) through the wrappers above (idempotent)."""
    if _accessor.swap_tensor is _torch_swap_tensor:
        _accessor.swap_tensor = swap_tensor
    if _accessor.set_tensor is _torch_set_tensor:
        _accessor.set_tensor = set_tensor


@functools.wraps(_torch_register_parametrization, assigned=("__name__", "__qualname__"), updated=())
def register_parametrization(module, tensor_name, *args, **kwargs):
    """torch's ``register_parametrization``; refuses a module of a wrapped model's decoder layer.

    Raises:
        RuntimeError: ``module`` belongs to a streamed decoder layer (before anything is changed).
            Otherwise torch's own.
    """
    prefix = _layer_name(module)
    if prefix is not None:
        raise RuntimeError(_PARAMETRIZE_MSG.format(name=f"{prefix}.{tensor_name}"))
    return _torch_register_parametrization(module, tensor_name, *args, **kwargs)


def install_parametrize_guard() -> None:
    """Route ``torch.nn.utils.parametrize.register_parametrization`` (also what ``torch.nn.utils.parametrizations``'
    ``weight_norm`` / ``orthogonal`` / ``spectral_norm`` call) through the wrapper above (idempotent)."""
    if _parametrize.register_parametrization is _torch_register_parametrization:
        _parametrize.register_parametrization = register_parametrization
