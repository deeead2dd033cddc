"""The long-context kernels: the chunked LM head + loss and the sequence-tiled MLP as autograd Functions,
and the sizes they are chunked by (see :mod:`.long_context` for how a model gets them)."""

from __future__ import annotations

import math
import threading
from typing import Optional

import torch
from torch import nn

from ..compat.functional_call_guard import streamed_swap

GiB = 1024 ** 3

# "auto": chunk the loss when the fp32 logits (B*T x V x 4 B) would exceed this fraction of the
# free device memory; tile the MLP when its intermediates would.
AUTO_FRACTION = 1 / 16
# A chunk of the loss / a tile of the MLP takes at most min(this, free / 16) bytes of working memory.
MAX_WORK_BYTES = 2 * GiB
# "auto" also splits a call whose whole working memory would exceed this fraction of the memory free at that moment.
SHORTAGE_FRACTION = 0.5
# Refuse eager attention when its B x heads x T x T fp32 scores would exceed this fraction of free memory.
EAGER_FRACTION = 0.5
# Refuse a padding mask that SDPA would get as a B x 1 x T x T tensor above this fraction of free memory.
MASK_FRACTION = 1 / 8

_local = threading.local()  # _local.bypass: inside a tile re-run (the tiled forward calls the original one)


def _check_mode(value, what: str, where: str = "megatrain.wrap"):
    """``False`` | ``True`` | ``"auto"`` | a positive int (rows per chunk/tile). Returns it normalised.
    ``where`` starts the one-line ``ValueError`` (``megatrain.estimate``, ``megatrain.WrapOptions``, ...)."""
    if value is None or value is False:
        return False
    if value is True or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise ValueError(f"{where}: {what} must be False, True, 'auto' or a positive number of rows, got {value!r}")


def _rows_for(budget_bytes: float, bytes_per_row: float) -> int:
    rows = max(1, int(budget_bytes // max(1.0, bytes_per_row)))
    return rows - rows % 128 if rows >= 256 else rows


def _tiles(mode, rows: int, untiled_bytes: float, per_row_bytes: float, free: float,
           free_now: Optional[float] = None) -> Optional[int]:
    """Rows per chunk / tile for ``mode`` (False | True | "auto" | rows), or None (not split).

    ``"auto"`` splits when the unsplit working memory ``untiled_bytes`` exceeds ``AUTO_FRACTION`` of
    ``free`` (the device memory free when the model's forward began), or when all ``rows`` at
    ``per_row_bytes`` would take more than ``SHORTAGE_FRACTION`` of ``free_now`` (free at this call;
    default ``free``). The first test is a property of the shapes and of the memory the step starts
    with, so one placement gets the same decisions in every step and a planner that fills the device
    with training state and kept graphs (``activation_policy="auto"``) does not make a short
    sequence's MLP tiled (one more MLP forward per layer); the second keeps a call from running
    unsplit where memory is short now. A chunk takes at most min(``MAX_WORK_BYTES``, ``free_now`` / 16)
    at ``per_row_bytes`` per row.
    """
    if mode is False:
        return None
    if isinstance(mode, int) and mode is not True:
        return mode
    free_now = free if free_now is None else min(free, free_now)
    if mode == "auto" and untiled_bytes <= AUTO_FRACTION * free and rows * per_row_bytes <= SHORTAGE_FRACTION * free_now:
        return None
    return _rows_for(min(MAX_WORK_BYTES, free_now / 16), per_row_bytes)


def loss_rows_for(mode, rows: int, vocab: int, elem: int, free: float, free_now: Optional[float] = None) -> Optional[int]:
    """Rows per chunk of the chunked loss (None: full logits) for ``rows`` = B*T positions.

    Args:
        mode: ``chunked_loss`` of :func:`megatrain.wrap` (False | True | "auto" | rows).
        vocab: V. elem: bytes per element of the compute dtype. free: free device bytes when the
            model's forward began; free_now: free device bytes at this call (default ``free``).
            See :func:`_tiles` for the rule.
    """
    # untiled: the fp32 logits; per row: logits and their gradient, fp32 copies in flight
    return _tiles(mode, rows, rows * vocab * 4, vocab * (2 * elem + 20), free, free_now)


def mlp_rows_for(mode, rows: int, inter: int, elem: int, free: float, free_now: Optional[float] = None) -> Optional[int]:
    """Rows per tile of the tiled MLP (None: untiled) for ``rows`` = B*T tokens, MLP width ``inter``
    (``mode``: ``tile_mlp`` of :func:`megatrain.wrap`; ``elem``, ``free``, ``free_now`` as :func:`loss_rows_for`)."""
    # per row: gate, up, activation, product, and their gradients in flight
    return _tiles(mode, rows, rows * inter * elem * 4, inter * elem * 6, free, free_now)


def norm_rows_for(mode, rows: int, hidden: int, free: float, free_now: Optional[float] = None) -> Optional[int]:
    """Rows per tile of a tiled norm (None: untiled) for ``rows`` = B*T tokens of width ``hidden``
    (``mode``: ``tile_mlp`` of :func:`megatrain.wrap`; ``free``, ``free_now`` as :func:`loss_rows_for`).
    ``"auto"`` tiles when the untiled norm's fp32 copies (input, normalised rows, 2 x 4 B) and their
    gradients would exceed ``AUTO_FRACTION`` of the free memory (see :func:`_tiles`)."""
    # per row: fp32 input, normalised rows, output and their gradients in flight
    return _tiles(mode, rows, rows * hidden * 4 * 4, hidden * 4 * 6, free, free_now)


def checkpoint_spacing(num_layers: int, checkpoint_bytes: int, budget_bytes: float) -> int:
    """K of ``activation_policy="block:K"`` for long context: the smallest K whose checkpoints fit.

    Under ``block:K`` one layer input of every K is kept through the forward ((L / K) rounded up)
    and, while a block runs its backward, up to K - 1 more recomputed inputs of that block.

    Args:
        num_layers: L, decoder layers. checkpoint_bytes: bytes of one layer input (B x T x hidden x
            element size). budget_bytes: device memory granted to the checkpoints.

    Returns:
        The smallest K in 1..L with ``(ceil(L / K) + K - 1) * checkpoint_bytes <= budget_bytes``;
        when none fits, the K with the fewest checkpoints (about sqrt(L)).
    """
    count = {k: math.ceil(num_layers / k) + k - 1 for k in range(1, max(1, num_layers) + 1)}
    for k in sorted(count):
        if count[k] * checkpoint_bytes <= budget_bytes:
            return k
    return min(count, key=lambda k: (count[k], k))


# ---------------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------------

class _ChunkedLMHeadLoss(torch.autograd.Function):
    """``sum_valid(CE(h @ W^T + b, y)) / denom`` over row chunks, gradients produced in forward.

    Inputs: ``hidden`` [N, H] (compute dtype), ``weight`` [V, H], ``bias`` [V] or None, ``labels``
    [N] int64 (``ignore_index`` rows do not count), ``denom`` 0-d fp32 tensor, ``rows`` per chunk.
    Output: the 0-d fp32 loss. Each chunk runs the reference's own operations (``linear`` in the
    compute dtype, ``.float()``, ``cross_entropy``) on a small autograd graph and is differentiated
    at once, so per chunk the values and gradients are those of ``ForCausalLMLoss``; only the sums
    over chunks (the loss, and the weight and bias gradients, in fp32) are in a different order.
    Weight and bias gradients are returned once (a post-accumulate-grad hook on the weight fires
    once); backward only scales the kept gradients by the incoming one.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, denom, rows: int):
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]]
        n = hidden.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        gh = torch.empty_like(hidden) if need[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
        gb = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need[2] else None
        for s in range(0, n, rows):
            y = labels[s:s + rows]
            if not any(need):
                ce = nn.functional.cross_entropy(nn.functional.linear(hidden[s:s + rows], weight, bias).float(), y,
                                                 ignore_index=ignore_index, reduction="sum")
                total += ce
                continue
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(w) if t is not None else None
                          for t, w in zip((hidden[s:s + rows], weight, bias), need)]
                ce = nn.functional.cross_entropy(nn.functional.linear(*leaves).float(), y,
                                                 ignore_index=ignore_index, reduction="sum")
                grads = iter(torch.autograd.grad(ce / denom, [t for t, w in zip(leaves, need) if w]))
            total += ce.detach()
            if need[0]:
                gh[s:s + rows] = next(grads)
            if need[1]:
                gw += next(grads)
            if need[2]:
                gb += next(grads)
            del ce, leaves, grads
        ctx.grads = (gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype))
        return total / denom

    @staticmethod
    def backward(ctx, go):
        grads = getattr(ctx, "grads", None)
        if grads is None:
            raise RuntimeError("megatrain: a second backward through the chunked loss (retain_graph=True) is not "
                               "supported; run the forward again, or wrap(model, chunked_loss=False)")
        ctx.grads = None
        gh, gw, gb = grads
        go = go.to(torch.float32)
        gh = None if gh is None else gh.mul_(go.to(gh.dtype))
        gw = None if gw is None else gw.mul_(go.to(gw.dtype))
        gb = None if gb is None else gb.mul_(go.to(gb.dtype))
        return gh, gw, gb, None, None, None, None


def chunked_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                           labels: Optional[torch.Tensor], rows: int, num_items_in_batch=None,
                           ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(hidden @ weight.T + bias, labels, ...)`` without the full logits.

    Args:
        hidden: [..., H] hidden states entering the LM head (any float dtype; the compute dtype).
        weight: [V, H] LM head weight (same dtype and device). bias: [V] or None.
        labels: [...] int64 token ids, shifted here (``labels[..., 1:]``, last position ignored),
            or None when ``shift_labels`` ([...], already shifted) is given.
        rows: rows of the flattened [N, H] hidden states per chunk (>= 1; larger than N is one chunk).
        num_items_in_batch: None (mean over the non-ignored tokens) or the divisor of the summed
            loss (int or tensor), as in the HF Trainer's gradient accumulation.
        ignore_index: label value that does not count.

    Returns:
        The 0-d fp32 loss on ``hidden.device``; its backward gives gradients to ``hidden``,
        ``weight`` and ``bias``.
    """
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(hidden.device)
    if num_items_in_batch is None:
        denom = (y != ignore_index).sum().to(torch.float32)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).to(torch.float32)
    return _ChunkedLMHeadLoss.apply(hidden2, weight, bias, y, int(ignore_index), denom, int(rows))


def _causal_lm_loss_reference():
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
        return LOSS_MAPPING.get("ForCausalLM")
    except ImportError:  # pragma: no cover
        return None


# ---------------------------------------------------------------------------------------------
# the tiled MLP
# ---------------------------------------------------------------------------------------------

class _TiledMLPFunction(torch.autograd.Function):
    """``mlp(x)`` over row tiles of ``x`` [N, H]; backward re-runs each tile with grad.

    ``params`` are the MLP's parameters as bound at forward time (views of a streamed layer's
    device slot); they are saved (so the ``store`` policy's saved-tensor hooks can turn them into
    re-fetch handles) and substituted for the module's own in backward with
    ``torch.func.functional_call`` (the module's attributes are placeholders by then).
    """

    @staticmethod
    def forward(ctx, mlp, names, rows, x, *params):
        ctx.mlp, ctx.names, ctx.rows = mlp, names, rows
        ctx.save_for_backward(x, *params)
        out = None
        for s in range(0, x.shape[0], rows):
            o = _original_mlp_forward(mlp, x[s:s + rows])
            if out is None:
                out = o.new_empty((x.shape[0],) + tuple(o.shape[1:]))
            out[s:s + rows] = o
        return out

    @staticmethod
    def backward(ctx, go):
        x, *params = ctx.saved_tensors
        mlp, names, rows = ctx.mlp, ctx.names, ctx.rows
        need_x = ctx.needs_input_grad[3]
        need_p = list(ctx.needs_input_grad[4:])
        leaves = [p.detach().requires_grad_(need) for p, need in zip(params, need_p)]
        gx = torch.empty_like(x) if need_x else None
        acc = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) if need else None
               for p, need in zip(params, need_p)]
        wanted = [p for p, need in zip(leaves, need_p) if need]
        for s in range(0, x.shape[0], rows):
            xt = x[s:s + rows].detach().requires_grad_(need_x)
            with torch.enable_grad():
                o = rerun_untiled(mlp, dict(zip(names, leaves)), xt)
                targets = ([xt] if need_x else []) + wanted
                grads = torch.autograd.grad(o, targets, go[s:s + rows], allow_unused=True)
            if need_x:
                gx[s:s + rows] = grads[0] if grads[0] is not None else 0
            it = iter(grads[1:] if need_x else grads)
            for k, need in enumerate(need_p):
                if need:
                    g = next(it)
                    if g is not None:
                        acc[k] += g
        pgrads = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return (None, None, None, gx, *pgrads)


def rerun_untiled(module, params: dict, x):
    """``module(x)`` on ``params`` (``torch.func.functional_call``) through its original, untiled
    forward: the re-run of a tiled MLP / norm tile or of a lean norm (:mod:`.lean_ops`) in backward."""
    _local.bypass = True  # the module's forward is the tiling mixin's: run the original one
    try:
        with streamed_swap():
            return torch.func.functional_call(module, params, (x,))
    finally:
        _local.bypass = False


def _original_mlp_forward(mlp, x):
    return mlp._megatrain_untiled_forward(x)
