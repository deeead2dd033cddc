"""Long context on one GPU: the loss without full logits and the sequence-tiled MLP.

Two exact transformations of a wrapped model's forward/backward, both switched on by
:func:`megatrain.wrap` (``chunked_loss=`` and ``tile_mlp=``, ``"auto"`` by default):

* **Chunked LM head + cross-entropy.** At T tokens per micro-batch and vocabulary V the logits
  are a T x V tensor, upcast to fp32 by the loss and with a gradient of the same size: at 512K
  tokens and V = 32000 that is 64 GiB per copy. ``_ChunkedLMHeadLoss`` computes the LM head and the
  cross-entropy over chunks of rows and produces the gradients of the hidden states, the LM head
  weight (and bias) in the same pass, chunk by chunk, so at most one chunk of logits exists.
  The loss is the model's own: the same label shift, ``ignore_index``, ``shift_labels`` and
  ``num_items_in_batch`` reduction as transformers' ``ForCausalLMLoss``, summed in fp32.

  Hook: the model's forward is unchanged. When a forward gets ``labels`` and chunking is on,
  the LM head returns a zero-cost placeholder (a 0-d fp32 zero expanded to B x T x V) and keeps
  its input; the model passes the placeholder to ``self.loss_function``, which megatrain swapped
  for a function that recognises it and computes the chunked loss from the kept hidden states.
  ``outputs.logits`` is then ``None`` (removed from the output: there are no full logits);
  call the model without ``labels``, or with ``wrap(chunked_loss=False)``, to get logits.
  A model that changes the logits between its LM head and its loss (logit soft-capping,
  logit scaling) or computes the loss without ``self.loss_function`` raises at once instead of
  training on the placeholder.

* **Sequence-tiled MLP.** The MLP of a decoder layer is per token, so running it over row tiles
  of the B*T tokens gives identical results. Without grad (the forward of ``recompute``) the tiles
  run one after another; with grad (the layer re-run in backward, or ``store``),
  ``_TiledMLPFunction`` saves only the MLP input and, in backward, re-runs each tile with grad
  and back-propagates it at once, accumulating the weight gradients in fp32. The T x intermediate
  activations never exist whole. The cost is one more forward of the MLP per tiled layer call
  with grad, which is why ``"auto"`` tiles only when the untiled intermediates would take a
  sizeable part of the free device memory (never at short context).

Also here: refusals of attention paths that are O(T^2) in memory at long T (eager attention; a
padding mask that transformers would materialise as B x 1 x T x T for SDPA), raised before the
forward allocates anything.
"""

from __future__ import annotations

import collections
import inspect
import math
import threading
from typing import Optional

import torch
from torch import nn

GiB = 1024 ** 3

# "auto": chunk the loss when the fp32 logits (B*T x V x 4 B) would exceed this fraction of the
# free device memory; tile the MLP when its intermediates would.
AUTO_FRACTION = 1 / 16
# A chunk of the loss / a tile of the MLP takes at most min(this, free / 16) bytes of working memory.
MAX_WORK_BYTES = 2 * GiB
# Refuse eager attention when its B x heads x T x T fp32 scores would exceed this fraction of free memory.
EAGER_FRACTION = 0.5
# Refuse a padding mask that SDPA would get as a B x 1 x T x T tensor above this fraction of free memory.
MASK_FRACTION = 1 / 8

_local = threading.local()  # _local.bypass: inside a tile re-run (the tiled forward calls the original one)


def _check_mode(value, what: str):
    """``False`` | ``True`` | ``"auto"`` | a positive int (rows per chunk/tile). Returns it normalised."""
    if value is None or value is False:
        return False
    if value is True or value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise ValueError(f"megatrain.wrap: {what} must be False, True, 'auto' or a positive number of rows, got {value!r}")


def _rows_for(budget_bytes: float, bytes_per_row: float) -> int:
    rows = max(1, int(budget_bytes // max(1.0, bytes_per_row)))
    return rows - rows % 128 if rows >= 256 else rows


def loss_rows_for(mode, rows: int, vocab: int, elem: int, free: float) -> Optional[int]:
    """Rows per chunk of the chunked loss (None: full logits) for ``rows`` = B*T positions.

    Args:
        mode: ``chunked_loss`` of :func:`megatrain.wrap` (False | True | "auto" | rows).
        vocab: V. elem: bytes per element of the compute dtype. free: free device bytes.
    """
    if mode is False:
        return None
    if isinstance(mode, int) and mode is not True:
        return mode
    if mode == "auto" and rows * vocab * 4 <= AUTO_FRACTION * free:
        return None
    per_row = vocab * (2 * elem + 20)  # logits and their gradient, fp32 copies in flight
    return _rows_for(min(MAX_WORK_BYTES, free / 16), per_row)


def mlp_rows_for(mode, rows: int, inter: int, elem: int, free: float) -> Optional[int]:
    """Rows per tile of the tiled MLP (None: untiled) for ``rows`` = B*T tokens, MLP width ``inter``
    (``mode``: ``tile_mlp`` of :func:`megatrain.wrap`; ``elem``, ``free`` as :func:`loss_rows_for`)."""
    if mode is False:
        return None
    if isinstance(mode, int) and mode is not True:
        return mode
    if mode == "auto" and rows * inter * elem * 4 <= AUTO_FRACTION * free:
        return None
    per_row = inter * elem * 6  # gate, up, activation, product, and their gradients in flight
    return _rows_for(min(MAX_WORK_BYTES, free / 16), per_row)


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
                _local.bypass = True
                try:
                    o = torch.func.functional_call(mlp, dict(zip(names, leaves)), (xt,))
                finally:
                    _local.bypass = False
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


def _original_mlp_forward(mlp, x):
    return mlp._megatrain_untiled_forward(x)


class _TiledMixin:
    """Forward of a decoder layer's MLP, tiled over the rows of its input when the plan says so."""

    def forward(self, x, *args, **kwargs):
        plan = getattr(self, "_megatrain_long", None)
        if (plan is None or getattr(_local, "bypass", False) or args or kwargs or not isinstance(x, torch.Tensor)
                or x.dim() < 2):
            return self._megatrain_untiled_forward(x, *args, **kwargs)
        rows = plan.mlp_tile_rows(self, x)
        if rows is None:
            return self._megatrain_untiled_forward(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        named = list(self.named_parameters())
        grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for _, p in named))
        if grad:
            out = _TiledMLPFunction.apply(self, [n for n, _ in named], rows, x2, *[p for _, p in named])
        else:
            out = _TiledMLPFunction.forward(_NoCtx(), self, None, rows, x2)
        return out.reshape(shape[:-1] + out.shape[1:])


class _NoCtx:
    def save_for_backward(self, *a):
        pass


_TILED_CLASSES: dict = {}


def _tiled_class(cls: type) -> type:
    if cls not in _TILED_CLASSES:
        _TILED_CLASSES[cls] = type(f"Tiled{cls.__name__}", (_TiledMixin, cls),
                                   {"_megatrain_untiled_forward": cls.forward})
    return _TILED_CLASSES[cls]


def _mlp_of(layer: nn.Module) -> Optional[nn.Module]:
    """The per-token MLP of a decoder layer (``layer.mlp``), or None (absent, or a mixture of experts)."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(mlp, nn.Module) or not any(True for _ in mlp.parameters()):
        return None
    if hasattr(mlp, "experts") or hasattr(mlp, "router") or any(isinstance(m, nn.ModuleList) for m in mlp.modules()):
        return None  # MoE: routing statistics / auxiliary losses are captured per call
    return mlp


def _has_active_dropout(mod: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and m.training for m in mod.modules())


# ---------------------------------------------------------------------------------------------
# the plan: installed on a wrapped model
# ---------------------------------------------------------------------------------------------

class LongContext:
    """Per-model state of the chunked loss and the tiled MLP (``model.megatrain.long_context``).

    Attributes:
        chunked_loss, tile_mlp: the modes given to ``wrap`` (False | True | "auto" | rows).
        last: what the last forward did: ``loss_rows`` (rows per loss chunk, None: not chunked),
            ``mlp_rows`` (rows per MLP tile of the last tiled call, None: not tiled), ``tokens``.
    """

    def __init__(self, model: nn.Module, engine, chunked_loss, tile_mlp):
        self.model = model
        self.engine = engine
        self.chunked_loss = _check_mode(chunked_loss, "chunked_loss")
        self.tile_mlp = _check_mode(tile_mlp, "tile_mlp")
        self.last = dict(loss_rows=None, mlp_rows=None, tokens=None)
        self._labels = None  # the current forward's labels (None: no loss in this forward)
        self._placeholder = None
        self._hidden = None
        self._consumed = False
        cfg = getattr(model, "config", None)
        self._cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
        self._head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self._loss_ok, _ = loss_supported(model)
        sig = inspect.signature(type(model).forward)
        self._pos = {n: i - 1 for i, n in enumerate(sig.parameters)}  # positional index without self
        if self._loss_ok and self.chunked_loss is not False:
            self._install_loss()
        if self.tile_mlp is not False:
            for u in engine.layers:
                mlp = _mlp_of(u.module)
                if mlp is None:
                    continue
                mlp.__class__ = _tiled_class(type(mlp))
                mlp._megatrain_long = self
        model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        model.register_forward_hook(self._post_forward)

    def _install_loss(self) -> None:
        head = self._head
        lc = self
        linear_forward = type(head).forward

        def head_forward(hidden):
            if lc._labels is None or lc._placeholder is not None:
                return linear_forward(head, hidden)
            rows = lc._loss_rows(hidden)
            if rows is None:
                return linear_forward(head, hidden)
            lc._hidden = (hidden, rows)
            lc._placeholder = torch.zeros((), dtype=torch.float32, device=hidden.device).expand(
                *hidden.shape[:-1], head.out_features)
            return lc._placeholder

        self._linear_forward = linear_forward
        head.forward = head_forward
        owner = _head_owner(self.model, head)
        ref = owner.loss_function
        sig = inspect.signature(ref)

        def loss_function(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            logits = bound.arguments.get("logits")
            if lc._placeholder is None:
                return ref(*args, **kwargs)
            if logits is not lc._placeholder:
                raise RuntimeError(
                    f"megatrain: {type(lc.model).__name__} changed the logits between its LM head and its loss; "
                    "the chunked loss cannot apply that change. Use megatrain.wrap(model, chunked_loss=False)")
            a = bound.arguments
            hidden, rows = lc._hidden
            labels, shift = a.get("labels"), a.get("shift_labels")
            target = shift if shift is not None else labels
            if target is None or tuple(target.shape) != tuple(hidden.shape[:-1]):
                raise ValueError(
                    f"megatrain: labels of shape {None if target is None else tuple(target.shape)} do not match the "
                    f"{tuple(hidden.shape[:-1])} hidden states entering the LM head (logits_to_keep?); the chunked "
                    "loss needs one label per position. Use megatrain.wrap(model, chunked_loss=False)")
            lc._consumed = True
            return chunked_causal_lm_loss(hidden, head.weight, head.bias, labels, rows,
                                          num_items_in_batch=a.get("num_items_in_batch"),
                                          ignore_index=a.get("ignore_index", -100), shift_labels=shift)

        owner.loss_function = loss_function  # transformers' setter: an instance attribute, the class keeps its own

    # -------------------------------------------------------------- sizes from free memory
    def _free(self) -> int:
        return int(self.engine.free_device_bytes())

    def _loss_rows(self, hidden: torch.Tensor) -> Optional[int]:
        mode = self.chunked_loss
        if isinstance(mode, int) and mode is not True:
            return mode
        n = hidden.numel() // hidden.shape[-1]
        return loss_rows_for(mode, n, self._head.out_features, hidden.element_size(), self._free())

    def mlp_tile_rows(self, mlp: nn.Module, x: torch.Tensor) -> Optional[int]:
        """Rows per tile for this MLP call, or None (untiled)."""
        mode = self.tile_mlp
        if mode is False or (mlp.training and _has_active_dropout(mlp)):
            if mode is not False and mode != "auto":
                raise ValueError("megatrain: tile_mlp: the MLP has active dropout (p > 0, training mode); tiling would "
                                 "change its random masks. Use megatrain.wrap(model, tile_mlp=False) or dropout 0")
            return None
        if isinstance(mode, int) and mode is not True:
            self.last["mlp_rows"] = mode
            return mode
        h = x.shape[-1]
        n = x.numel() // h
        inter = max(p.numel() for p in mlp.parameters()) // h
        rows = mlp_rows_for(mode, n, inter, x.element_size(), self._free())
        if rows is None:
            return None
        self.last["mlp_rows"] = rows
        return rows

    # -------------------------------------------------------------- forward hooks
    def _arg(self, name, args, kwargs):
        if name in kwargs:
            return kwargs[name]
        i = self._pos.get(name)
        return args[i] if i is not None and 0 <= i < len(args) else None

    def _pre_forward(self, module, args, kwargs):
        self._labels = None
        self._placeholder = None
        self._hidden = None
        self._consumed = False
        self.last["loss_rows"] = None
        self.last["mlp_rows"] = None
        ids = self._arg("input_ids", args, kwargs)
        emb = self._arg("inputs_embeds", args, kwargs)
        ref = ids if isinstance(ids, torch.Tensor) else emb
        if isinstance(ref, torch.Tensor) and ref.dim() >= 2:
            b, t = int(ref.shape[0]), int(ref.shape[1])
            self.last["tokens"] = b * t
            self._check_attention(b, t, self._arg("attention_mask", args, kwargs))
        labels = self._arg("labels", args, kwargs)
        if labels is None:
            labels = kwargs.get("shift_labels")
        self._labels = labels

    def _post_forward(self, module, args, output):
        ph = self._placeholder
        consumed = self._consumed
        if ph is not None:
            self.last["loss_rows"] = self._hidden[1]
        self._labels = self._placeholder = self._hidden = None
        self._consumed = False
        if ph is None:
            return output
        if not consumed:
            raise RuntimeError(
                f"megatrain: {type(module).__name__} computed its loss without self.loss_function, so the chunked "
                "loss was not applied and the logits it used are not real. Use megatrain.wrap(model, chunked_loss=False)")
        if isinstance(output, tuple):
            return tuple(None if o is ph else o for o in output)
        if isinstance(output, dict):
            # ModelOutput (an OrderedDict) refuses del; its keys are what to_tuple() / output["loss"] /
            # the Trainer read. dict.__delitem__ would leave the key in OrderedDict's own order list.
            delete = collections.OrderedDict.__delitem__ if isinstance(output, collections.OrderedDict) else dict.__delitem__
            for k in [k for k, v in output.items() if v is ph]:
                delete(output, k)
                object.__setattr__(output, k, None)
        return output

    def _check_attention(self, b: int, t: int, attention_mask) -> None:
        cfg = self._cfg
        impl = getattr(cfg, "_attn_implementation", None)
        heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or 1
        small = b * t * t <= 64 * 1024 * 1024  # below 8K x 8K nothing here can matter
        if small:
            return
        free = self._free()
        if impl == "eager":
            need = b * heads * t * t * 4
            if need > EAGER_FRACTION * free:
                raise ValueError(
                    f"megatrain: eager attention at {t} tokens per sequence materialises B x heads x T x T scores "
                    f"({need / GiB:.1f} GiB per layer, {free / GiB:.1f} GiB free); load the model with "
                    "attn_implementation='sdpa' (or 'flash_attention_2')")
        if (impl in ("sdpa", "eager") and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                and b * t * t > MASK_FRACTION * free and not bool(attention_mask.all())):
            raise ValueError(
                f"megatrain: an attention_mask with padding at {t} tokens per sequence makes transformers build a "
                f"B x 1 x T x T mask ({b * t * t / GiB:.1f} GiB) for {impl} attention; pack sequences without "
                "padding (attention_mask=None, or all ones, and labels -100 where no loss is wanted), or use "
                "attn_implementation='flash_attention_2'")


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


def _head_owner(model: nn.Module, head: nn.Module) -> nn.Module:
    """The innermost module whose output embedding is ``head`` (the causal LM itself, also under a
    PEFT wrapper): its forward calls ``self.loss_function``."""
    owner = model
    for m in model.modules():
        get = getattr(m, "get_output_embeddings", None)
        if m is not model and callable(get) and hasattr(type(m), "loss_function"):
            try:
                if get() is head:
                    owner = m
            except Exception:  # noqa: BLE001
                pass
    return owner


def loss_supported(model: nn.Module):
    """Whether the chunked loss can stand in for ``model``'s loss: ``(ok, why_not)``."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        return False, "its output embedding (get_output_embeddings()) is not an nn.Linear"
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        v = getattr(cfg, attr, None)
        if v not in (None, 1, 1.0):
            return False, f"config.{attr}={v} transforms the logits between the LM head and the loss"
    ref = _causal_lm_loss_reference()
    try:
        current = _head_owner(model, head).loss_function
    except Exception:  # noqa: BLE001 - not a transformers model
        current = None
    if ref is None or current is not ref:
        return False, "its loss_function is not transformers' ForCausalLMLoss"
    return True, ""


def check(model: nn.Module, layers, chunked_loss, tile_mlp) -> None:
    """Check ``wrap``'s ``chunked_loss`` / ``tile_mlp`` for ``model`` (before anything is changed).

    Raises:
        ValueError: a mode is not False / True / "auto" / a positive int, or ``True`` / a row count
            was asked for a model that cannot have it (the message says why).
    """
    cl, tm = _check_mode(chunked_loss, "chunked_loss"), _check_mode(tile_mlp, "tile_mlp")
    if cl is not False and cl != "auto":
        ok, why = loss_supported(model)
        if not ok:
            raise ValueError(f"megatrain.wrap: chunked_loss={cl!r} is not supported for {type(model).__name__}: "
                             f"{why}; use chunked_loss=False")
    if tm is not False and tm != "auto":
        for layer in layers:
            if _mlp_of(layer) is None:
                raise ValueError(f"megatrain.wrap: tile_mlp={tm!r}: decoder layer {type(layer).__name__} has no "
                                 "per-token MLP at .mlp (absent, or a mixture of experts); use tile_mlp=False")


def install(model: nn.Module, engine, chunked_loss="auto", tile_mlp="auto") -> LongContext:
    """Install the chunked loss and the tiled MLP on a model being wrapped (called by ``wrap``
    after :func:`check`)."""
    return LongContext(model, engine, chunked_loss, tile_mlp)
