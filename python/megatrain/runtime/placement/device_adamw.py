"""The AdamW of a device-state unit (:mod:`.device_state`) on its device buffers: ``torch.optim.AdamW``'s math.

The gradient (the unit's fp32 accumulator; a direct gradient in the compute buffer, converted to an
fp32 temporary (exact) a bounded batch of entries at a time; or zeros for a
``zero_grad(set_to_none=False)`` entry) is multiplied by the clip coefficient in place (as
``clip_grad_norm_`` scales ``.grad``), then
``torch._fused_adamw_`` (what ``torch.optim.AdamW(fused=True)`` runs; CUDA's default) or the foreach
formulation of ``torch.optim.AdamW`` (decoupled weight decay ``p *= 1 - lr*wd``, ``m.lerp_(g, 1-b1)``,
``v = b2*v + (1-b2)*g*g``, ``p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)``); then the compute
copy is rewritten from the new master (round to nearest even for bf16). Source: Loshchilov & Hutter,
"Decoupled Weight Decay Regularization" (ICLR 2019), as implemented by ``torch.optim.AdamW``.
"""

from __future__ import annotations

from typing import Optional

import torch


@torch.no_grad()
def device_adamw(du, items, scale: float, zero, fused: bool, found_inf: Optional[torch.Tensor] = None) -> None:
    """Enqueue the AdamW of ``items`` on the device unit ``du`` (a ``DeviceUnit``), on the current stream.

    Args:
        du: the unit's device buffers (``fp32(name, i)``: fp32 ``master`` / ``exp_avg`` / ``exp_avg_sq`` /
            ``grad`` of entry i; ``weights(i)``: its compute-dtype copy); all modified in place but ``grad``
            (scaled in place when ``scale != 1``).
        items: ``(entry_index, lr, beta1, beta2, eps, weight_decay, step)`` per entry; entries sharing
            hyperparameters and step count go to one kernel call.
        scale: the clip coefficient (1.0: none).
        zero: entries updated with an all-zero gradient.
        fused: ``torch._fused_adamw_`` (else the foreach formulation).
        found_inf: fused only: a float32 0-d device tensor; 1.0 makes the kernel leave every state unchanged.
    """
    groups: dict = {}
    for i, lr, b1, b2, eps, wd, step in items:
        groups.setdefault((lr, b1, b2, eps, wd, step), []).append(i)
    dev = du.master.device
    for (lr, b1, b2, eps, wd, step), idx in groups.items():
        for batch in _batches(du, idx, zero):  # elementwise math: the split changes no bit
            _adamw_batch(du, batch, zero, scale, fused, found_inf, dev, lr, b1, b2, eps, wd, step)


# Entries whose fp32 temporaries (a direct gradient's fp32 copy, a zero gradient) one kernel call gets
# at most, in elements (one entry at least): bounds the update's transient device memory.
TEMP_NUMEL = 1 << 26


def _batches(du, idx, zero):
    """``idx`` split into runs whose temporaries total at most ``TEMP_NUMEL`` elements."""
    out, cur, n = [], [], 0
    for i in idx:
        t = du.unit.entries[i].numel if (i in zero or i in du.grad_in_compute) else 0
        if cur and n + t > TEMP_NUMEL:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += t
    return out + [cur] if cur else out


def _adamw_batch(du, idx, zero, scale, fused, found_inf, dev, lr, b1, b2, eps, wd, step) -> None:
    """One kernel call of :func:`device_adamw` (entries ``idx`` sharing hyperparameters and step count)."""
    params = [du.fp32("master", i) for i in idx]
    m = [du.fp32("exp_avg", i) for i in idx]
    v = [du.fp32("exp_avg_sq", i) for i in idx]
    grads = [torch.zeros_like(p) if i in zero else du.grad_of(i).float() for i, p in zip(idx, params)]
    if scale != 1.0:
        torch._foreach_mul_(grads, scale)  # as clip_grad_norm_ scales .grad (fp32) in place
    if fused:
        # a fill kernel: torch.tensor(..., device=cuda) was a pageable H2D copy, which waits on the
        # host for the compute stream's queued backward (16.7 ms of GPU idle per 3.37B step)
        steps = [torch.full((), float(step), dtype=torch.float32, device=dev)] * len(idx)
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=lr, beta1=b1, beta2=b2, weight_decay=wd,
                            eps=eps, amsgrad=False, maximize=False, found_inf=found_inf)
    else:
        foreach_adamw(params, grads, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, step=step)
    for i, p in zip(idx, params):
        du.weights(i).copy_(p)


def foreach_adamw(params, grads, exp_avgs, exp_avg_sqs, *, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: int) -> None:
    """``torch.optim.AdamW``'s update (its foreach formulation) for tensors sharing one step count
    (lists of same-device fp32 tensors; ``params``, ``exp_avgs``, ``exp_avg_sqs`` modified in place)."""
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -step_size)
