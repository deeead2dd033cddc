"""Sequence tiling of a decoder layer's per-token modules (its MLP and norms): the class swap.

A tiled module's class is ``Tiled<cls>`` (:func:`tiled_class`): its ``forward`` asks the plan the
module carries (``_megatrain_long``, a :class:`~.long_context.LongContext`) for a tile size and runs
the rows of its input tile by tile through :class:`~.long_context_ops._TiledMLPFunction` (exact:
the module is per token). Which modules qualify: :func:`mlp_of`, :func:`norms_of`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .lean_ops import lean_forward
from .long_context_ops import _local, _TiledMLPFunction


class _TiledMixin:
    """Forward of a decoder layer's MLP, tiled over the rows of its input when the plan says so."""

    def forward(self, x, *args, **kwargs):
        plan = getattr(self, "_megatrain_long", None)
        if (plan is None or getattr(_local, "bypass", False) or args or kwargs or not isinstance(x, torch.Tensor)
                or x.dim() < 2):
            return self._megatrain_untiled_forward(x, *args, **kwargs)
        rows = plan.tile_rows(self, x)
        if rows is None:
            # (a forward bound on the instance, Liger's kernel, is lean already and runs as it is)
            if plan.lean and self._megatrain_lean is not None and torch.is_grad_enabled() and "forward" not in vars(self):
                return lean_forward(self, x)  # (an autograd Function: no graph when nothing requires grad)
            return self._megatrain_untiled_forward(x)
        named = list(self.named_parameters())
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for _, p in named))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if grad:
            out = _TiledMLPFunction.apply(self, [n for n, _ in named], rows, x2, *[p for _, p in named])
        else:
            out = _TiledMLPFunction.forward(_NoCtx(), self, None, rows, x2)
        return out.reshape(shape[:-1] + out.shape[1:])


class _NoCtx:
    def save_for_backward(self, *a):
        pass


class _TiledForward:
    """``forward`` of a tiled module's class: a data descriptor, so it takes precedence over a
    ``forward`` bound on the instance (Liger-Kernel binds its kernels' forward into the module's
    ``__dict__``, before ``wrap`` or, through ``Trainer(use_liger_kernel=True)``, after it); that
    instance forward is then the untiled one (:func:`_untiled_forward`), and tiling stays in force."""

    def __get__(self, obj, cls=None):
        return _TiledMixin.forward if obj is None else _TiledMixin.forward.__get__(obj, cls)

    def __set__(self, obj, value):
        obj.__dict__["forward"] = value

    def __delete__(self, obj):
        obj.__dict__.pop("forward", None)


def _untiled_forward(orig):
    def untiled(self, *args, **kwargs):
        bound = self.__dict__.get("forward")
        return bound(*args, **kwargs) if bound is not None else orig(self, *args, **kwargs)
    return untiled


_TILED_CLASSES: dict = {}


def tiled_class(cls: type) -> type:
    """``Tiled<cls>``: ``forward`` the tiling (:class:`_TiledForward`), ``_megatrain_untiled_forward`` the
    instance's own forward (one bound on the instance, else ``cls.forward``). One class per ``cls``."""
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (_TiledMixin, cls),
                                   {"forward": _TiledForward(), "_megatrain_untiled_forward": _untiled_forward(cls.forward)})
    return _TILED_CLASSES[cls]


def mlp_of(layer: nn.Module) -> Optional[nn.Module]:
    """The per-token MLP of a decoder layer (``layer.mlp``), or None (absent, or a mixture of experts)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module) or not any(True for _ in mlp.parameters()):
        return None
    if hasattr(mlp, "experts") or hasattr(mlp, "router") or any(isinstance(m, nn.ModuleList) for m in mlp.modules()):
        return None  # MoE: routing statistics / auxiliary losses are captured per call
    return mlp


def norms_of(layer: nn.Module) -> list:
    """The per-token norms among a decoder layer's direct children (``nn.LayerNorm`` and the models'
    own ``*RMSNorm`` / ``*LayerNorm`` classes, e.g. Llama's ``input_layernorm`` and
    ``post_attention_layernorm``), each with parameters."""
    return [m for _, m in layer.named_children()
            if (isinstance(m, nn.LayerNorm) or type(m).__name__.endswith(("RMSNorm", "LayerNorm")))
            and any(True for _ in m.parameters())]


def has_active_dropout(mod: nn.Module) -> bool:
    """Whether ``mod`` or a submodule applies dropout now (training, p > 0): tiling would change its random masks."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in mod.modules())
