"""Layer execution of a :class:`~.wrapped_engine.WrappedEngine`: one call of a streamed layer, forward and backward.

:class:`LayerExecution` is the ``execution`` part of :class:`~.wrapped_engine.WrappedEngine`. ``run_layer`` (the
streamed layer's ``forward``) records the call (:class:`~.layer_call._LayerCall`) and runs it
through :class:`~.layer_call._LayerFunction`; ``execute`` runs the layer once on streamed weights
(``acquire``, prefetch of the next ``num_slots - 1`` layers, ``bind`` / ``unbind``, ``release``);
``backward_layer`` re-runs it with grad (or replays the kept graph), returns the input gradients
and hands the weight gradients to ``submit_grads``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import List, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .layer_call import _LayerCall, _LayerFunction
from ..engine.units import Unit


class LayerExecution:
    """Layer calls of a :class:`~.wrapped_engine.WrappedEngine` on streamed weights (its ``execution``
    part; see the module docstring).

    Args:
        engine: the engine whose layers it runs; what it uses of it: ``layers``, ``num_slots``,
            ``resident``, ``device``, ``cuda``, the slot calls ``acquire`` / ``prefetch`` / ``bind`` /
            ``unbind`` / ``release``, ``submit_grads`` and ``disk_read_ahead``. The engine is also what
            :class:`~.layer_call._LayerFunction` calls back (``store_this``, ``execute``, ``backward_layer``).
        policy: the engine's :class:`~..activations.policies.LayerActivations` (blocks, kept graphs' slots).
        replanner: the engine's :class:`~..placement.replan.PlacementReplan` (marks of the measured step).
        activity: the model's :class:`~.thread_guard.ModelActivity` (one thread's use at a time).
        on_backward: called at each layer's backward (the step timeline's ``backward_end`` mark).
    """

    def __init__(self, engine, policy, replanner, activity, on_backward):
        self.engine = engine
        self.policy = policy
        self.replanner = replanner
        self.activity = activity
        self.on_backward = on_backward
        self._dummy = torch.empty(0, requires_grad=True)
        # Its AccumulateGrad node, held so that it stays the node of every graph: backward asks the
        # autograd engine whether the running graph task reaches it, i.e. whether this backward
        # wants parameter gradients at all (not so for autograd.grad(loss, [x]) / backward(inputs=...)).
        self._dummy_node = self._dummy.view_as(self._dummy).grad_fn.next_functions[0][0]

    # ------------------------------------------------------------------ layer execution
    def _neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        j = unit.index + step
        layers = self.engine.layers
        return layers[j] if 0 <= j < len(layers) else None

    def execute(self, call: _LayerCall, diff_inputs, grad: bool, prefetch_step: int = 1, around=None):
        """Run ``call``'s layer once on streamed weights. Returns its output (and bound leaves and
        the still-held slot if grad). ``around(slot)``: a context manager entered around the call."""
        eng, unit = self.engine, call.unit
        slot = eng.acquire(unit)  # (waits for the unit's update)
        if unit.disk is not None and prefetch_step > 0:
            eng.disk_read_ahead()  # a forward at the disk layers: the last step's disk updates may be done
        try:
            self._prefetch_after(unit, slot, prefetch_step)  # depth num_slots - 1
            bound = eng.bind(unit, slot.buf, requires_grad=grad)
            try:
                args, kwargs = call.args_with(diff_inputs)
                with around(slot) if around is not None else contextlib.nullcontext():
                    out = call.layer._megatrain_orig_forward(*args, **kwargs)
            finally:
                eng.unbind(unit)
        except BaseException:
            eng.release(slot)
            raise
        if grad:
            return out, bound, slot
        eng.release(slot)
        return out

    def run_layer(self, layer, args, kwargs):
        """A streamed layer's ``forward``: refused in a second thread while another uses the model
        (:meth:`~.thread_guard.ModelActivity.layer_call`), else recorded and run (:meth:`_run_layer`)."""
        with self.activity.layer_call():
            return self._run_layer(layer, args, kwargs)

    def _run_layer(self, layer, args, kwargs):
        unit = layer._megatrain_unit
        leaves, spec = tree_flatten((args, kwargs))
        # a block shared with other layers: resident parameters, inputs of the layer's Function so that
        # autograd sums the gradients of every layer that uses them before their hook hands them over
        shared = [self.engine.resident.entries[i].param for i in unit.shared]
        shared = [p for p in shared if p.requires_grad]
        any_param_grad = bool(shared) or any(e.param.requires_grad for e in unit.entries)
        diff_idx = [i for i, x in enumerate(leaves)
                    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad]
        if not torch.is_grad_enabled() or not (diff_idx or any_param_grad):
            call = _LayerCall(layer, unit, leaves, spec, [])
            with torch.no_grad():
                return self.execute(call, [], grad=False)
        diff = [leaves[i] for i in diff_idx]
        stored = list(leaves)
        for i in diff_idx:
            stored[i] = None
        call = _LayerCall(layer, unit, stored, spec, diff_idx)
        call.shared = shared
        self.replanner.mark("fwd")
        self.policy.assign_block(call, diff)
        outs = _LayerFunction.apply(self.engine, call, self.activity.graph_token(), self._dummy, *diff, *shared)
        out_leaves = list(call.out_other)
        for i, o in zip(call.out_tensor_idx, outs):
            out_leaves[i] = o
        self.policy.note_call(call)
        # Weak references only: a strong one would make a cycle through the autograd graph
        # (output -> grad_fn -> ctx -> call -> output) that keeps every step's graph alive.
        call.saved = [weakref.ref(o) for o in outs]
        return tree_unflatten(out_leaves, call.out_spec)

    def _prefetch_after(self, unit: Unit, slot, step: int) -> None:
        """Prefetch up to ``num_slots - 1`` units after ``unit`` in direction ``step`` (+1 / -1)."""
        protect = [slot]
        for d in range(1, self.engine.num_slots):
            nxt = self._neighbour(unit, step * d)
            if nxt is None:
                break
            got = self.engine.prefetch(nxt, current=protect)
            if got is None:
                break
            protect.append(got)

    def _weights_wanted(self) -> bool:
        """Whether the running backward accumulates parameter gradients (False for
        ``torch.autograd.grad(loss, inputs)`` or ``backward(inputs=...)`` that exclude them)."""
        will = getattr(torch._C, "_will_engine_execute_node", None)
        if will is None:
            return True
        try:
            return bool(will(self._dummy_node))
        except RuntimeError:  # not inside a backward graph task
            return True

    def backward_layer(self, call: _LayerCall, inputs, grad_outs):
        """Backward of one layer: weight grads sent D2H, input grads returned.

        ``recompute`` / ``block:K``: re-run ``call`` with grad on re-streamed weights first.
        ``store``: re-stream the weights for the kept graph's saved-weight handles.
        Returns the input gradients, then those of ``call.shared`` (a shared block's resident parameters).
        """
        eng, unit = self.engine, call.unit
        self.replanner.mark("bwd")
        self.on_backward()
        want_weights = self._weights_wanted()
        if call.stored is not None:
            out, bound, detached = call.stored
            call.stored = None
            slot = eng.acquire(unit)
            self.policy.hold_weights(unit.index, slot)
            try:
                self._prefetch_after(unit, slot, -1)
            except BaseException:
                self.policy.drop_weights(unit.index)
                eng.release(slot)
                raise
        else:
            detached = [x.detach().requires_grad_(True) for x in inputs]  # every diff input required grad in forward
            cpu_rng, cuda_rng = call.rng
            with torch.random.fork_rng(devices=[eng.device] if eng.cuda else [], enabled=True):
                torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, eng.device)
                reuse = None if self.policy.attention_reuse is None else self.policy.attention_reuse.reuse(call)
                with torch.enable_grad():
                    out, bound, slot = self.execute(call, detached, grad=True, prefetch_step=-1, around=reuse)
        try:
            leaves, _ = tree_flatten(out)
            outs, gos = [], []
            for i, go in zip(call.out_tensor_idx, grad_outs):
                o = leaves[i]
                if go is not None and isinstance(o, torch.Tensor) and o.requires_grad:
                    outs.append(o)
                    gos.append(go)
            want_in = [x for x in detached if x.requires_grad]
            want_w = [(k, b) for k, b in enumerate(bound) if b.requires_grad] if want_weights else []
            shared = list(call.shared) if want_weights else []  # resident parameters of a shared block
            targets = want_in + [b for _, b in want_w] + shared
            if outs and targets:
                grads = torch.autograd.grad(outs, targets, gos, allow_unused=True)
            else:
                grads = [None] * len(targets)
        finally:
            self.policy.drop_weights(unit.index)
            eng.release(slot)
        in_grads = iter(grads[:len(want_in)])
        result = [next(in_grads) if x.requires_grad else None for x in detached]
        wgrads: List[Optional[torch.Tensor]] = [None] * len(unit.entries)
        for (k, _), g in zip(want_w, grads[len(want_in):len(want_in) + len(want_w)]):
            wgrads[k] = g
        shared_grads = list(grads[len(want_in) + len(want_w):]) if shared else [None] * len(call.shared)
        if any(g is not None for g in wgrads):
            eng.submit_grads(unit, wgrads)
        if call.block is not None and call.pos == 0:
            call.block.first_inputs = None
        return result + shared_grads
