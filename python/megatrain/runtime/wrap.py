"""``megatrain.wrap(model)``: turn a Hugging Face causal LM into a streamed, host-stored model.

Each entry of the model's decoder ``ModuleList`` becomes a *streamed layer*: the same module
object (so per-layer attributes such as ``layer_type``, sliding windows and ``layer_idx`` stay
right), switched to a subclass of its own class whose ``forward`` runs the layer on weights
streamed from host memory through a custom autograd Function. Its parameters are replaced by
meta-device placeholders (shape and ``requires_grad`` kept, no storage); at execution they are
bound as zero-copy views into the device slot that holds the layer. The model's own forward
(masks, rotary embeddings, embedding scaling, logit soft-capping, MoE routing) runs unchanged.

Everything else (embedding, final norm, LM head, ...) is the *resident unit*: real device
parameters whose storage is one device buffer, loaded from the host store once per step and
whose gradients are offloaded by post-accumulate-grad hooks (tied weights are one parameter,
so autograd sums both contributions before the hook fires).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import long_context
from .device_state import check_device_state_layers, resolve_device_state_layers
from .engine import Engine
from .units import Entry, Unit
from .module_api import EngineModuleApi, install as _install_module_api

_POLICY_RE = re.compile(r"recompute|store|auto|offload|block:(\d+)")

# ``auto``: keep activations (``store``) when all layers' measured activation bytes fit in this
# fraction of the device memory still free; the rest is left for logits, gradients, fragmentation.
AUTO_STORE_FRACTION = 0.6


class UnsupportedModelError(ValueError):
    """The model has no repeated decoder layer list megatrain can stream."""


def check_activation_policy(policy, what: str = "megatrain.wrap: activation_policy") -> int:
    """Check an activation policy string (the rule of :func:`wrap`; the CLI checks its config with it too).

    Args:
        policy: ``"recompute"``, ``"store"``, ``"auto"``, ``"offload"`` or ``"block:K"`` with K >= 1.
        what: how the error message names the value (``runtime.activation_policy`` in the CLI).

    Returns:
        K of ``block:K``; 1 for the other policies.

    Raises:
        ValueError: ``policy`` is anything else; the message names the accepted values and ``policy``.
    """
    m = _POLICY_RE.fullmatch(policy) if isinstance(policy, str) else None
    if m is None or (m.group(1) is not None and int(m.group(1)) < 1):
        raise ValueError(f"{what} must be 'recompute', 'store', 'auto', 'offload' or 'block:K' (K >= 1), got {policy!r}")
    return int(m.group(1)) if m.group(1) else 1


def find_decoder_layers(model: nn.Module) -> Tuple[str, nn.ModuleList]:
    """Find the repeated decoder layer list: the largest ``ModuleList`` of same-class modules with parameters.

    Returns:
        ``(qualified_name, module_list)``.

    Raises:
        UnsupportedModelError: if there is none (names the model class and what is supported).
    """
    best = None
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) == 0:
            continue
        classes = {type(m) for m in mod}
        if len(classes) != 1:
            continue
        if not any(True for _ in mod[0].parameters()):
            continue
        n = sum(p.numel() for p in mod.parameters())
        if best is None or n > best[2]:
            best = (name, mod, n)
    if best is None:
        raise UnsupportedModelError(
            f"megatrain.wrap: {type(model).__name__} has no repeated decoder layer list (an nn.ModuleList "
            "of same-class layers with parameters, like model.layers in Llama or transformer.h in GPT-2). "
            "Supported: Hugging Face causal LMs whose decoder layers live in one ModuleList "
            "(Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Mixtral, GPT-2, ...).")
    return best[0], best[1]


def _param_owners(root: nn.Module) -> dict:
    """Map id(parameter) -> list of (module, attribute) that hold it, under ``root``."""
    owners: dict = {}
    for mod in root.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((mod, attr))
    return owners


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    for mod in module.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)


class _StreamedLayerMixin:
    """Forward of a streamed decoder layer (mixed into a subclass of the layer's own class)."""

    _megatrain_engine: "WrappedEngine"
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


_STREAMED_CLASSES: dict = {}


def _streamed_class(cls: type) -> type:
    if cls not in _STREAMED_CLASSES:
        _STREAMED_CLASSES[cls] = type(f"Streamed{cls.__name__}", (_StreamedLayerMixin, cls),
                                      {"_megatrain_orig_forward": cls.forward})
    return _STREAMED_CLASSES[cls]


class _LayerCall:
    """Everything needed to re-run one layer call in backward (no weights, no activations but the inputs)."""

    __slots__ = ("layer", "unit", "leaves", "spec", "diff_idx", "out_spec", "out_tensor_idx", "out_other",
                 "rng", "block", "pos", "saved", "stored")

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
    """``auto`` policy: decisions are per shape of a layer call's differentiable inputs."""
    return tuple(tuple(x.shape) for x in tensors)


class _WeightRef:
    """A saved tensor that was a view of a weight slot (``store`` policy): resolved in backward."""

    __slots__ = ("unit", "offset", "shape", "stride")

    def __init__(self, unit: int, offset: int, shape: tuple, stride: tuple):
        self.unit, self.offset, self.shape, self.stride = unit, offset, shape, stride


class _LayerFunction(torch.autograd.Function):
    """One decoder layer: forward on streamed weights without a graph, backward by recomputation."""

    @staticmethod
    def forward(ctx, eng, call, dummy, *diff_inputs):
        ctx.eng = eng
        ctx.call = call
        ctx.parked = None  # offload policy: the input's host copy
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
        eng, call = ctx.eng, ctx.call
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
        return (None, None, None) + tuple(grads)


def model_units(model: nn.Module, layers_name: str, layers: nn.ModuleList) -> List[Unit]:
    """The store units of ``model``: one per decoder layer (in order), then the resident unit
    (every other parameter, tied weights once) if there is one. Nothing is allocated or changed;
    a parameter with ``requires_grad=False`` is a frozen entry. The parameters may be on the meta
    device (:func:`megatrain.estimate` plans the store of a model that is never built).

    Raises:
        UnsupportedModelError: a parameter shared between a decoder layer and another module.
    """
    owners = _param_owners(model)
    layer_param_ids = set()
    units: List[Unit] = []
    for li, layer in enumerate(layers):
        entries, rel = [], []
        for name, p in layer.named_parameters():
            layer_param_ids.add(id(p))
            entries.append(Entry(f"{layers_name}.{li}.{name}", tuple(p.shape), p.numel(), 0,
                                 owners[id(p)], p, frozen=not p.requires_grad))
            rel.append((name, tuple(p.shape)))
        template = (type(layer), tuple(rel))
        units.append(Unit(li, "layer", entries, 0, template, module=layer))
    res_entries = []
    for name, p in model.named_parameters():
        if id(p) in layer_param_ids:
            continue
        for mod, _ in owners[id(p)]:
            if any(mod is l or any(mod is s for s in l.modules()) for l in layers):
                raise UnsupportedModelError(
                    f"megatrain.wrap: parameter {name} is shared between a decoder layer and another module; "
                    "megatrain streams each decoder layer on its own and cannot share its weights")
        res_entries.append(Entry(name, tuple(p.shape), p.numel(), 0, owners[id(p)], p, frozen=not p.requires_grad))
    if res_entries:
        units.append(Unit(len(units), "resident", res_entries, 0, ("resident",)))
    return units


class WrappedEngine(EngineModuleApi, Engine):
    """The engine plus the model-side logic: layer calls, resident unit, activation policy."""

    def __init__(self, model: nn.Module, layers_name: str, layers: nn.ModuleList, device: torch.device,
                 compute_dtype: torch.dtype, activation_policy: str, num_slots: int,
                 grad_accumulator: Optional[bool] = True, source=None, device_state_layers=0):
        self.block_k = check_activation_policy(activation_policy)
        self.store_activations = activation_policy == "store"
        self.auto_policy = activation_policy == "auto"
        self.offload = None  # offload policy: runtime.offload.InputOffload (set once the engine is built)
        # auto: per input shape, the decision and what it was based on (bytes per layer, free bytes)
        self.auto_decisions: dict = {}
        self._weight_slots: dict = {}  # store policy: unit index -> slot holding it during its backward
        self._checkpointing_asked: set = set()  # layers transformers' gradient checkpointing was enabled on
        self.activation_policy = activation_policy
        self.model = model
        units = model_units(model, layers_name, layers)
        self.resident = units[-1] if units and units[-1].kind == "resident" else None
        # The model's own weights are freed unit by unit as they are copied (below): with the
        # store page-locked after the fill, the peak is the store plus one layer.
        reclaim = 0 if source is not None else sum(
            e.numel * e.param.element_size() for u in units for e in u.entries if e.param.device.type == "cpu")
        super().__init__(units, device, compute_dtype, num_slots=num_slots, grad_accumulator=grad_accumulator,
                         reclaimable_bytes=reclaim)

        # Initialise the store: master (fp32) and compute copy, from the model's weights or from
        # ``source`` (a checkpoint reader or a recorded initialisation; the model is on meta).
        with torch.no_grad():
            if source is not None:
                source.fill(self)  # every master
            for u in self.units:
                for i, e in enumerate(u.entries):
                    if e.frozen:  # compute copy only (written by the source directly)
                        if source is None:
                            self.entry_view(u, i, "compute").copy_(e.param.detach())
                        continue
                    if source is None:
                        self.entry_view(u, i, "master").copy_(e.param.detach())
                    self.entry_view(u, i, "compute").copy_(self.entry_view(u, i, "master"))
                    self.entry_view(u, i, "exp_avg").zero_()
                    self.entry_view(u, i, "exp_avg_sq").zero_()
                if u.kind == "layer":
                    self._placeholders(u)  # the layer's own parameters are released here
                elif source is None:
                    for e in u.entries:
                        if e.param.device.type == "cpu":
                            e.param.data = torch.empty(0, dtype=e.param.dtype)
        self.finish_fill()
        self.init_device_state(device_state_layers)

        # Streamed layers: placeholders + streamed class.
        for u in self.layers:
            layer = u.module
            _move_buffers(layer, device)
            layer.__class__ = _streamed_class(type(layer))
            layer._megatrain_engine = self
            layer._megatrain_unit = u

        # Resident unit: real device parameters viewing one device buffer.
        if self.resident is not None:
            self.resident_buf = torch.empty(self.resident.numel, dtype=compute_dtype, device=device)
            self.resident_loaded_version = -1
            self._resident_staging = None  # allocated when a resident gradient is first summed (accumulation)
            self._resident_consumed = {}
            self._resident_hooked = set()
            owners_seen = set()
            for i, e in enumerate(self.resident.entries):
                view = self.resident_buf[e.offset:e.offset + e.numel].view(e.shape)
                if e.param.device.type == "meta":  # streamed load: a new parameter (meta .data cannot be set)
                    newp = nn.Parameter(view, requires_grad=e.param.requires_grad)
                    for mod, attr in e.owners:
                        mod._parameters[attr] = newp
                    e.param = newp
                else:
                    e.param.data = view
                self.register_param(e.param, self.resident, i)
                # Modules that own resident weights refresh the device copy when called, so calling
                # an inner module directly (model.model(...)) after step() sees the new weights too.
                for mod, _ in e.owners:
                    if id(mod) not in owners_seen and mod is not model:
                        owners_seen.add(id(mod))
                        mod.register_forward_pre_hook(lambda m, a: self.load_resident())
            self._hook_resident_grads()
        _move_buffers(model, device)
        self.load_resident()
        self._pending_block: Optional[_Block] = None
        self._last_call: Optional[_LayerCall] = None
        if activation_policy == "offload":
            from .offload import InputOffload

            self.offload = InputOffload(self)
        self._dummy = torch.empty(0, requires_grad=True)
        # Its AccumulateGrad node, held so that it stays the node of every graph: backward asks the
        # autograd engine whether the running graph task reaches it, i.e. whether this backward
        # wants parameter gradients at all (not so for autograd.grad(loss, [x]) / backward(inputs=...)).
        self._dummy_node = self._dummy.view_as(self._dummy).grad_fn.next_functions[0][0]
        model.register_forward_pre_hook(lambda mod, args: self.begin_forward())

    def _placeholders(self, u: Unit) -> None:
        """Replace layer unit ``u``'s parameters by meta placeholders (same shape, same ``requires_grad``)."""
        for k, e in enumerate(u.entries):
            ph = nn.Parameter(torch.empty(e.shape, dtype=torch.float32, device="meta"),
                              requires_grad=e.param.requires_grad)
            e.param = ph
            for mod, attr in e.owners:
                mod._parameters[attr] = ph
            self.register_param(ph, u, k)

    # ------------------------------------------------------------------ resident unit
    def load_resident(self) -> None:
        """Bring the resident unit's device buffer up to date with the host store (if it changed)."""
        u = self.resident
        if u is None:
            return
        self.wait_update(u)
        if self.resident_loaded_version == u.version:
            return
        if self.cuda:
            # The buffer is overwritten on the H2D stream: first let the compute stream finish
            # whatever still reads it (the last backward's LM-head / embedding kernels).
            in_use = torch.cuda.Event()
            in_use.record(self.compute_stream())
            ev = torch.cuda.Event()
            self.copy_h2d(self.resident_buf, u, ready_event=ev, free_event=in_use)
            self.compute_stream().wait_event(ev)
        else:
            self.copy_h2d(self.resident_buf, u)
        self.resident_loaded_version = u.version

    def resident_staging(self) -> torch.Tensor:
        """The resident unit's gradient staging buffer (one region per entry), allocated on first use."""
        if self._resident_staging is None:
            self._resident_staging = self._host_buffer(self.resident.numel)
        return self._resident_staging

    def _make_resident_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            g = p.grad
            p.grad = None
            grads = [None] * len(self.resident.entries)
            grads[i] = g
            prev = self._resident_consumed.get(i)
            if prev is not None:
                self.wait_event(prev)  # the worker still reads this entry's staging region from the last backward
            done = threading.Event()
            self.submit_grads(self.resident, grads, staging=self.resident_staging, on_done=done.set)
            self._resident_consumed[i] = done  # only once submitted: a refused gradient leaves nothing to wait for
        return hook

    def _hook_resident_grads(self) -> None:
        """Hand each resident parameter's gradient to the engine as autograd finishes it.

        A hook needs ``requires_grad``: a parameter unfrozen after ``wrap`` is hooked at the next
        forward (without it its gradient would pile up in ``.grad``, never applied).
        """
        for i, e in enumerate(self.resident.entries):
            if e.param.requires_grad and i not in self._resident_hooked:
                e.param.register_post_accumulate_grad_hook(self._make_resident_hook(i))
                self._resident_hooked.add(i)

    def checkpointing_requested(self, index: int, enabled: bool) -> None:
        """transformers' gradient checkpointing was switched on or off for streamed layer ``index``.

        It stays off (see ``_StreamedLayerMixin.gradient_checkpointing``); switching it on warns once
        per enabling (``gradient_checkpointing_enable()`` sets it on every layer).
        """
        if enabled and not self._checkpointing_asked:
            warnings.warn(
                "megatrain: gradient checkpointing (gradient_checkpointing_enable() / TrainingArguments("
                "gradient_checkpointing=True)) is ignored on a model wrapped by megatrain.wrap: megatrain's "
                f"activation_policy (here {self.activation_policy!r}) already controls recompute, and checkpointing "
                "the streamed layers as well would only run each layer's forward once more. Choose the policy with "
                "megatrain.wrap(model, activation_policy='recompute' | 'store' | 'auto' | 'block:K')",
                UserWarning)
        if enabled:
            self._checkpointing_asked.add(index)
        else:
            self._checkpointing_asked.discard(index)

    def check_frozen(self) -> None:
        """Raise if a parameter frozen at wrap time was unfrozen (it has no fp32 state to train)."""
        for u in self.units:
            for e in u.entries:
                if e.frozen and e.param.requires_grad:
                    raise RuntimeError(
                        f"megatrain: parameter {e.name} was frozen (requires_grad=False) when the model was wrapped, so "
                        "the host store holds only its compute copy (no master weights or Adam moments); it cannot "
                        "be unfrozen now. Set requires_grad before megatrain.wrap / from_pretrained")

    def begin_forward(self) -> None:
        self.check_frozen()
        self._pending_block = None
        self._last_call = None
        if self.offload is not None:
            self.offload.begin_forward()
        if self.resident is not None:
            self._hook_resident_grads()
        self.load_resident()

    # ------------------------------------------------------------------ layer execution
    def _neighbour(self, unit: Unit, step: int) -> Optional[Unit]:
        j = unit.index + step
        return self.layers[j] if 0 <= j < len(self.layers) else None

    def execute(self, call: _LayerCall, diff_inputs, grad: bool, prefetch_step: int = 1, around=None):
        """Run ``call``'s layer once on streamed weights. Returns its output (and bound leaves and
        the still-held slot if grad). ``around(slot)``: a context manager entered around the call."""
        unit = call.unit
        slot = self.acquire(unit)
        try:
            self._prefetch_after(unit, slot, prefetch_step)  # depth num_slots - 1
            bound = self.bind(unit, slot.buf, requires_grad=grad)
            try:
                args, kwargs = call.args_with(diff_inputs)
                with around(slot) if around is not None else contextlib.nullcontext():
                    out = call.layer._megatrain_orig_forward(*args, **kwargs)
            finally:
                self.unbind(unit)
        except BaseException:
            self.release(slot)
            raise
        if grad:
            return out, bound, slot
        self.release(slot)
        return out

    def run_layer(self, layer, args, kwargs):
        unit = layer._megatrain_unit
        leaves, spec = tree_flatten((args, kwargs))
        any_param_grad = any(e.param.requires_grad for e in unit.entries)
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
        self._assign_block(call, diff)
        outs = _LayerFunction.apply(self, call, self._dummy, *diff)
        out_leaves = list(call.out_other)
        for i, o in zip(call.out_tensor_idx, outs):
            out_leaves[i] = o
        self._last_call = call
        # Weak references only: a strong one would make a cycle through the autograd graph
        # (output -> grad_fn -> ctx -> call -> output) that keeps every step's graph alive.
        call.saved = [weakref.ref(o) for o in outs]
        return tree_unflatten(out_leaves, call.out_spec)

    def _assign_block(self, call: _LayerCall, diff) -> None:
        """Place ``call`` in the current block (block:K) if its inputs are exactly the last layer's outputs."""
        k = self.block_k
        if self.auto_policy:  # auto: block:K once the first call chose it (checkpoint spacing from free memory)
            d = self.auto_decisions.get(_shape_key(diff))
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
        blk = call.block
        if call.pos not in blk.inputs:
            x = blk.first_inputs
            with torch.no_grad():
                for pos in range(0, call.pos):
                    c = blk.calls[pos]
                    cpu_rng, cuda_rng = c.rng
                    with torch.random.fork_rng(devices=[self.device] if self.cuda else [], enabled=True):
                        torch.set_rng_state(cpu_rng)
                        if cuda_rng is not None:
                            torch.cuda.set_rng_state(cuda_rng, self.device)
                        out = self.execute(c, x, grad=False)
                    leaves, _ = tree_flatten(out)
                    x = tuple(leaves[i].detach() for i in c.out_tensor_idx)
                    blk.inputs[pos + 1] = x
        return blk.inputs.pop(call.pos)

    def store_this(self, call: _LayerCall, diff_inputs) -> bool:
        """Whether this layer call keeps its graph (``store``), or saves only its input.

        ``auto``: the first call of each input shape is stored and measured (bytes of the tensors
        its graph saved); then as many layers as fit in ``AUTO_STORE_FRACTION`` of the free device
        memory, next to the saved inputs of the others (layers ``0 .. store_layers - 1``), keep
        their graphs and the others save only their input (``recompute``): all layers when everything fits, none but the measured one when
        nothing does. When even the inputs of all layers (``recompute``) do not fit there, no layer
        keeps its graph and one input of every K is kept (``block:K``, K from
        :func:`long_context.checkpoint_spacing`).
        """
        if not self.auto_policy:
            return self.store_activations
        d = self.auto_decisions.get(_shape_key(diff_inputs))
        return True if d is None else call.unit.index < d["store_layers"]

    def _decide_auto(self, key, layer_bytes: int, input_bytes: int = 0) -> None:
        """``auto``: decide for input shape ``key`` from the first call's measured bytes (graph:
        ``layer_bytes``; its differentiable inputs: ``input_bytes``) and the free device memory."""
        free = self.free_device_bytes()
        n = len(self.layers)
        need = layer_bytes * n
        budget = AUTO_STORE_FRACTION * free
        block_k = 1
        if layer_bytes <= 0 or layer_bytes <= input_bytes:
            k = n
        elif n * input_bytes > budget:
            # Long context: not even one saved input per layer fits; space the checkpoints.
            k = 0
            block_k = long_context.checkpoint_spacing(n, input_bytes, budget)
        else:
            # k kept graphs plus the n - k saved inputs of the recomputed layers fit the budget
            k = min(n, int((budget - n * input_bytes) // (layer_bytes - input_bytes)))
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
            out, bound, slot = self.execute(call, detached, grad=True, around=hooks)
        self.release(slot)
        call.stored = (out, bound, detached)
        if self.auto_policy:
            key = _shape_key(diff_inputs)
            if key not in self.auto_decisions:
                self._decide_auto(key, sum(saved_storages.values()),
                                  sum(x.numel() * x.element_size() for x in diff_inputs))
        return out

    def _prefetch_after(self, unit: Unit, slot, step: int) -> None:
        """Prefetch up to ``num_slots - 1`` units after ``unit`` in direction ``step`` (+1 / -1)."""
        protect = [slot]
        for d in range(1, self.num_slots):
            nxt = self._neighbour(unit, step * d)
            if nxt is None:
                break
            got = self.prefetch(nxt, current=protect)
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
        """
        unit = call.unit
        want_weights = self._weights_wanted()
        if call.stored is not None:
            out, bound, detached = call.stored
            call.stored = None
            slot = self.acquire(unit)
            self._weight_slots[unit.index] = slot
            try:
                self._prefetch_after(unit, slot, -1)
            except BaseException:
                self._weight_slots.pop(unit.index, None)
                self.release(slot)
                raise
        else:
            detached = [x.detach().requires_grad_(True) for x in inputs]  # every diff input required grad in forward
            cpu_rng, cuda_rng = call.rng
            with torch.random.fork_rng(devices=[self.device] if self.cuda else [], enabled=True):
                torch.set_rng_state(cpu_rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, self.device)
                with torch.enable_grad():
                    out, bound, slot = self.execute(call, detached, grad=True, prefetch_step=-1)
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
            targets = want_in + [b for _, b in want_w]
            if outs and targets:
                grads = torch.autograd.grad(outs, targets, gos, allow_unused=True)
            else:
                grads = [None] * len(targets)
        finally:
            self._weight_slots.pop(unit.index, None)
            self.release(slot)
        in_grads = iter(grads[:len(want_in)])
        result = [next(in_grads) if x.requires_grad else None for x in detached]
        wgrads: List[Optional[torch.Tensor]] = [None] * len(unit.entries)
        for (k, _), g in zip(want_w, grads[len(want_in):]):
            wgrads[k] = g
        if any(g is not None for g in wgrads):
            self.submit_grads(unit, wgrads)
        if call.block is not None and call.pos == 0:
            call.block.first_inputs = None
        return result


def wrap(model: nn.Module, device: Optional[torch.device | str] = None, compute_dtype: torch.dtype = None,
         activation_policy: str = "recompute", num_slots: int = 2, grad_accumulator: Optional[bool] = None,
         chunked_loss="auto", tile_mlp="auto", device_state_layers=None) -> nn.Module:
    """Move a causal LM's training state into host memory and stream its decoder layers.

    Args:
        model: a Hugging Face causal LM (or any module with one ``nn.ModuleList`` of same-class
            decoder layers), with its weights on the CPU (any float dtype; fp32 recommended: the
            fp32 master weights are initialised from them).
        device: compute device. Default: ``cuda`` when available, else ``cpu``.
        compute_dtype: dtype of the streamed compute copy and of all activations:
            ``torch.bfloat16`` (default on CUDA) or ``torch.float32`` (default on CPU; exact parity).
        activation_policy: ``"recompute"`` (save each layer input, recompute the layer in backward),
            ``"block:K"`` (save every K-th layer input, recompute the block), ``"store"`` (keep
            every layer's activations on the device, no recomputation: backward re-streams only
            the weights; needs the activation memory of plain training without checkpointing) or
            ``"auto"`` (``store`` when the activations measured on the first layer call, times the
            number of layers, fit in 60% of the free device memory; else as many layers as fit
            keep their activations and the rest recompute; when not even every layer's input fits
            (long context), ``block:K`` with K from the free memory; decided per input shape from
            the first layer call, recorded in ``model.megatrain.auto_decisions``) or ``"offload"``
            (as ``recompute``, but each saved layer input is parked in pinned host memory in
            forward and copied back, prefetched one layer ahead, in backward; see
            ``megatrain.runtime.offload``).
        num_slots: device slots per layer shape; prefetch depth is ``num_slots - 1`` (2: forward
            loads layer ``i+1`` while ``i`` runs; 3: ``i+1`` and ``i+2``).
        grad_accumulator: the fp32 gradient accumulator (4 B per trainable parameter). ``None``
            (default): allocated only when needed, i.e. when ``CPUAdamW`` is created with
            ``gradient_accumulation_steps > 1``, or at a second backward before ``step()``; a
            loop with one backward per step costs 14 B/param. ``True``: a section of the host
            store from the start (18 B/param). ``False``: never; a second backward before
            ``step()`` raises. Without it each gradient goes straight into the store's bf16
            compute copy and is read from there by the update.
        chunked_loss: LM head + cross-entropy over row chunks without the full logits when the
            forward gets ``labels`` (``outputs.logits`` is then ``None``): ``"auto"`` (when the fp32
            logits would exceed 1/16 of the free device memory), ``True``, ``False`` or rows per
            chunk. See ``docs/long_context.md``.
        tile_mlp: run each decoder layer's ``mlp`` over row tiles (exact; backward re-runs each
            tile): ``"auto"`` (when its intermediates would exceed 1/16 of the free device memory),
            ``True``, ``False`` or rows per tile.
        device_state_layers: decoder layers ``0 .. K-1`` whose *whole* training state stays on the
            device: compute-dtype weights, fp32 master, ``exp_avg``, ``exp_avg_sq`` and fp32 gradient
            accumulator, i.e. 2 + 12 + 4 = 18 device bytes per parameter in bf16 (20 in fp32). Their
            weights never stream, their gradients never leave the device, and ``optimizer.step()``
            updates them on the device with exactly ``torch.optim.AdamW``'s math (clip coefficient
            of the global norm, per-parameter step counts, the groups' hyperparameters); the next
            forward runs on them while the CPU updates the deeper layers. An int ``K`` (0 .. number
            of layers), or ``"auto"``: as many layers as fit in half of the device memory free at
            wrap time, computed from those exact byte counts. Default ``None``: ``"auto"`` with
            ``activation_policy="auto"`` on CUDA (the placement planner: first the training state of as
            many layers as fit, then the activations of as many layers as fit in what is left;
            ``model.megatrain.placement()`` says what it chose), else 0 (every layer's state in
            the host store). The host store keeps these layers' sections too: checkpoints,
            ``state_dict()``, export and ``optimizer.state`` read and write them there (see
            ``megatrain.runtime.device_state`` and docs/placement.md).

    Parameters with ``requires_grad=False`` when the model is wrapped (a PEFT/LoRA base, a frozen
    embedding) are *frozen*: the store holds only their compute copy (2 B/param in bf16), no
    master weights, Adam moments or accumulator; unfreezing one later raises ``RuntimeError``.

    Returns:
        The same ``model`` object, with ``model.megatrain`` holding the engine. Create the
        optimizer (``megatrain.optim.CPUAdamW(model.parameters(), ...)``) afterwards.
        ``state_dict()`` / ``load_state_dict()`` / ``save_pretrained()`` read and write the fp32
        master weights (see ``megatrain.runtime.module_api`` and docs/drop_in.md), and
        transformers' gradient checkpointing (``gradient_checkpointing_enable()``) is ignored with a
        warning: ``activation_policy`` decides what is recomputed.

    Raises:
        UnsupportedModelError: no repeated decoder layer list, or weights shared with a layer.
        ValueError: bad ``device`` (not CUDA or CPU, or CUDA unavailable), ``activation_policy`` /
            ``compute_dtype`` / ``num_slots``, or the model is already wrapped.
        HostMemoryError: the host store does not fit in host memory (nothing is allocated).
    """
    return _wrap(model, device, compute_dtype, activation_policy, num_slots, grad_accumulator,
                 chunked_loss=chunked_loss, tile_mlp=tile_mlp, device_state_layers=device_state_layers)


def _wrap(model: nn.Module, device, compute_dtype, activation_policy, num_slots, grad_accumulator, source=None,
          chunked_loss="auto", tile_mlp="auto", device_state_layers=None):
    """``wrap``; with ``source``, the model's parameters are on the meta device and ``source.fill(engine)``
    writes every fp32 master (``megatrain.from_pretrained`` / ``megatrain.from_config``)."""
    if getattr(model, "megatrain", None) is not None:
        raise ValueError("megatrain.wrap: this model is already wrapped")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"megatrain.wrap: device must be a CUDA device or 'cpu', got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"megatrain.wrap: device {str(device)!r} requested, but CUDA is not available (torch "
                         f"{torch.__version__}, built with CUDA {torch.version.cuda}): use device='cpu', or install "
                         "a CUDA build of torch on a machine with a GPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(f"megatrain.wrap: device {str(device)!r} requested, but only {torch.cuda.device_count()} "
                         "CUDA device(s) are visible")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"megatrain.wrap: compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("megatrain.wrap: the model has gradient checkpointing on; call "
                         "model.gradient_checkpointing_disable() before wrap (megatrain recomputes layers itself: "
                         "choose with activation_policy='recompute' | 'store' | 'auto' | 'block:K')")
    check_activation_policy(activation_policy)
    check_device_state_layers(device_state_layers)
    device_state_layers = resolve_device_state_layers(device_state_layers, activation_policy, device)
    for name, p in model.named_parameters():
        if p.device.type == "meta" and source is None:
            raise ValueError(f"megatrain.wrap: parameter {name} is on the meta device; load real weights first")
    layers_name, layers = find_decoder_layers(model)
    if device_state_layers != "auto" and device_state_layers > len(layers):
        raise ValueError(f"megatrain.wrap: device_state_layers={device_state_layers}, but the model has {len(layers)} "
                         f"decoder layers; use at most {len(layers)} (or 'auto')")
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "output_router_logits", False):
        # The router logits would be captured from the streamed layers' graph-free forward, so
        # the auxiliary load-balancing loss would silently get no gradient.
        raise UnsupportedModelError(
            f"megatrain.wrap: {type(model).__name__} has config.output_router_logits=True; the MoE auxiliary "
            "loss is not supported through streamed layers yet. Set model.config.output_router_logits = False")
    long_context.check(model, layers, chunked_loss, tile_mlp)
    if cfg is not None and hasattr(cfg, "use_cache"):
        cfg.use_cache = False  # a KV cache updated inside a recomputed layer would be updated twice
    engine = WrappedEngine(model, layers_name, layers, device, compute_dtype, activation_policy, num_slots,
                           grad_accumulator=None if grad_accumulator is None else bool(grad_accumulator),
                           source=source, device_state_layers=device_state_layers)
    object.__setattr__(model, "megatrain", engine)
    engine.long_context = long_context.install(model, engine, chunked_loss, tile_mlp)
    _install_module_api(engine, model)  # state_dict / load_state_dict / save_pretrained over the fp32 masters
    return model
