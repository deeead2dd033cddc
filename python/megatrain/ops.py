"""Tensor ops of the C++ core, as ``torch.ops.megatrain.*`` with fake kernels.

The fake (meta) kernels let the ops run under FakeTensor / ``torch.compile`` tracing and
``torch.library.opcheck``. The Python wrappers below add keyword arguments and documentation.
"""

from typing import Optional

import torch

from megatrain import _C  # noqa: F401  (loading _C registers the ops; megatrain._loader imports this module)

__all__ = ["adamw_step_", "grad_accumulate_"]


@torch.library.register_fake("megatrain::adamw_step_")
def _adamw_step_fake(master, exp_avg, exp_avg_sq, grad, compute_out, lr, beta1, beta2, eps,
                     weight_decay, step, grad_scale):
    n = master.numel()
    for name, t in (("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        torch._check(t.dtype == torch.float32, lambda: f"adamw_step_: {name} must be float32, got {t.dtype}")
        torch._check(t.numel() == n, lambda: f"adamw_step_: {name} must have {n} elements, got {t.numel()}")
    torch._check(grad.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"adamw_step_: grad must be float32 or bfloat16, got {grad.dtype}")
    torch._check(grad.numel() == n, lambda: f"adamw_step_: grad must have {n} elements, got {grad.numel()}")
    if compute_out is not None:
        torch._check(compute_out.dtype in (torch.float32, torch.bfloat16),
                     lambda: f"adamw_step_: compute_out must be bfloat16 or float32, got {compute_out.dtype}")
        torch._check(compute_out.numel() == n,
                     lambda: f"adamw_step_: compute_out must have {n} elements, got {compute_out.numel()}")
    return None


@torch.library.register_fake("megatrain::grad_accumulate_")
def _grad_accumulate_fake(accum, grad, overwrite):
    torch._check(accum.dtype == torch.float32,
                 lambda: f"grad_accumulate_: accum must be float32, got {accum.dtype}")
    torch._check(grad.dtype in (torch.float32, torch.bfloat16),
                 lambda: f"grad_accumulate_: grad must be float32 or bfloat16, got {grad.dtype}")
    torch._check(grad.numel() == accum.numel(),
                 lambda: f"grad_accumulate_: grad must have {accum.numel()} elements, got {grad.numel()}")
    return accum.new_empty((), dtype=torch.float64)


def adamw_step_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    compute_out: Optional[torch.Tensor] = None,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    step: int,
    grad_scale: float = 1.0,
) -> None:
    """One fused AdamW update, in place, on CPU (multithreaded, AVX-512/AVX2/scalar at run time).

    Per element, with the operation order of ``torch.optim.AdamW`` (single-tensor path)::

        g = grad * grad_scale
        master *= 1 - lr * weight_decay
        exp_avg = exp_avg.lerp(g, 1 - beta1)
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
        master -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
        compute_out = master rounded to compute_out.dtype (bf16: round-to-nearest-even)

    Bias corrections are computed in float64 and rounded to float32, as Python floats meeting
    float32 tensors are in torch. Source: Loshchilov & Hutter, "Decoupled Weight Decay
    Regularization", ICLR 2019 (Algorithm 2); ``torch.optim.AdamW``.

    Args:
        master: ``[*]`` float32, contiguous, CPU (may be pinned). fp32 master weights; modified.
        exp_avg: same numel as ``master``, float32, contiguous, CPU. First moment; modified.
        exp_avg_sq: same numel, float32, contiguous, CPU. Second moment; modified.
        grad: same numel, float32 or bfloat16, contiguous, CPU. Read only.
        compute_out: ``None`` or same numel, bfloat16 or float32, contiguous, CPU (typically the
            pinned compute copy streamed to the GPU). Overwritten with the updated ``master``.
        lr: learning rate.
        beta1: first-moment decay, in [0, 1).
        beta2: second-moment decay, in [0, 1).
        eps: added to the bias-corrected denominator.
        weight_decay: decoupled weight decay factor (multiplied by ``lr``).
        step: this update's 1-based step count (the count after incrementing), >= 1.
        grad_scale: multiplier applied to ``grad`` first (e.g. the global-norm clip coefficient).

    Raises:
        TypeError: a tensor has the wrong dtype.
        ValueError: a tensor is not contiguous, not on CPU, or has a different numel; ``step`` < 1;
            invalid ``lr`` / betas / ``eps``. Non-contiguous tensors are never copied silently.
    """
    torch.ops.megatrain.adamw_step_(master, exp_avg, exp_avg_sq, grad, compute_out, float(lr), float(beta1),
                                    float(beta2), float(eps), float(weight_decay), int(step),
                                    float(grad_scale))


def grad_accumulate_(accum: torch.Tensor, grad: torch.Tensor, overwrite: bool) -> torch.Tensor:
    """Fused gradient accumulation with the squared norm of the result, on CPU.

    ``accum = grad`` (``overwrite=True``, first micro-batch) or ``accum += grad``, then returns
    ``sum(accum**2)`` accumulated in float64 over fixed 64K-element chunks (deterministic for any
    thread count), for exact global grad-norm clipping.

    Args:
        accum: ``[*]`` float32, contiguous, CPU. The fp32 accumulator; modified.
        grad: same numel, float32 or bfloat16, contiguous, CPU. Read only.
        overwrite: write instead of add.

    Returns:
        A 0-dim float64 CPU tensor holding the sum of squares of ``accum`` after the update
        (a tensor, not a Python float, so the op stays traceable; use ``float(...)``).

    Raises:
        TypeError: wrong dtype. ValueError: not contiguous, not on CPU, or numel mismatch.
    """
    return torch.ops.megatrain.grad_accumulate_(accum, grad, bool(overwrite))
