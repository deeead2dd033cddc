"""``torch.nn.utils.clip_grad_norm_`` made exact for a wrapped model's parameters (installed at the first ``megatrain.wrap``)."""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Optional

import torch

from ..engine.core import locate
from ..engine.state_access import grads_pending

# engines already warned that clip_grad_norm_(inf) cannot give a norm (once per wrapped model)
_WARNED_NORM_UNKNOWN: "weakref.WeakSet" = weakref.WeakSet()
# engines already warned that clip_grad_norm_'s max_norm exceeds CPUAdamW's max_grad_norm (once per wrapped model)
_WARNED_TWO_LIMITS: "weakref.WeakSet" = weakref.WeakSet()


def nan_norm_expected(engine) -> None:
    """No warning when ``clip_grad_norm_(max_norm=inf)`` returns nan for ``engine``'s model: its caller knows the
    norm is not computed (a Trainer that does not clip asks for one only to log it; MegatrainCallback drops it)."""
    _WARNED_NORM_UNKNOWN.add(engine)


_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_
_torch_clip_grad_value_ = torch.nn.utils.clip_grad_value_


def _engine_of(params: list):
    refs = [locate(p) for p in params]
    got = [r for r in refs if r is not None]
    if not got:
        return None
    if len(got) != len(refs):
        raise ValueError("megatrain: clip_grad_norm_ got parameters of a model wrapped by megatrain.wrap mixed with "
                         "other tensors; clip them in separate calls (or give max_grad_norm to CPUAdamW)")
    eng = got[0][0]
    if any(r[0] is not eng for r in got):
        raise ValueError("megatrain: clip_grad_norm_ got parameters of two different wrapped models")
    return eng


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, exact for the parameters of a wrapped model.

    Installed in place of torch's function at the first ``megatrain.wrap``; for anything but a
    wrapped model's parameters it calls torch's own. For those it returns the total L2 norm of
    their gradients (computed from the engine's per-parameter squared norms: a float32 CPU
    scalar tensor, the same value torch would return on the unwrapped model) and records the
    clip coefficient ``min(max_norm / (total + 1e-6), 1)``, which the next ``CPUAdamW.step()``
    applies inside its fused update (then ``max_grad_norm`` clips the clipped gradient again,
    exactly as torch would if both were applied; a ``max_grad_norm`` >= ``max_norm`` changes nothing; a smaller
    one clips further, with a warning, once per model).
    That step's ``CPUAdamW.last_grad_norm`` is the first call's return value: the norm before any clipping.

    Args:
        parameters: the wrapped model's parameters (an iterable or a single tensor); every
            parameter holding a gradient must be in it (the coefficient is one per step).
        max_norm: as torch. norm_type: 2 only. error_if_nonfinite, foreach: as torch (foreach: no effect).

    Raises:
        RuntimeError: CPUAdamW was created without ``max_grad_norm`` and a gradient has arrived:
            its updates start during backward, so no clip can apply to them (set
            ``CPUAdamW(max_grad_norm=...)``; ``max_norm=inf``, which clips nothing, returns nan
            with a warning instead); the total norm is not finite and ``error_if_nonfinite``.
        ValueError: ``norm_type`` is not 2; a parameter holding a gradient is missing from ``parameters``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    eng = _engine_of(params)
    if eng is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                      foreach=foreach)
    opt = eng.optimizer
    if float(norm_type) != 2.0:
        raise ValueError(f"megatrain: clip_grad_norm_ on a wrapped model supports norm_type=2 only, got {norm_type!r}")
    if opt is None:
        return torch.tensor(0.0)
    if any(u.eager_queued for u in eng.units) or (opt.max_grad_norm is None and grads_pending(eng)):
        if math.isinf(float(max_norm)) and float(max_norm) > 0:
            # Nothing to clip (the Trainer asks this way for a norm to log): the updates stand as they
            # are; the norm itself was never computed.
            if eng not in _WARNED_NORM_UNKNOWN:
                _WARNED_NORM_UNKNOWN.add(eng)
                warnings.warn("megatrain: clip_grad_norm_(max_norm=inf) returns nan on this wrapped model: without "
                              "CPUAdamW(max_grad_norm=...) the updates start during backward and no global norm is "
                              "computed; pass max_grad_norm=float('inf') to CPUAdamW to get it", UserWarning,
                              stacklevel=2)
            return torch.tensor(float("nan"))
        raise RuntimeError(
            "megatrain: clip_grad_norm_ on a wrapped model needs CPUAdamW(..., max_grad_norm=...): without it each "
            "layer's update starts during backward, before this clip. Pass max_grad_norm to CPUAdamW (the same "
            "value clips exactly like clip_grad_norm_; then this call returns the true norm and changes nothing more), "
            "or float('inf') to clip only here")
    eng.wait_grads()
    given = {id(p) for p in params}
    sq = 0.0
    for u in eng.units:
        has_grad, grad_sq = u.has_grad, u.grad_sq
        for i, e in enumerate(u.entries):
            if has_grad[i]:
                if id(e.param) not in given:
                    raise ValueError(f"megatrain: clip_grad_norm_ on a wrapped model needs every parameter that holds a "
                                     f"gradient; {e.name} has one and is not in the list (pass model.parameters())")
                sq += grad_sq[i]
    total = math.sqrt(sq) * opt.user_clip_scale
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    limit = opt.max_grad_norm
    if (limit is not None and float(limit) < float(max_norm) and math.isfinite(float(max_norm))
            and eng not in _WARNED_TWO_LIMITS):
        _WARNED_TWO_LIMITS.add(eng)
        warnings.warn(f"megatrain: clip_grad_norm_(max_norm={float(max_norm):g}) on a model whose CPUAdamW clips at "
                      f"max_grad_norm={float(limit):g}: both apply, so the gradients are clipped to {float(limit):g}, "
                      "not to max_norm as with torch.optim.AdamW; give CPUAdamW the same max_grad_norm", UserWarning,
                      stacklevel=2)
    total_t = torch.tensor(total, dtype=torch.float32)
    coef = float(torch.clamp(float(max_norm) / (total_t + 1e-6), max=1.0))
    opt.user_clip_scale *= coef
    return total_t


def clip_grad_value_(parameters, clip_value: float, foreach: Optional[bool] = None) -> None:
    """``torch.nn.utils.clip_grad_value_``; refused for a wrapped model's parameters (installed in place
    of torch's function at the first ``megatrain.wrap``; anything else goes to torch's own).

    A wrapped model's gradients live in the host store and its layers' ``p.grad`` is never set, so an
    elementwise clip has nothing to act on (torch failed with an internal error on the placeholders).

    Raises:
        NotImplementedError: a parameter of a model wrapped by ``megatrain.wrap`` is among ``parameters``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(locate(p) is not None for p in params):
        raise NotImplementedError(
            "megatrain: torch.nn.utils.clip_grad_value_ cannot clip a wrapped model's gradients (they live in the "
            "host store, p.grad is never set); clip by the global norm instead: CPUAdamW(max_grad_norm=...) or "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)")
    return _torch_clip_grad_value_(params, clip_value, foreach=foreach)


def install_clip_grad_norm() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` through :func:`clip_grad_norm_` /
    :func:`clip_grad_value_` (idempotent)."""
    import torch.nn.utils.clip_grad as cg

    for mod in (torch.nn.utils, cg):
        if getattr(mod, "clip_grad_norm_", None) is _torch_clip_grad_norm_:
            mod.clip_grad_norm_ = clip_grad_norm_
        if getattr(mod, "clip_grad_value_", None) is _torch_clip_grad_value_:
            mod.clip_grad_value_ = clip_grad_value_  # refused for a wrapped model's parameters



def install_accelerate_clip() -> None:
    """Route ``accelerate.Accelerator.clip_grad_norm_`` through :func:`clip_grad_norm_` for a wrapped
    model's parameters (idempotent; nothing when accelerate has not been imported).

    Recent accelerate (1.16) no longer calls ``torch.nn.utils.clip_grad_norm_``: it sums the norms of
    the parameters' ``p.grad`` itself, which a wrapped model never sets, so it returned 0.0 and clipped
    nothing (the HF Trainer logged ``grad_norm`` 0.0). Other parameters go to accelerate's own.
    Called at ``wrap`` and at every training forward of a wrapped model (a clip follows a forward),
    so an accelerate imported after ``wrap`` (the HF Trainer's included) is routed before its first clip.
    """
    import sys

    acc = sys.modules.get("accelerate")
    cls = getattr(acc, "Accelerator", None) if acc is not None else None
    if cls is None or getattr(cls.clip_grad_norm_, "_megatrain", False):
        return
    original = cls.clip_grad_norm_

    def accelerator_clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _engine_of(params) is not None:
            return clip_grad_norm_(params, max_norm, norm_type=norm_type)
        return original(self, params, max_norm, norm_type=norm_type)

    accelerator_clip_grad_norm_._megatrain = True
    accelerator_clip_grad_norm_._megatrain_original = original
    accelerator_clip_grad_norm_.__doc__ = original.__doc__
    cls.clip_grad_norm_ = accelerator_clip_grad_norm_
