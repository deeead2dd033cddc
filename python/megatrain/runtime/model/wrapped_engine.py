"""``WrappedEngine``: the engine plus the model side (layer calls, resident unit, activation policy).

This module builds it (the store's fill, the streamed layers, the resident unit's device buffer and
hooks) and runs the checks at each forward; running a layer call is :mod:`.layer_exec`'s
(:class:`~.layer_exec.LayerExecution`).
"""

from __future__ import annotations

import contextlib
import weakref
import warnings
from typing import Optional

import torch
from torch import nn

from ..compat.clip_grad import install_accelerate_clip
from ..engine.core import Engine
from ..compat.functional_call_guard import note_streamed_layer
from .layer_call import _Block, _LayerCall, _streamed_class
from .layer_exec import LayerExecution
from .decoder_layers import UnsupportedModelError, _move_buffers, model_units
from .model_config import cache_asked, router_logits_asked
from .module_api import EngineModuleApi
from ..placement.replan import PlacementReplan
from ..activations.policies import ActivationPolicies, ActivationPolicy
from .thread_guard import ModelActivity
from ..engine.units import Unit


def _keep_last(p: torch.Tensor, handle) -> None:
    """Keep the post-accumulate-grad hook ``handle`` of ``p`` after those registered on ``p`` later: a user's
    hook on a resident parameter then sees ``p.grad`` before the engine's hook takes it."""
    ref = weakref.ref(p)  # not ``p``: the function is kept in p's __dict__

    def register_post_accumulate_grad_hook(hook):
        t = ref()
        h = torch.Tensor.register_post_accumulate_grad_hook(t, hook)
        hooks = t._post_accumulate_grad_hooks
        hooks[handle.id] = hooks.pop(handle.id)  # re-inserted: autograd runs them in the dict's order
        return h
    p.register_post_accumulate_grad_hook = register_post_accumulate_grad_hook


class WrappedEngine(EngineModuleApi, ActivationPolicies, PlacementReplan, LayerExecution, Engine):
    """The engine plus the model-side logic: layer calls, resident unit, activation policy."""

    def __init__(self, model: nn.Module, layers_name: str, layers: nn.ModuleList, device: torch.device,
                 compute_dtype: torch.dtype, activation_policy, num_slots: int,
                 grad_accumulator: Optional[bool] = True, source=None, device_state_layers=0,
                 offload_dir: Optional[str] = None, host_memory_limit: Optional[int] = None,
                 gpu_memory_limit: Optional[int] = None):
        self.policy = ActivationPolicy.parse(activation_policy)  # a string or the value wrap parsed
        self.block_k = self.policy.block_k
        self.gpu_memory_limit_bytes = gpu_memory_limit  # bytes (wrap resolved a fraction); read by free_device_bytes
        self.store_activations = self.policy.stores
        self.auto_policy = self.policy.is_auto
        self.offload = None  # offload policy: runtime.offload.InputOffload (set once the engine is built)
        self.attention_reuse = None  # block:K: runtime.attention_reuse.AttentionReuse (set by wrap)
        # auto: per input shape, the decision and what it was based on (bytes per layer, free bytes)
        self.auto_decisions: dict = {}
        self._weight_slots: dict = {}  # store policy: unit index -> slot holding it during its backward
        self._checkpointing_asked: set = set()  # layers transformers' gradient checkpointing was enabled on
        self.activation_policy = str(self.policy)  # the user's string, as placement() and messages show it
        self.model = model
        units = model_units(model, layers_name, layers)
        self.resident = units[-1] if units and units[-1].kind == "resident" else None
        # The model's own weights are freed unit by unit as they are copied (below): with the
        # store page-locked after the fill, the peak is the store plus one layer.
        reclaim = 0 if source is not None else sum(
            e.numel * e.param.element_size() for u in units for e in u.entries if e.param.device.type == "cpu")
        super().__init__(units, device, compute_dtype, num_slots=num_slots, grad_accumulator=grad_accumulator,
                         reclaimable_bytes=reclaim, offload_dir=offload_dir, host_memory_limit=host_memory_limit,
                         keep_host_layers=device_state_layers if isinstance(device_state_layers, int) else 0)

        # Initialise the store: master (fp32) and compute copy, from the model's weights or from
        # ``source`` (a checkpoint reader or a recorded initialisation; the model is on meta).
        # Data parallel: the ranks' models must agree; local rank 0 fills the node's shared store.
        writer = self.dp is None or self.dp.fills_store
        if self.dp is not None and source is None:
            self.dp.check_same_weights(units)
        # The disk units' masters are written through the tier's buffers, one unit at a time; a
        # unit's compute copy is rebuilt from them when it is released (its moments start as zeros).
        fill_window = self.disk.window(True, on_release=self._compute_from_masters) if self.disk is not None \
            else contextlib.nullcontext()
        with torch.no_grad(), fill_window:
            if source is not None and writer:
                source.fill(self)  # every master
            elif source is not None and hasattr(getattr(source, "index", None), "close"):
                source.index.close()  # a checkpoint reader another rank fills the shared store from
            for u in self.units:
                for i, e in enumerate(u.entries):
                    if not writer:
                        continue
                    if e.frozen:  # compute copy only (written by the source directly)
                        if source is None:
                            self.entry_view(u, i, "compute").copy_(e.param.detach())
                        continue
                    if source is None:
                        self.entry_view(u, i, "master").copy_(e.param.detach())
                    if u.disk is not None:
                        continue  # compute copy at release; a fresh tier unit is zeros
                    self.entry_view(u, i, "compute").copy_(self.entry_view(u, i, "master"))
                    self.entry_view(u, i, "exp_avg").zero_()
                    self.entry_view(u, i, "exp_avg_sq").zero_()
                if u.kind == "layer":
                    self._placeholders(u)  # the layer's own parameters are released here
                elif source is None:
                    for e in u.entries:
                        if e.param.device.type == "cpu":
                            e.param.data = torch.empty(0, dtype=e.param.dtype)
        if self.dp is not None:
            self.dp.barrier("filling the shared host store")
        self.finish_fill()
        if self.resident is not None:  # before the device state, which may keep this unit's state beside it
            self.resident_buf = torch.empty(self.resident.numel, dtype=compute_dtype, device=device)
        self.init_device_state(device_state_layers)
        self._init_replan(device_state_layers == "auto" and self.auto_policy and self.options.replan)

        # Streamed layers: placeholders + streamed class.
        for u in self.layers:
            layer = u.module
            _move_buffers(layer, device)
            layer.__class__ = _streamed_class(type(layer))
            layer._megatrain_engine = self
            layer._megatrain_unit = u
            note_streamed_layer(layer, f"{layers_name}.{u.index}")

        # Resident unit: real device parameters viewing one device buffer.
        if self.resident is not None:
            self.resident_loaded_version = -1
            self._resident_staging = None  # allocated when a resident gradient is first summed (accumulation)
            self._resident_consumed = {}
            self._resident_hooked = set()
            owners_seen = set()
            for i, e in enumerate(self.resident.entries):
                view = self.resident_buf[e.offset:e.offset + e.numel].view(e.shape)
                if e.param.device.type == "meta":  # streamed load: a new parameter (meta .data cannot be set)
                    # .data set afterwards, as below: the parameter keeps a version counter of its own, which
                    # megatrain's writes into resident_buf do not bump (check_resident_params)
                    newp = nn.Parameter(torch.empty(0, dtype=compute_dtype, device=device),
                                        requires_grad=e.param.requires_grad)
                    newp.data = view
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
        self.note_resident_params()
        self._pending_block: Optional[_Block] = None
        self._last_call: Optional[_LayerCall] = None
        if self.policy.offloads:
            from ..activations.host_offload import InputOffload

            self.offload = InputOffload(self)
        self._dummy = torch.empty(0, requires_grad=True)
        # Its AccumulateGrad node, held so that it stays the node of every graph: backward asks the
        # autograd engine whether the running graph task reaches it, i.e. whether this backward
        # wants parameter gradients at all (not so for autograd.grad(loss, [x]) / backward(inputs=...)).
        self._dummy_node = self._dummy.view_as(self._dummy).grad_fn.next_functions[0][0]
        # One activity at a time: a second thread's forward / backward is refused (thread_guard).
        self.activity = ModelActivity()
        model.register_forward_pre_hook(lambda mod, args, kwargs: self.begin_forward(kwargs), with_kwargs=True)
        model.register_forward_hook(lambda mod, args, out: self.activity.end_forward(), always_call=True)

    def _compute_from_masters(self, u: Unit) -> None:
        """Rewrite ``u``'s compute copy from its fp32 masters (a disk unit held by a writing window)."""
        with torch.no_grad():
            for i, e in enumerate(u.entries):
                if not e.frozen:
                    self.entry_view(u, i, "compute").copy_(self.entry_view(u, i, "master"))

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
        if u.device_state is not None:  # updated in place on the device (host_written() refreshes it)
            return
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

    def _no_cache_in_training(self, kwargs: dict, cfg) -> None:
        """A forward with autograd on runs without a KV cache, as transformers' gradient checkpointing
        does: a layer re-run in backward would update the cache a second time and take its own keys
        as the past (wrong gradients). ``use_cache=True`` (the argument, or ``model.config.use_cache``
        or a nested config's, e.g. ``text_config.use_cache``, set back after wrap) is turned off with
        one warning; a given ``past_key_values`` is refused.

        Raises:
            ValueError: ``past_key_values`` given to a forward with autograd on.
        """
        if kwargs.get("past_key_values") is not None:
            raise ValueError("megatrain: past_key_values given to a forward with autograd on: a streamed layer re-run in "
                             "backward would see its own keys in the cache. Train without a cache; use one under "
                             "torch.no_grad() (generate(), evaluation)")
        if cfg is None:
            return
        asked = kwargs.get("use_cache")
        if asked or (asked is None and cache_asked(cfg)):
            if not getattr(self, "_warned_use_cache", False):
                self._warned_use_cache = True
                warnings.warn("megatrain: use_cache=True is incompatible with training through streamed layers "
                              "(recomputed in backward); setting use_cache=False", stacklevel=3)
            kwargs["use_cache"] = False

    def note_resident_params(self) -> None:
        """Record the version counters (bumped only by in-place writes through them) of the resident
        parameters and of the decoder layers' placeholder parameters, and the resident ones' storage."""
        if self.resident is not None:
            self._resident_versions = [(e, id(e.param), e.param._version,
                                        e.param.data_ptr() if u is self.resident else None)
                                       for u in self.units for e in u.entries]

    def check_resident_params(self, where: str, overwritten=()) -> None:
        """Raise if a parameter was written in place since wrap: a resident one (embedding, final norm,
        LM head) or a decoder layer's placeholder (``torch.nn.init.zeros_(layer.weight)``, ``p.copy_``),
        or a resident one was given new storage (``p.data = tensor``), or a module's parameter was
        replaced by another tensor (``module.weight = nn.Parameter(...)``).

        A resident parameter's write changes only the compute copy it views on the device, a
        placeholder's (a meta tensor) changes nothing: the fp32 master in the host store (what the
        optimizer updates, checkpoints and ``state_dict()`` read) keeps its value, so the change
        would be lost or kept by half. ``overwritten``: names a ``model.load_state_dict`` is about to
        write (those may have changed).
        """
        recorded = getattr(self, "_resident_versions", None)
        if self.resident is None or recorded is None:  # (not before wrap has finished)
            return
        # An assignment puts an nn.Parameter there (torch refuses a plain tensor); torch.func.functional_call's
        # temporary tensors (resident ones pass: functional_call_guard) are not Parameters.
        swapped = [e.name for e, _, _, _ in recorded for mod, attr in e.owners
                   if isinstance(mod._parameters.get(attr), nn.Parameter) and mod._parameters[attr] is not e.param]
        if swapped:  # the wrapped model trains, streams and saves its own parameter objects
            raise RuntimeError(
                f"megatrain: {', '.join(swapped[:3])}{' ...' if len(swapped) > 3 else ''} was replaced by another tensor "
                f"after megatrain.wrap (seen at {where}); the wrapped model streams, trains and saves the parameters it "
                "was wrapped with, so the new one would be ignored or used by half. Set weights with "
                "model.load_state_dict(...) or model.state_dict()[name].copy_(...), or replace the parameter before "
                "megatrain.wrap")
        replaced = [e.name for e, pid, _, ptr in recorded
                    if id(e.param) == pid and ptr is not None and e.param.data_ptr() != ptr]
        if replaced:  # `param.data = tensor`: the parameter no longer views the compute copy
            raise RuntimeError(
                f"megatrain: {', '.join(replaced[:3])}{' ...' if len(replaced) > 3 else ''} was given new storage "
                f"(`param.data = ...`) after megatrain.wrap (seen at {where}); the optimizer's updates would never reach "
                "it and state_dict() would not show it. Set weights with model.load_state_dict(...) or "
                "model.state_dict()[name].copy_(...) (both write the fp32 masters), or before megatrain.wrap")
        changed = [e.name for e, pid, v, _ in recorded if id(e.param) == pid and e.param._version != v]
        if changed and all(n in overwritten for n in changed):  # model.load_state_dict replaces them all
            return
        if changed:
            raise RuntimeError(
                f"megatrain: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''} was modified in place after "
                f"megatrain.wrap (seen at {where}); the fp32 master weights in the host store did not change (a decoder "
                "layer's parameter is a placeholder, a resident one views only the compute copy). Set weights with "
                "model.load_state_dict(...) or through model.state_dict()[name].copy_(...) (both write the masters), "
                "or change them before megatrain.wrap")

    def device_state_resident(self) -> Optional[Unit]:
        """The resident unit, for ``device_state_layers="auto"``: when it has trainable entries and the
        store is not shared by data-parallel ranks."""
        u = self.resident
        if u is None or self.dp is not None or all(e.frozen for e in u.entries):
            return None
        return u

    def resident_staging(self) -> torch.Tensor:
        """The resident unit's gradient staging buffer (one region per entry), allocated on first use."""
        if self._resident_staging is None:
            self._resident_staging = self._host_buffer(self.resident.numel)
        return self._resident_staging

    def _make_resident_hook(self, i: int):
        # A weak reference: torch keeps a tensor's post-accumulate-grad hooks where the garbage
        # collector does not look, so a hook holding the engine (which holds the model, which holds
        # the parameter) would keep the model and its host store alive for the process's lifetime.
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            eng = ref()
            if eng is None:
                return
            g = p.grad
            p.grad = None
            grads = [None] * len(eng.resident.entries)
            grads[i] = g
            eng._timeline_backward()
            # the worker may still read this entry's staging region from the last backward
            eng.wait_task(eng._resident_consumed.get(i))
            handle = eng.submit_grads(eng.resident, grads, staging=eng.resident_staging)
            eng._resident_consumed[i] = handle  # only once submitted: a refused gradient leaves nothing to wait for
        return hook

    def _hook_resident_grads(self) -> None:
        """Hand each resident parameter's gradient to the engine as autograd finishes it.

        A hook needs ``requires_grad``: a parameter unfrozen after ``wrap`` is hooked at the next
        forward (without it its gradient would pile up in ``.grad``, never applied). It takes ``p.grad``,
        so it stays the parameter's last post-accumulate-grad hook (:func:`_keep_last`).
        """
        for i, e in enumerate(self.resident.entries):
            if e.param.requires_grad and i not in self._resident_hooked:
                _keep_last(e.param, e.param.register_post_accumulate_grad_hook(self._make_resident_hook(i)))
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

    def begin_forward(self, kwargs=None) -> None:
        """At each forward of the wrapped model: the checks of what changed since wrap, then the resident load.

        Raises:
            ModelInUseError: another thread is running a forward or backward of this model (or holds
                the graph of a forward whose backward has not finished): one line, before anything
                is touched (:mod:`.thread_guard`).
            UnsupportedModelError: the MoE router logits were asked for (``output_router_logits``).
        """
        self.activity.begin_forward()
        cfg = getattr(self.model, "config", None)
        if (kwargs or {}).get("output_router_logits") or router_logits_asked(cfg):
            # captured from the streamed layers' graph-free forward: the auxiliary loss would get no gradient
            raise UnsupportedModelError(
                "megatrain: output_router_logits=True (the MoE auxiliary load-balancing loss) is not supported "
                "through streamed layers yet: its router gradient would be lost. Leave it False (the argument and "
                "model.config.output_router_logits)")
        if torch.is_grad_enabled():
            install_accelerate_clip()  # accelerate imported after wrap (a dict lookup once installed)
            if kwargs is not None:
                self._no_cache_in_training(kwargs, cfg)
        self.check_frozen()
        self.check_resident_params("the forward")
        masters = getattr(self, "masters", None)
        if masters is not None:
            masters.take_writes()  # writes into model.state_dict()'s tensors reach the compute copy
        self._timeline_step_begin()  # before the resident load (it waits for the last step's update)
        self._pending_block = None
        self._last_call = None
        if self.offload is not None:
            self.offload.begin_forward()
        if self.resident is not None:
            self._hook_resident_grads()
        if self.disk is not None:
            self._disk_read_ahead()
        self.load_resident()
        self._replan_begin_forward()

    def _disk_read_ahead(self) -> None:
        """With eager updates: read the disk layers the coming backward updates first, once no update of
        the last step still waits for the disk (at the forward's start, or when it reaches the disk layers)."""
        opt = self.optimizer
        self.disk.on_forward(eager=self.eager_updates and opt is not None and opt.max_grad_norm is None)
