"""Activation policies: which layer inputs / graphs a forward keeps for backward.

``recompute`` (keep each layer's input, K=1), ``block:K`` (keep every K-th input, recompute the
block), ``store`` (keep the layer graph; saved weight views become :class:`~..model.layer_call._WeightRef`
handles), ``auto`` (store the layers whose graphs fit in ``AUTO_STORE_FRACTION`` of the free device
memory, recompute the others), ``offload`` (see :mod:`.host_offload`). :class:`LayerActivations` is
the ``policy`` part of :class:`~..model.wrapped_engine.WrappedEngine`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._pytree import tree_flatten

from . import long_context
from .activation_policy import ActivationPolicy  # noqa: F401 - public here
from ..model.layer_call import _auto_inputs, _Block, _LayerCall, _shape_key, _WeightRef

# ``auto``: keep activations (``store``) when all layers' measured activation bytes fit in this
# fraction of the device memory still free; the rest is left for logits, gradients, fragmentation.
AUTO_STORE_FRACTION = 0.6


def default_activation_policy(device: torch.device) -> str:
    """``activation_policy`` when none is given (``megatrain.wrap``, ``from_pretrained``, ``from_config``,
    ``estimate``, ``megatrain train``): ``"auto"`` on a CUDA device (the placement planner: the fastest
    exact schedule that fits the free GPU memory, docs/placement.md), ``"recompute"`` on the CPU
    backend (the streamed engine, as before ``auto`` became the default; the CPU results are unchanged).
    :meth:`ActivationPolicy.default` gives it typed."""
    return str(ActivationPolicy.default(device))


def check_activation_policy(policy, what: str = "megatrain.wrap: activation_policy") -> int:
    """Check an activation policy string (the rule of :func:`wrap`; the CLI checks its config with it too).

    Args:
        policy: ``"recompute"``, ``"store"``, ``"auto"``, ``"offload"`` or ``"block:K"`` with K >= 1
            (or an :class:`ActivationPolicy`).
        what: how the error message names the value (``runtime.activation_policy`` in the CLI).

    Returns:
        K of ``block:K``; 1 for the other policies (:meth:`ActivationPolicy.parse` gives the whole value).

    Raises:
        ValueError: ``policy`` is anything else; the message names the accepted values and ``policy``.
    """
    return ActivationPolicy.parse(policy, what).block_k


def auto_store_layers(n: int, layer_bytes: int, input_bytes: int, free: int) -> tuple:
    """``activation_policy="auto"``'s rule: ``(k, block_k)`` for ``n`` layers whose kept graph holds
    ``layer_bytes`` and whose saved input holds ``input_bytes``, in ``AUTO_STORE_FRACTION * free`` bytes.

    ``k`` layers keep their graphs and the others save only their input (``block_k`` 1); all ``n``
    when a graph is no larger than its input; when not even ``n`` saved inputs fit, ``k`` is 0 and one
    input of every ``block_k`` is kept (:func:`long_context.checkpoint_spacing`).
    """
    budget = AUTO_STORE_FRACTION * free
    if layer_bytes <= 0 or layer_bytes <= input_bytes:
        return n, 1
    if n * input_bytes > budget:
        # Long context: not even one saved input per layer fits; space the checkpoints.
        return 0, long_context.checkpoint_spacing(n, input_bytes, budget)
    # k kept graphs plus the n - k saved inputs of the recomputed layers fit the budget
    return min(n, int((budget - n * input_bytes) // (layer_bytes - input_bytes))), 1

class LayerActivations:
    """What a forward keeps for backward, per layer call: the ``block:K``, ``store`` and ``auto``
    policies of a :class:`~..model.wrapped_engine.WrappedEngine` (its ``policy``).

    Args:
        engine: the engine it serves; what it uses of it: ``device``, ``cuda``, ``layers``,
            ``execute`` / ``release`` (running a layer call) and ``free_device_bytes`` (read at each
            ``auto`` decision, so a replaced ``engine.free_device_bytes`` is seen).
        activation_policy: ``"recompute"``, ``"store"``, ``"auto"``, ``"offload"`` or ``"block:K"``, or its
            parsed :class:`~.activation_policy.ActivationPolicy`.

    Raises:
        ValueError: a bad ``activation_policy`` (:func:`check_activation_policy`), before anything is built.

    Attributes:
        name: the policy string. ``block_k``: K of ``block:K`` (1 otherwise). ``store_activations`` /
        ``auto_policy``: ``store`` / ``auto``. ``auto_decisions``: ``auto``'s decision per input shape
        and what it was based on (bytes per layer, free bytes). ``offload``: the ``offload`` policy's
        :class:`~.host_offload.InputOffload` (set by the engine once built, else None).
        ``attention_reuse``: ``block:K``'s :class:`~.attention_reuse.AttentionReuse` (set by ``wrap``, or None).
    """

    def __init__(self, engine, activation_policy):
        policy = ActivationPolicy.parse(activation_policy)
        self.block_k = policy.block_k
        self.engine = engine
        self.name = str(policy)
        self.store_activations = policy.stores
        self.auto_policy = policy.is_auto
        self.offload = None
        self.attention_reuse = None
        self.auto_decisions: dict = {}
        self._weight_slots: dict = {}  # store policy: unit index -> slot holding it during its backward
        self._pending_block: Optional[_Block] = None
        self._last_call: Optional[_LayerCall] = None

    def begin_forward(self) -> None:
        """A forward of the model begins: no block continues from the last one; offload's parking starts over."""
        self._pending_block = None
        self._last_call = None
        if self.offload is not None:
            self.offload.begin_forward()

    def note_call(self, call: _LayerCall) -> None:
        """``call`` is the last layer call recorded (a next call whose inputs are its outputs continues its block)."""
        self._last_call = call

    def hold_weights(self, unit_index: int, slot) -> None:
        """``store``: the slot holding unit ``unit_index``'s weights during its backward (the kept graph's handles resolve to it)."""
        self._weight_slots[unit_index] = slot

    def drop_weights(self, unit_index: int) -> None:
        """The backward of unit ``unit_index`` is done with its slot (no-op when none is held)."""
        self._weight_slots.pop(unit_index, None)

    def assign_block(self, call: _LayerCall, diff) -> None:
        """Place ``call`` in the current block (block:K) if its inputs are exactly the last layer's outputs."""
        k = self.block_k
        if self.auto_policy:  # auto: block:K once the first call chose it (checkpoint spacing from free memory)
            d = self.auto_decisions.get(_shape_key(_auto_inputs(call, diff)))
            k = 1 if d is None else d.get("block_k", 1)
        if k == 1:
            return
        prev = self._last_call
        chained = (prev is not None and prev.block is self._pending_block and self._pending_block is not None
                   and len(self._pending_block.calls) < k and prev.saved is not None
                   and len(diff) == len(prev.saved) and all(a is b() for a, b in zip(diff, prev.saved)))
        if not chained:
            self._pending_block = _Block()
        blk = self._pending_block
        call.block = blk
        call.pos = len(blk.calls)
        blk.calls.append(call)
        if call.pos == 0:
            blk.first_inputs = tuple(x.detach() for x in diff)

    def block_input(self, call: _LayerCall):
        """Inputs of a non-first layer of a block: recompute the block prefix from its first input."""
        blk, eng = call.block, self.engine
        if call.pos not in blk.inputs:
            x = blk.first_inputs
            with torch.no_grad():
                for pos in range(0, call.pos):
                    c = blk.calls[pos]
                    cpu_rng, cuda_rng = c.rng
                    with torch.random.fork_rng(devices=[eng.device] if eng.cuda else [], enabled=True):
                        torch.set_rng_state(cpu_rng)
                        if cuda_rng is not None:
                            torch.cuda.set_rng_state(cuda_rng, eng.device)
                        reuse = self.attention_reuse
                        out = eng.execute(c, x, grad=False, around=None if reuse is None else reuse.keep(c))
                    leaves, _ = tree_flatten(out)
                    x = tuple(leaves[i].detach() for i in c.out_tensor_idx)
                    blk.inputs[pos + 1] = x
        return blk.inputs.pop(call.pos)

    def store_this(self, call: _LayerCall, diff_inputs) -> bool:
        """Whether this layer call keeps its graph (``store``), or saves only its input.

        ``auto``: the first call of each input shape is stored and measured (bytes of the tensors
        its graph saved; a call without differentiable inputs, after a frozen embedding, is keyed by
        its hidden states and left to the next layer to measure, as is a call of a layer with no
        trainable parameter, whose graph keeps no weight gradients' inputs); then as many layers as fit in
        ``AUTO_STORE_FRACTION`` of the free device memory, next to the saved inputs of the others (layers ``0 .. store_layers - 1``), keep
        their graphs and the others save only their input (``recompute``): all layers when everything fits, none but the measured one when
        nothing does. When even the inputs of all layers (``recompute``) do not fit there, no layer
        keeps its graph and one input of every K is kept (``block:K``, K from
        :func:`long_context.checkpoint_spacing`).
        """
        if not self.auto_policy:
            return self.store_activations
        d = self.auto_decisions.get(_shape_key(_auto_inputs(call, diff_inputs)))
        return True if d is None else call.unit.index < d["store_layers"]

    def decide_auto(self, key, layer_bytes: int, input_bytes: int = 0) -> None:
        """``auto``: decide for input shape ``key`` from the first call's measured bytes (graph:
        ``layer_bytes``; its activation inputs: ``input_bytes``) and the free device memory."""
        free = self.engine.free_device_bytes()
        n = len(self.engine.layers)
        need = layer_bytes * n
        k, block_k = auto_store_layers(n, layer_bytes, input_bytes, free)
        self.auto_decisions[key] = dict(store=k == n, store_layers=k, recompute_layers=n - k, block_k=block_k,
                                        bytes_per_layer=layer_bytes, bytes_all_layers=need,
                                        bytes_per_input=input_bytes, free_bytes=free)

    def forward_stored(self, call: _LayerCall, diff_inputs):
        """``store`` policy: run ``call`` with grad on streamed weights and keep its graph.

        Saved tensors that are views of the weight slot are packed as ``(offset, shape, stride)``
        handles (saved-tensor hooks), so no slot stays pinned by the graph; backward re-streams the
        weights and the handles resolve to the slot that holds them then. Returns the outputs
        (with graph; ``_LayerFunction`` hands graph-free aliases to the outer graph).
        """
        unit = call.unit
        detached = [x.detach().requires_grad_(True) for x in diff_inputs]
        saved_storages = {}  # data_ptr -> bytes of the activations the graph keeps

        def unpack(x):
            if isinstance(x, _WeightRef):
                slot = self._weight_slots[x.unit]
                return slot.buf.as_strided(x.shape, x.stride, x.offset)
            return x

        def hooks(slot):
            weights = slot.buf.untyped_storage().data_ptr()

            def pack(t):
                st = t.untyped_storage()
                if t.device == slot.buf.device and st.data_ptr() == weights:
                    return _WeightRef(unit.index, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
                saved_storages[st.data_ptr()] = st.nbytes()
                return t

            return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

        with torch.enable_grad():
            out, bound, slot = self.engine.execute(call, detached, grad=True, around=hooks)
        self.engine.release(slot)
        call.stored = (out, bound, detached)
        if self.auto_policy:
            acts = _auto_inputs(call, diff_inputs)
            key = _shape_key(acts)
            # A call without differentiable inputs (after a frozen embedding) or of a layer with no
            # trainable parameter saves less than a trainable layer after it (no input / weight
            # gradients): a later trainable layer measures (the last layer measures if none did).
            idx = call.unit.index
            trainable = any(not e.frozen for e in call.unit.entries) or not any(
                not e.frozen for u in self.engine.layers[idx + 1:] for e in u.entries)
            if key not in self.auto_decisions and (diff_inputs and trainable or idx == len(self.engine.layers) - 1):
                self.decide_auto(key, sum(saved_storages.values()),
                                 sum(x.numel() * x.element_size() for x in acts))
        return out

