"""Attention outputs kept from a block's re-run, so a layer's backward does not run its attention forward again.

Under ``block:K`` a layer's forward runs three times per step: in the model's forward (no
graph), in the backward's re-run of its block (no graph; it produces the saved inputs of the
next layers of the block) and in its own backward (with graph). At long context the causal
attention is most of a layer's FLOPs (91% at 512K tokens for the 6.74B Llama). While the block
re-run computes a layer's attention, :class:`AttentionReuse` has it computed by the same fused
kernel that the with-graph run would use, with its log-sum-exp, and keeps ``(out, logsumexp)``
on the layer call; the layer's own backward re-run then takes ``out`` as the attention's output
and back-propagates with that kernel's own backward (:class:`_ReusedAttention`), as
``torch.nn.functional.scaled_dot_product_attention``'s autograd does. Each attention forward of
``K - 1`` of every ``K`` layers is saved once per step.

The kernel is the one SDPA's own dispatcher (``torch._fused_sdp_choice``) picks for the with-grad
call: cuDNN or flash on CUDA (head dim a multiple of 8), flash on CPU. Anything else (a mask,
dropout, the efficient / math backends, a mixed-dtype call under autocast) runs SDPA unchanged.
The backward is the fused op's own (the function SDPA's derivative calls, on the same saved
tensors), so the gradients are the with-grad re-run's. One difference on CUDA: the block re-run
then computes the output with the log-sum-exp, as the with-grad call does, where it ran without
before; the next layers' recomputed inputs come from that output.

Memory: one output (B x heads x T x head_dim, the size of a layer input) and one fp32
log-sum-exp (B x heads x T) per kept call, freed by that layer's backward; at most K - 1 at a
time. A call is kept only when its bytes are at most ``FREE_FRACTION`` of the device memory free
then. Intercepted with a ``TorchFunctionMode`` that is active only inside the layer calls it
serves. Off with ``megatrain.wrap(..., reuse_attention=False)``.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

FREE_FRACTION = 1 / 8  # a kept output + log-sum-exp must be at most this part of the free device memory

_SDPA = F.scaled_dot_product_attention


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _Kept:
    """One attention call's output and log-sum-exp, with what its fused backward needs."""

    __slots__ = ("backend", "sig", "out", "lse", "aux", "is_causal", "scale")

    def __init__(self, backend, sig, out, lse, aux, is_causal, scale):
        self.backend, self.sig, self.out, self.lse, self.aux = backend, sig, out, lse, aux
        self.is_causal, self.scale = is_causal, scale


def _signature(q, k, v, is_causal, scale, enable_gqa) -> tuple:
    return (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, bool(is_causal), scale, bool(enable_gqa))


def _backend(q, k, v, is_causal, scale, enable_gqa) -> Optional[str]:
    """The fused kernel SDPA would run for this call with grad ("cudnn", "flash", "cpu_flash"), or None."""
    with torch.enable_grad():
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        choice = torch._fused_sdp_choice(qq, kk, vv, None, 0.0, bool(is_causal), scale=scale,
                                         enable_gqa=bool(enable_gqa))
    if q.device.type == "cpu":
        return "cpu_flash" if choice == SDPBackend.FLASH_ATTENTION.value else None
    if q.device.type != "cuda":
        return None
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        return "cudnn"
    if choice == SDPBackend.FLASH_ATTENTION.value and q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0:
        return "flash"  # (a head dim SDPA would pad goes through SDPA unchanged)
    return None


def _eligible(q, k, v, attn_mask, dropout_p) -> bool:
    if attn_mask is not None or dropout_p != 0.0:
        return False
    ts = (q, k, v)
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in ts):
        return False
    if len({t.dtype for t in ts}) != 1 or len({t.device for t in ts}) != 1:
        return False
    dev = q.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) != q.dtype:
        return False  # autocast would cast the inputs first
    return True


def _forward(backend: str, q, k, v, is_causal, scale):
    """(out, logsumexp, aux) from the fused forward SDPA dispatches to."""
    if backend == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        return r[0], r[1], (r[6], r[7], r[2], r[3], r[4], r[5])  # philox seed / offset, cum_seq_q / k, max_q / k
    if backend == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return r[0], r[1], (r[2], r[3], r[4], r[5], r[6], r[7])  # cum_seq_q / k, max_q / k, rng_state, unused
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    return out, lse, ()


class _ReusedAttention(torch.autograd.Function):
    """SDPA with its output given: forward returns the kept output, backward is the fused kernel's."""

    @staticmethod
    def forward(ctx, q, k, v, kept: _Kept):
        ctx.kept = kept
        out = kept.out
        ctx.save_for_backward(q, k, v, out, kept.lse)
        kept.out = kept.lse = None  # the graph holds them now
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        kept = ctx.kept
        if kept.backend == "cudnn":
            seed, offset, cq, ck, mq, mk = kept.aux
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                grad_out, q, k, v, out, lse, seed, offset, None, cq, ck, mq, mk, 0.0, kept.is_causal, scale=kept.scale)
        elif kept.backend == "flash":
            cq, ck, mq, mk, seed, offset = kept.aux
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                grad_out, q, k, v, out, lse, cq, ck, mq, mk, 0.0, kept.is_causal, seed, offset, scale=kept.scale)
        else:
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, kept.is_causal, scale=kept.scale)
        return dq, dk, dv, None


class _SDPAMode(TorchFunctionMode):
    """Active inside one layer call: every other torch function passes through, SDPA goes to ``attention``."""

    def __init__(self, owner: "AttentionReuse", kept: List[Optional[_Kept]]):
        super().__init__()
        self.owner, self.kept = owner, kept

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _SDPA:
            return func(*args, **kwargs)
        return self.attention(func, args, kwargs, *_sdpa_args(*args, **kwargs))


class _Keep(_SDPAMode):
    """Inside a block re-run's layer call: SDPA calls go through the fused kernel and are kept."""

    def attention(self, func, args, kwargs, q, k, v, mask, p, causal, scale, gqa):
        backend = _backend(q, k, v, causal, scale, gqa) if _eligible(q, k, v, mask, p) else None
        if backend is None or not self.owner.room_for(q, v):
            self.kept.append(None)
            self.owner.skipped += 1
            return func(*args, **kwargs)
        out, lse, aux = _forward(backend, q, k, v, bool(causal), scale)
        self.kept.append(_Kept(backend, _signature(q, k, v, causal, scale, gqa), out, lse, aux, bool(causal), scale))
        self.owner.kept_calls += 1
        self.owner.backends[backend] = self.owner.backends.get(backend, 0) + 1
        return out


class _Reuse(_SDPAMode):
    """Inside a layer's with-grad re-run: the i-th SDPA call takes the i-th kept output when it matches."""

    def attention(self, func, args, kwargs, q, k, v, mask, p, causal, scale, gqa):
        kept = self.kept.pop(0) if self.kept else None
        if kept is None or mask is not None or p != 0.0 or kept.sig != _signature(q, k, v, causal, scale, gqa):
            return func(*args, **kwargs)
        self.owner.reused_calls += 1
        return _ReusedAttention.apply(q, k, v, kept)


class AttentionReuse:
    """Keeps attention outputs from the block re-run of ``block:K`` for the layers' own backward.

    ``engine.attention_reuse`` when ``wrap(reuse_attention=True)`` (the default). Counters since
    wrap: ``kept_calls`` (attention calls kept by a block re-run), ``reused_calls`` (with-grad
    re-runs that took a kept output instead of running the attention forward), ``skipped``
    (calls not kept: no fused kernel for them, or no room), ``backends`` (kept calls per kernel:
    ``"cudnn"``, ``"flash"``, ``"cpu_flash"``).
    """

    def __init__(self, engine):
        self.engine = engine
        self.kept_calls = 0
        self.reused_calls = 0
        self.skipped = 0
        self.backends: dict = {}

    def room_for(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether one output (q's shape with v's head dim) and its fp32 log-sum-exp fit ``FREE_FRACTION`` of free memory."""
        nbytes = q.numel() // q.shape[-1] * (v.shape[-1] * q.element_size() + 4)
        return nbytes <= FREE_FRACTION * self.engine.free_device_bytes()

    def keep(self, call):
        """Context manager factory for ``execute(around=...)``: keep the attention outputs of ``call``."""
        call.attention = []
        return lambda slot: _Keep(self, call.attention)

    def reuse(self, call):
        """``execute(around=...)`` for ``call``'s with-grad re-run, or None when nothing was kept for it."""
        kept, call.attention = call.attention, None
        if not kept or all(x is None for x in kept):
            return None
        return lambda slot: _Reuse(self, kept)
