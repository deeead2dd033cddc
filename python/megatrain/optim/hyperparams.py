"""Checks of :class:`~megatrain.optim.CPUAdamW`'s arguments and param groups (one-line ``ValueError``s).

Every error names the call it came from (``megatrain.optim.CPUAdamW``, ``.add_param_group``,
``.load_state_dict``), what was wrong and what to pass instead; nothing is touched before it.
"""

from __future__ import annotations

import math
import numbers

import torch

NONFINITE_MODES = ("skip", "raise")

# torch.optim.AdamW options with no effect on the result here (implementation selectors): accepted.
NO_OP_OPTIONS = ("foreach", "fused", "capturable")
# torch.optim.AdamW options megatrain's fused update does not implement: refused when switched on.
REFUSED_OPTIONS = {
    "amsgrad": "amsgrad=True is not implemented by megatrain's fused CPU AdamW (it keeps no max_exp_avg_sq); "
               "use amsgrad=False",
    "maximize": "maximize=True is not implemented by megatrain's fused CPU AdamW; minimise the negated loss instead",
    "differentiable": "differentiable=True is not supported: megatrain's update runs outside autograd, on the CPU",
}


def refused_option(opts: dict):
    """What is wrong with ``opts`` (a param group or the constructor's options), or None: an option
    megatrain's fused update does not implement switched on (``amsgrad`` / ``maximize`` / ``differentiable``),
    or ``decoupled_weight_decay`` present and false as torch reads it (``False``, ``0``, ``None``: torch.optim.Adam's
    L2 penalty added to the gradient)."""
    for k, msg in REFUSED_OPTIONS.items():
        if opts.get(k):
            return msg
    if not opts.get("decoupled_weight_decay", True):
        return (f"decoupled_weight_decay={opts['decoupled_weight_decay']!r} (Adam's L2 penalty added to the gradient) is "
                "not implemented; CPUAdamW decays the weights as torch.optim.AdamW does (decoupled_weight_decay=True)")
    return None


def check_options(where: str, opts: dict) -> None:
    """ValueError (one line) for a refused option in ``opts`` (:func:`refused_option`); ``where``: the method
    after ``megatrain.optim.CPUAdamW`` in the message (``""``: the constructor)."""
    msg = refused_option(opts)
    if msg is not None:
        raise ValueError(f"megatrain.optim.CPUAdamW{where}: {msg}")


def is_number(v) -> bool:
    """A real Python / NumPy number (not a bool, a string or a tensor)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def hyper_of(group) -> tuple:
    """``(lr, betas, eps, weight_decay)`` of a param group as floats (what an update runs with)."""
    b1, b2 = group["betas"]
    return float(group["lr"]), (float(b1), float(b2)), float(group["eps"]), float(group["weight_decay"])


def _finite_number(v) -> bool:
    """A finite real number, or a one-element real tensor holding one (torch takes tensor hyperparameters)."""
    if isinstance(v, torch.Tensor):
        return v.numel() == 1 and not v.is_complex() and math.isfinite(float(v))
    return is_number(v) and math.isfinite(v)


def check_group_values(groups) -> None:
    """ValueError (one line) for a param group an update cannot run with: a refused option
    (:func:`refused_option`), an ``lr`` / ``eps`` / ``weight_decay`` that is not a finite number, ``betas`` that are not two (set in ``param_groups`` after the constructor's
    checks: a value read from a config as a string, a scheduler lambda's NaN). Ranges are not checked here,
    as torch's ``step()`` does not check them either."""
    for k, g in enumerate(groups):
        msg = refused_option(g)  # switched in param_groups after the constructor's checks
        if msg is not None:
            raise ValueError(f"megatrain.optim.CPUAdamW: param_groups[{k}]: {msg} (nothing was changed)")
        b = g.get("betas")
        bad = [n for n in ("lr", "eps", "weight_decay") if not _finite_number(g.get(n))]
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(_finite_number(x) for x in b)):
            bad.append("betas")
        if bad:
            what = "two finite numbers" if bad[0] == "betas" else "a finite number"
            raise ValueError(f"megatrain.optim.CPUAdamW: param_groups[{k}]['{bad[0]}'] is {g.get(bad[0])!r}, not "
                             f"{what}: no update can run with it (nothing was changed); set it to {what}")


def check_hyper(where: str, hp: dict) -> None:
    """ValueError (one line) for a bad ``lr`` / ``eps`` / ``weight_decay`` / ``betas`` among the keys of ``hp``."""
    for name in ("lr", "eps", "weight_decay"):
        if name in hp:
            v = hp[name]
            if name == "lr" and isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
                v = float(v)  # a tensor lr, as torch.optim.AdamW takes (read as a float at each step)
            if not is_number(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"megatrain.optim.CPUAdamW{where}: {name} must be a finite number >= 0, got {v!r}")
    if "eps" in hp and hp["eps"] == 0:
        raise ValueError(f"megatrain.optim.CPUAdamW{where}: eps must be > 0 (with eps=0 a zero gradient gives 0/0 = NaN "
                         "weights); use e.g. 1e-8")
    if "betas" in hp:
        b = hp["betas"]
        if (not isinstance(b, (tuple, list)) or len(b) != 2
                or not all(is_number(x) and 0.0 <= x < 1.0 for x in b)):
            raise ValueError(f"megatrain.optim.CPUAdamW{where}: betas must be two numbers in [0, 1), got {b!r}")


def check_arguments(lr, betas, eps, weight_decay, max_grad_norm, gradient_accumulation_steps, nonfinite,
                    amsgrad, maximize, differentiable) -> None:
    """The constructor's checks, in this order: hyperparameters, ``nonfinite``, ``max_grad_norm``,
    ``gradient_accumulation_steps``, refused options. Raises ValueError (one line) for the first bad one."""
    check_hyper("", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"megatrain.optim.CPUAdamW: nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if max_grad_norm is not None and not (is_number(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"megatrain.optim.CPUAdamW: max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
    if (not isinstance(gradient_accumulation_steps, int) or isinstance(gradient_accumulation_steps, bool)
            or gradient_accumulation_steps < 1):
        raise ValueError("megatrain.optim.CPUAdamW: gradient_accumulation_steps must be an int >= 1, "
                         f"got {gradient_accumulation_steps!r}")
    check_options("", dict(amsgrad=amsgrad, maximize=maximize, differentiable=differentiable))
