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

* **Sequence-tiled MLP and norms.** The MLP of a decoder layer is per token, so running it over row tiles
  of the B*T tokens gives identical results. The same holds for the layer's norms (Llama's
  ``input_layernorm`` / ``post_attention_layernorm``), which untiled keep an fp32 copy of their
  input and of the normalised rows for backward (12 bytes per token per hidden unit each, 24 GiB
  per layer call at 512K tokens and hidden 4096); tiled they keep only their input. Without grad (the forward of ``recompute``) the tiles
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
from typing import Optional

import torch
from torch import nn

from .lean_ops import lean_kind
from .long_context_ops import (  # noqa: F401 - _rows_for, chunked_causal_lm_loss, checkpoint_spacing: public here too
    EAGER_FRACTION, MASK_FRACTION, GiB, _causal_lm_loss_reference, _check_mode,
    _rows_for, checkpoint_spacing, chunked_causal_lm_loss, loss_rows_for, mlp_rows_for,
    norm_rows_for)
from ..model.model_config import config_value
from .tiling import has_active_dropout, mlp_of, norms_of, tiled_class


# ---------------------------------------------------------------------------------------------
# the plan: installed on a wrapped model
# ---------------------------------------------------------------------------------------------

class LongContext:
    """Per-model state of the chunked loss and the tiled MLP (``model.megatrain.long_context``).

    Attributes:
        chunked_loss, tile_mlp: the modes given to ``wrap`` (False | True | "auto" | rows).
        lean: ``wrap``'s ``lean_activations``: untiled calls with grad of the norms and of a gated
            MLP keep less for backward (:mod:`.lean_ops`).
        last: what the last forward did: ``loss_rows`` (rows per loss chunk, None: not chunked),
            ``mlp_rows`` (rows per MLP tile of the last tiled call, None: not tiled), ``norm_rows``,
            ``tokens``, and ``mlp_tiled_calls`` / ``norm_tiled_calls``: how many MLP / norm calls
            ran tiled since that forward began (its backward's re-runs included).
    """

    def __init__(self, model: nn.Module, engine, chunked_loss, tile_mlp, lean: bool = False):
        self.model = model
        self.engine = engine
        self.chunked_loss = _check_mode(chunked_loss, "chunked_loss")
        self.tile_mlp = _check_mode(tile_mlp, "tile_mlp")
        self.lean = bool(lean)
        self.last = dict(loss_rows=None, mlp_rows=None, norm_rows=None, tokens=None, mlp_tiled_calls=0,
                         norm_tiled_calls=0)
        self._forward_free: Optional[int] = None  # free device bytes when the last model forward began
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
        if self.tile_mlp is not False or self.lean:
            for u in engine.layers:
                mlp = mlp_of(u.module)
                if mlp is None:
                    continue
                mlp._megatrain_lean = lean_kind(mlp, is_norm=False)
                mlp.__class__ = tiled_class(type(mlp))
                mlp._megatrain_long = self
            for u in engine.layers:  # the norms: per token too; untiled they keep fp32 copies of their input
                for norm in norms_of(u.module):
                    norm._megatrain_lean = lean_kind(norm, is_norm=True)
                    norm.__class__ = tiled_class(type(norm))
                    norm._megatrain_long = self
                    norm._megatrain_norm = True
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

    def _frees(self) -> tuple:
        """(free device bytes when the model's forward began, free now): the two inputs of the
        ``"auto"`` rule (``long_context_ops._tiles``). Outside a model forward (a layer called
        alone) or before the first one, both are the free memory now."""
        now = self._free()
        start = self._forward_free
        return (now if start is None else max(start, now)), now

    def _loss_rows(self, hidden: torch.Tensor) -> Optional[int]:
        mode = self.chunked_loss
        if isinstance(mode, int) and mode is not True:
            return mode
        n = hidden.numel() // hidden.shape[-1]
        return loss_rows_for(mode, n, self._head.out_features, hidden.element_size(), *self._frees())

    def tile_rows(self, module: nn.Module, x: torch.Tensor) -> Optional[int]:
        """Rows per tile for this call of a tiled MLP or norm, or None (untiled)."""
        if getattr(module, "_megatrain_norm", False):
            return self.norm_tile_rows(module, x)
        return self.mlp_tile_rows(module, x)

    def norm_tile_rows(self, norm: nn.Module, x: torch.Tensor) -> Optional[int]:
        """Rows per tile for this norm call (``tile_mlp``'s mode; ``"auto"``: when its fp32 copies
        would take a sizeable part of the free device memory), or None (untiled)."""
        mode = self.tile_mlp
        h = x.shape[-1]
        rows = norm_rows_for(mode, x.numel() // h, h, *self._frees())
        if rows is not None:
            self.last["norm_rows"] = rows
            self.last["norm_tiled_calls"] += 1
        return rows

    def mlp_tile_rows(self, mlp: nn.Module, x: torch.Tensor) -> Optional[int]:
        """Rows per tile for this MLP call, or None (untiled)."""
        mode = self.tile_mlp
        if mode is False or (mlp.training and has_active_dropout(mlp)):
            if mode is not False and mode != "auto":
                raise ValueError("megatrain: tile_mlp: the MLP has active dropout (p > 0, training mode); tiling would "
                                 "change its random masks. Use megatrain.wrap(model, tile_mlp=False) or dropout 0")
            return None
        if isinstance(mode, int) and mode is not True:
            self.last["mlp_rows"] = mode
            self.last["mlp_tiled_calls"] += 1
            return mode
        h = x.shape[-1]
        n = x.numel() // h
        inter = max(p.numel() for p in mlp.parameters()) // h
        rows = mlp_rows_for(mode, n, inter, x.element_size(), *self._frees())
        if rows is None:
            return None
        self.last["mlp_rows"] = rows
        self.last["mlp_tiled_calls"] += 1
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
        self.last["norm_rows"] = None
        self.last["mlp_tiled_calls"] = self.last["norm_tiled_calls"] = 0
        auto = "auto" in (self.chunked_loss, self.tile_mlp)
        self._forward_free = self._free() if auto else None  # the backward's re-runs use it too
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
        impl = config_value(cfg, "_attn_implementation", None)
        # per-layer configs (Dots 3): the most heads of any layer (the largest scores)
        heads = config_value(cfg, "num_attention_heads", None) or config_value(cfg, "n_head", None) or 1
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
        v = config_value(cfg, attr, None)
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
            if mlp_of(layer) is None:
                raise ValueError(f"megatrain.wrap: tile_mlp={tm!r}: decoder layer {type(layer).__name__} has no "
                                 "per-token MLP at .mlp (absent, or a mixture of experts); use tile_mlp=False")


def install(model: nn.Module, engine, chunked_loss="auto", tile_mlp="auto", lean: bool = False) -> LongContext:
    """Install the chunked loss, the tiled MLP and the lean norms / gated product
    (:mod:`.lean_ops`) on a model being wrapped (called by ``wrap`` after :func:`check`)."""
    return LongContext(model, engine, chunked_loss, tile_mlp, lean)

