"""Lean activations: a decoder layer's norms and gated MLP product keep less for backward, exactly.

A Llama-style decoder layer run with grad keeps 182.6 KB per token for backward at hidden 4096 /
intermediate 11008 in bf16 (measured with saved-tensor hooks). Two pieces of it are cheap to
compute and expensive to keep:

* **RMSNorm** (``input_layernorm``, ``post_attention_layernorm``) on bf16 / fp16 inputs: autograd
  keeps the fp32 copy of its input (4 B per hidden unit) for ``pow`` and ``mul`` and the
  normalised rows in the compute dtype for the weight product, 24 KB per token per norm.
  :class:`_RecomputedNorm` keeps only the input (already alive as the layer input or the residual
  stream) and re-runs the norm with grad in backward. An fp32 input has no copy to drop (its
  ``to(float32)`` is the input itself) and runs as written: there the input's gradient is a sum of
  three terms whose order the recomputation would change.
* **The gated product** ``act(gate_proj(x)) * up_proj(x)``: autograd keeps ``gate`` (for the
  activation's backward), ``act(gate)`` and ``up`` (for the product's); :class:`_GatedProduct` keeps
  ``gate`` and ``up`` and recomputes ``act(gate)`` in backward (22 KB per token at intermediate
  11008).

Together they drop 54.8 KB of the 182.6 KB per token of a 6.74B Llama layer in bf16 (30%), or 63 KB
(34%) not counting the first norm's input, which is the layer input and held anyway; the cost is a
few pointwise kernels per layer in backward. ``tests/python/test_lean_ops.py`` checks the bytes
at a small size.
Exact: the backward re-runs the same operations on the same inputs and differentiates them with
autograd, so every gradient is the one the plain graph gives, bit for bit (the tests compare with
``torch.equal``); only where the values are kept changes.

Which modules: the norms among a decoder layer's direct children whose class name ends with
``RMSNorm`` (Python-level norms; ``nn.LayerNorm``'s fused kernel keeps little already), and an
``mlp`` whose ``forward`` is, bytecode for bytecode, Llama's ``down_proj(act_fn(gate_proj(x)) *
up_proj(x))`` (Llama, Mistral, Qwen2/3 and the other copies of it). Installed by
:mod:`.long_context` beside the row tiling (the same per-module forward) with
``megatrain.wrap(..., lean_activations=True)``; a call that is tiled, runs without grad, or has
extra arguments runs as before.

Measured (H200, 6.74B Llama, 4 x 4096 tokens, ``activation_policy="auto"``, docs/benchmarks/
peers_7b_clip_lean_h200.json, peers_7b_clip0_lean_h200.json): a kept graph 2.16 instead of 3.06 GB,
so the planner kept 13 instead of 9 graphs with clipping (31 instead of 26 without), and the step
time did not change (1.980 vs 1.979 s; 1.612 vs 1.619 s): the recomputation costs ~2 ms of GPU
time per layer and step (the profiled backward shows the norms' re-run), about what the extra graphs
save. Hence off by default: it pays where memory, not compute, limits the kept graphs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .long_context_ops import rerun_untiled


def _gated_mlp_reference(self, x):
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _same_code(f, g) -> bool:
    a, b = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return (a is not None and b is not None and a.co_code == b.co_code and a.co_names == b.co_names
            and a.co_consts == b.co_consts and a.co_argcount == b.co_argcount)


def lean_kind(module: nn.Module, is_norm: bool) -> Optional[str]:
    """``"norm"`` / ``"gated"`` when ``module`` (a decoder layer's norm, or its MLP) can run lean, else None.

    A norm: its class name ends with ``RMSNorm``. An MLP: its class's ``forward`` has the bytecode
    of ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` and ``act_fn`` is a module without
    parameters or buffers.
    """
    if is_norm:
        return "norm" if type(module).__name__.endswith("RMSNorm") else None
    act = getattr(module, "act_fn", None)
    if not (_same_code(type(module).forward, _gated_mlp_reference) and isinstance(act, nn.Module)
            and all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
            and not any(True for _ in act.parameters()) and not any(True for _ in act.buffers())):
        return None
    return "gated"


class _GatedProduct(torch.autograd.Function):
    """``act(gate) * up`` keeping ``gate`` and ``up`` only; backward recomputes ``act(gate)``."""

    @staticmethod
    def forward(ctx, act, gate, up):
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return act(gate) * up

    @staticmethod
    def backward(ctx, go):
        gate, up = ctx.saved_tensors
        need_g, need_u = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        g = gate.detach().requires_grad_(need_g)
        u = up.detach().requires_grad_(need_u)
        targets = [t for t, need in ((g, need_g), (u, need_u)) if need]
        if not targets:
            return None, None, None
        with torch.enable_grad():
            out = ctx.act(g) * u
            grads = iter(torch.autograd.grad(out, targets, go, allow_unused=True))
        return None, (next(grads) if need_g else None), (next(grads) if need_u else None)


class _RecomputedNorm(torch.autograd.Function):
    """``norm(x)`` keeping ``x`` (and the weights, as bound) only; backward re-runs the norm with grad.

    ``params`` are the norm's parameters as bound at forward time (views of a streamed layer's
    device slot): saved, so the ``store`` policy's saved-tensor hooks turn them into re-fetch
    handles, and substituted for the module's own in backward with ``torch.func.functional_call``.
    """

    @staticmethod
    def forward(ctx, norm, names, x, *params):
        ctx.norm, ctx.names = norm, names
        ctx.save_for_backward(x, *params)
        return norm._megatrain_untiled_forward(x)

    @staticmethod
    def backward(ctx, go):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        need_p = list(ctx.needs_input_grad[3:])
        xl = x.detach().requires_grad_(need_x)
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
        targets = ([xl] if need_x else []) + [p for p, need in zip(leaves, need_p) if need]
        if not targets:
            return (None, None, None) + (None,) * len(params)
        with torch.enable_grad():
            out = rerun_untiled(ctx.norm, dict(zip(ctx.names, leaves)), xl)
            grads = iter(torch.autograd.grad(out, targets, go, allow_unused=True))
        gx = next(grads) if need_x else None
        return (None, None, gx) + tuple(next(grads) if need else None for need in need_p)


def lean_forward(module: nn.Module, x: torch.Tensor):
    """``module(x)`` (a norm or gated MLP marked by :func:`lean_kind`) with the lean saved tensors."""
    if module._megatrain_lean == "gated":
        return module.down_proj(_GatedProduct.apply(module.act_fn, module.gate_proj(x), module.up_proj(x)))
    if x.dtype == torch.float32:  # no fp32 copy to drop; re-summing the input's gradient would change its rounding
        return module._megatrain_untiled_forward(x)
    named = list(module.named_parameters())
    return _RecomputedNorm.apply(module, [n for n, _ in named], x, *[p for _, p in named])
