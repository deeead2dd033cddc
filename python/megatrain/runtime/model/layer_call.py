"""The streamed layer: the module swap, the per-layer call record and the autograd Function.

Each decoder layer object is switched to ``Streamed<LayerClass>`` (:func:`_streamed_class`), whose
``forward`` hands the call to the engine (``WrappedEngine.run_layer``). One call of a layer is a
:class:`_LayerCall`; :class:`_LayerFunction` runs it forward without grad on streamed weights and,
in backward, re-runs it with grad (or replays the kept graph) and hands the weight gradients to
the engine. :class:`_WeightRef` is what a kept graph saves instead of a slot's weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from ..engine.units import Unit


class LayerEngine(Protocol):
    """What a streamed layer and :class:`_LayerFunction` need of their engine
    (:class:`~megatrain.runtime.model.wrapped_engine.WrappedEngine` is the one; naming it here would make this
    module import the one that imports it)."""

    device: torch.device
    activation_policy: str
    offload: Optional[Any]  # runtime.activations.host_offload.InputOffload under the offload policy
    activity: Any  # runtime.model.thread_guard.ModelActivity

    def run_layer(self, layer, args, kwargs): ...

    def checkpointing_requested(self, index: int, enabled: bool) -> None: ...

    def store_this(self, call: _LayerCall, diff_inputs) -> bool: ...

    def forward_stored(self, call: _LayerCall, diff_inputs): ...

    def execute(self, call: _LayerCall, diff_inputs, grad: bool, prefetch_step: int = 1, around=None): ...

    def block_input(self, call: _LayerCall): ...

    def backward_layer(self, call: _LayerCall, inputs, grad_outs): ...


class _StreamedLayerMixin:
    """Forward of a streamed decoder layer (mixed into a subclass of the layer's own class)."""

    _megatrain_engine: LayerEngine
    _megatrain_unit: Unit

    def forward(self, *args, **kwargs):  # noqa: D401 - replaces the layer's forward
        return self._megatrain_engine.run_layer(self, args, kwargs)

    def _apply(self, fn, recurse=True):
        # model.to(device) / .cuda() from the HF Trainer or accelerate: a streamed layer owns no
        # storage (its parameters are meta placeholders) and its buffers are already on the
        # compute device, so placement is megatrain's and this is a no-op.
        return self

    # transformers' GradientCheckpointingLayer wraps forward in torch.utils.checkpoint while this
    # is True. A streamed layer is already recomputed (or stored) by megatrain's activation_policy;
    # checkpointing it as well would re-stream and re-run every layer once more in backward
    # (exact, but a third forward), so model.gradient_checkpointing_enable() is ignored here.
    @property
    def gradient_checkpointing(self) -> bool:
        return False

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, value) -> None:
        eng = self.__dict__.get("_megatrain_engine")
        if eng is not None:
            eng.checkpointing_requested(self._megatrain_unit.index, bool(value))


_MIXED_CLASSES: dict = {}


def mixed_class(prefix: str, mixin: type, cls: type, forward_attr: str) -> type:
    """``<prefix><cls>``: a subclass of ``cls`` with ``mixin`` first, ``cls.forward`` kept as ``forward_attr``.

    One class per ``(mixin, cls)`` pair, made once (the module swap assigns ``__class__``)."""
    key = (mixin, cls)
    if key not in _MIXED_CLASSES:
        _MIXED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (mixin, cls), {forward_attr: cls.forward})
    return _MIXED_CLASSES[key]


def _streamed_class(cls: type) -> type:
    return mixed_class("Streamed", _StreamedLayerMixin, cls, "_megatrain_orig_forward")


class _LayerCall:
    """Everything needed to re-run one layer call in backward (no weights, no activations but the inputs)."""

    __slots__ = ("layer", "unit", "leaves", "spec", "diff_idx", "out_spec", "out_tensor_idx", "out_other",
                 "rng", "block", "pos", "saved", "stored", "attention", "shared")

    def __init__(self, layer, unit, leaves, spec, diff_idx):
        self.layer = layer
        self.unit = unit
        self.leaves = leaves
        self.spec = spec
        self.diff_idx = diff_idx
        self.out_spec = None
        self.out_tensor_idx = None
        self.out_other = None
        self.rng = None
        self.block = None
        self.pos = 0
        self.saved = None
        self.stored = None  # store policy: (layer graph outputs, bound weight leaves, detached inputs)
        self.attention = None  # block:K: attention outputs kept by the block re-run (attention_reuse)
        self.shared = []  # resident parameters of a block shared with other layers: extra Function inputs

    def args_with(self, diff_inputs):
        leaves = list(self.leaves)
        for i, t in zip(self.diff_idx, diff_inputs):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)


class _Block:
    """Layers ``[start, start+K)`` of one forward under the ``block:K`` policy: only the first input is kept."""

    def __init__(self):
        self.calls: List[_LayerCall] = []
        self.first_inputs = None  # detached diff inputs of the first layer (kept alive by the block)
        self.inputs: dict = {}  # position -> detached diff inputs, filled by recomputation in backward


def _rng_state(device: torch.device):
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu, cuda


def _shape_key(tensors) -> tuple:
    """``auto`` policy: decisions are per shape of a layer call's activation inputs (:func:`_auto_inputs`)."""
    return tuple(tuple(x.shape) for x in tensors)


def _auto_inputs(call: _LayerCall, diff_inputs) -> tuple:
    """``auto`` policy: the inputs a layer call's decision is keyed by and measured on.

    Its differentiable inputs; for a call with none (the first layer after a frozen embedding,
    whose hidden states need no gradient), its first floating-point tensor argument, so that it
    shares the decision of the layers after it.
    """
    if diff_inputs:
        return tuple(diff_inputs)
    first = next((x for x in call.leaves if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
    return () if first is None else (first,)


class _WeightRef:
    """A saved tensor that was a view of a weight slot (``store`` policy): resolved in backward."""

    __slots__ = ("unit", "offset", "shape", "stride")

    def __init__(self, unit: int, offset: int, shape: tuple, stride: tuple):
        self.unit, self.offset, self.shape, self.stride = unit, offset, shape, stride


def _optimizer_step(eng) -> int:
    """The optimizer steps applied to ``eng``'s model so far (any CPUAdamW of it: ``optimizer_steps``, counted by
    ``CPUAdamW.step``): a forward's graph is stale once it changes."""
    return getattr(eng, "optimizer_steps", 0)


def check_not_stale(eng, made) -> None:
    """Raise when the optimizer stepped since the forward that recorded ``made`` (:func:`_optimizer_step`).

    Raises:
        RuntimeError: one line; the streamed layers would be recomputed with the updated weights.
    """
    if _optimizer_step(eng) != made:
        raise RuntimeError("megatrain: this backward runs through a forward made before the last optimizer step(): "
                           "its layers would be recomputed with the updated weights, a wrong gradient (torch raises "
                           "'modified by an inplace operation' here); run the forward again after step()")


def guard_stale_backward(eng, out) -> None:
    """After a forward with autograd on: hooks on the output's tensors (loss, logits, hidden_states) that run
    :func:`check_not_stale` as a backward from them starts, before any parameter gets a gradient."""
    if not torch.is_grad_enabled():
        return
    made = _optimizer_step(eng)
    values = out.values() if isinstance(out, dict) else (out if isinstance(out, (tuple, list)) else (out,))
    for v in values:  # the loss, the logits, and the tensors of a tuple such as hidden_states
        for t in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda grad: check_not_stale(eng, made))


class _LayerFunction(torch.autograd.Function):
    """One decoder layer: forward on streamed weights without a graph, backward by recomputation."""

    @staticmethod
    def forward(ctx, eng, call, token, dummy, *diff_inputs):
        diff_inputs = diff_inputs[:len(diff_inputs) - len(call.shared)]  # then the shared block's parameters
        ctx.eng = eng
        ctx.call = call
        ctx.token = token  # thread_guard: this forward is pending until its backward ends or this graph is freed
        ctx.parked = None  # offload policy: the input's host copy
        ctx.opt_step = _optimizer_step(eng)
        call.rng = _rng_state(eng.device)
        if eng.store_this(call, diff_inputs):
            out = eng.forward_stored(call, diff_inputs)
        else:
            out = eng.execute(call, diff_inputs, grad=False)
        leaves, spec = tree_flatten(out)
        call.out_spec = spec
        call.out_tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        outs = tuple(leaves[i] for i in call.out_tensor_idx)
        non_diff = [o for o in outs if not o.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        call.out_other = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        if call.stored is not None:
            # The layer's own graph (in call.stored) holds what backward needs; the outer graph
            # gets graph-free aliases of its outputs.
            ctx.saves_inputs = False
            return tuple(o.detach() for o in outs)
        if eng.offload is not None:  # offload: the input goes to host memory, comes back in backward
            ctx.parked = eng.offload.park(diff_inputs)
            ctx.saves_inputs = False
        elif call.block is None or call.pos == 0:
            ctx.save_for_backward(*diff_inputs)
            ctx.saves_inputs = True
        else:
            ctx.saves_inputs = False
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        with ctx.eng.activity.layer_backward(ctx.token):  # a second thread's use is refused here
            return _LayerFunction._backward(ctx, grad_outs)

    @staticmethod
    def _backward(ctx, grad_outs):
        eng, call = ctx.eng, ctx.call
        check_not_stale(eng, ctx.opt_step)  # (the model output's hook has checked first, before any gradient)
        if ctx.saves_inputs:
            inputs = ctx.saved_tensors
        elif ctx.parked is not None:
            inputs = eng.offload.fetch(ctx.parked)
            ctx.parked = None
        elif call.stored is not None:
            inputs = None
        elif call.block is not None and (call.pos in call.block.inputs or call.block.first_inputs is not None):
            inputs = eng.block_input(call)
        else:
            raise RuntimeError(
                f"megatrain: a second backward through the same forward (retain_graph=True) is not supported with "
                f"activation_policy={eng.activation_policy!r} (the layer's saved state was freed by the first one); "
                "use activation_policy='recompute', or run the forward again")
        grads = eng.backward_layer(call, inputs, grad_outs)
        return (None, None, None, None) + tuple(grads)

