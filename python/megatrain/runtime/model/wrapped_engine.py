"""``WrappedEngine``: the engine plus the model side (layer calls, resident unit, activation policy).

This module builds it (the store's fill, the streamed layers, the resident unit's device buffer and
hooks) and runs the checks at each forward. Its parts: ``policy`` (what a layer call keeps for
backward: :class:`~..activations.policies.LayerActivations`), ``replanner`` (the placement planner's
second decision: :class:`~..placement.replan.PlacementReplan`), ``execution`` (running a layer call:
:class:`~.layer_exec.LayerExecution`) and ``module_api`` (the ``state_dict`` surface:
:class:`~.module_api.ModuleApi`, set by ``wrap``).
"""

from __future__ import annotations

import weakref
import warnings
from typing import Optional

import torch
from torch import nn

from ..compat.clip_grad import install_accelerate_clip
from ..engine.context import forward_to, part_attribute
from ..engine.core import Engine
from ..compat.functional_call_guard import note_streamed_layer
from .layer_call import _streamed_class, guard_stale_backward
from .layer_exec import LayerExecution
from .decoder_layers import UnsupportedModelError, _move_buffers, model_units
from .model_config import cache_asked, router_logits_asked
from .module_api import refuse_pickle
from .store_fill import fill_store
from .param_checks import check_params, record_params, refuse_unfrozen
from ..placement.host_memory import LIVE_ENGINES
from ..placement.replan import PlacementReplan
from ..activations.activation_policy import ActivationPolicy
from ..activations.policies import LayerActivations
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


class WrappedEngine(Engine):
    """The engine plus the model-side logic: layer calls, resident unit, activation policy (see the module docstring)."""

    activation_policy = part_attribute("policy", "name", "``wrap``'s ``activation_policy`` string.")
    block_k = part_attribute("policy", "block_k", "K of ``block:K`` (1 for the other policies).")
    store_activations = part_attribute("policy", "store_activations", "``activation_policy == 'store'``.")
    auto_policy = part_attribute("policy", "auto_policy", "``activation_policy == 'auto'``.")
    auto_decisions = part_attribute("policy", "auto_decisions", "``auto``: per input shape, the decision and what "
                                "it was based on (bytes per layer, free bytes).")
    offload = part_attribute("policy", "offload", "``offload`` policy: :class:`~..activations.host_offload.InputOffload`.")
    attention_reuse = part_attribute("policy", "attention_reuse", "``block:K``: "
                                 ":class:`~..activations.attention_reuse.AttentionReuse` (set by wrap), or None.")
    replan_info = part_attribute("replanner", "info", "What the planner's second decision measured and chose, or None.")

    def __init__(self, model: nn.Module, layers_name: str, layers: nn.ModuleList, device: torch.device,
                 compute_dtype: torch.dtype, activation_policy, num_slots: int,
                 grad_accumulator: Optional[bool] = True, source=None, device_state_layers=0,
                 offload_dir: Optional[str] = None, host_memory_limit: Optional[int] = None,
                 gpu_memory_limit: Optional[int] = None, batch=None, host_compute_copy="auto"):
        from ..placement.estimate_bytes import batch_reserve

        self.policy = LayerActivations(self, activation_policy)  # (raises on a bad policy before anything is built)
        self.gpu_memory_limit_bytes = gpu_memory_limit  # bytes (wrap resolved a fraction); read by free_device_bytes
        # wrap's batch (resolved WrapOptions with micro_batch_size / seq_len): the capacity share's reserve
        self.batch = (batch.micro_batch_size, batch.seq_len) if batch is not None and batch.batch_tokens else None
        self.activation_reserve_of = batch_reserve(model, layers, batch) if self.batch else None
        self.module_api = None  # the state_dict surface (module_api.ModuleApi), set by wrap
        self._checkpointing_asked: set = set()  # layers transformers' gradient checkpointing was enabled on
        self.model = model
        units = model_units(model, layers_name, layers)
        self.resident = units[-1] if units and units[-1].kind == "resident" else None
        # The model's own weights are freed unit by unit as they are copied (below): with the
        # store page-locked after the fill, the peak is the store plus one layer.
        reclaim = 0 if source is not None else sum(
            e.numel * e.param.element_size() for u in units for e in u.entries if e.param.device.type == "cpu")
        super().__init__(units, device, compute_dtype, num_slots=num_slots, grad_accumulator=grad_accumulator,
                         reclaimable_bytes=reclaim, offload_dir=offload_dir, host_memory_limit=host_memory_limit,
                         keep_host_layers=device_state_layers, host_compute_copy=host_compute_copy)
        fill_store(self, units, source)
        self.finish_fill()
        LIVE_ENGINES.add(self)  # a later wrap's host-memory refusal names what this one holds
        self.optimizer_steps = 0  # steps applied (OptimizerPort.count_step): a graph made before one is stale
        if self.resident is not None:  # before the device state, which may keep this unit's state beside it
            self.resident_buf = torch.empty(self.resident.numel, dtype=compute_dtype, device=device)
        self.init_device_state(device_state_layers)
        self.replanner = PlacementReplan(self, self.policy,
                                         device_state_layers == "auto" and self.auto_policy and self.options.replan)
        self._stream_layers(layers_name, device)
        if self.resident is not None:
            self._init_resident(model, device, compute_dtype)
        _move_buffers(model, device)
        self.load_resident()
        self.note_resident_params()
        self._init_forward(model, activation_policy)

    def _stream_layers(self, layers_name: str, device: torch.device) -> None:
        """Switch each decoder layer to its streamed class (its buffers on ``device``, its parameters placeholders)."""
        for u in self.layers:
            layer = u.module
            _move_buffers(layer, device)
            layer.__class__ = _streamed_class(type(layer))
            layer._megatrain_engine = self
            layer._megatrain_unit = u
            note_streamed_layer(layer, f"{layers_name}.{u.index}")

    def _init_resident(self, model: nn.Module, device: torch.device, compute_dtype: torch.dtype) -> None:
        """Resident unit: real device parameters viewing one device buffer (``resident_buf``), their gradient hooks."""
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

    def _init_forward(self, model: nn.Module, activation_policy) -> None:
        """The parts a forward runs through (offload, thread guard, layer execution) and the model's forward hooks."""
        if ActivationPolicy.parse(activation_policy).offloads:
            from ..activations.host_offload import InputOffload

            self.policy.offload = InputOffload(self)
        # One activity at a time: a second thread's forward / backward is refused (thread_guard).
        self.activity = ModelActivity()
        self.execution = LayerExecution(self, self.policy, self.replanner, self.activity,
                                        on_backward=lambda: self._timeline_backward())
        model.register_forward_pre_hook(lambda mod, args, kwargs: self.begin_forward(kwargs), with_kwargs=True)
        model.register_forward_hook(lambda mod, args, out: self.activity.end_forward(), always_call=True)
        model.register_forward_hook(lambda mod, args, out: guard_stale_backward(self, out))

    # ------------------------------------------------------------------ the parts' calls from other modules
    def __reduce_ex__(self, protocol):
        refuse_pickle(protocol)

    @property
    def masters(self):
        """The fp32 master views ``state_dict()`` hands out (:class:`~.state_dict_views._Masters`), or None before wrap installs them."""
        return None if self.module_api is None else self.module_api.masters

    # thin delegations to the parts (the parts' signatures and docstrings)
    run_layer = forward_to("execution", LayerExecution.run_layer)
    execute = forward_to("execution", LayerExecution.execute)
    backward_layer = forward_to("execution", LayerExecution.backward_layer)
    store_this = forward_to("policy", LayerActivations.store_this)
    forward_stored = forward_to("policy", LayerActivations.forward_stored)
    block_input = forward_to("policy", LayerActivations.block_input)

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

    def _cache_as_the_user_set(self, kwargs: dict, cfg) -> None:
        """Under no_grad a forward without a ``use_cache`` argument keeps a KV cache when the unwrapped model
        would: ``wrap`` turned the config's flags off for training, so the user's (recorded at wrap) is passed
        as ``use_cache=True`` (a flag set True again since: the config decides; no cache: pass
        ``use_cache=False``); not when the model's forward takes no ``use_cache``."""
        user = getattr(self, "user_cache_flags", None)
        if cfg is None or not user or not any(bool(v) for v in user.values()) or cache_asked(cfg):
            return
        if getattr(self, "_forward_takes_use_cache", None) is None:
            import inspect
            params = inspect.signature(self.model.forward).parameters  # a PEFT model passes **kwargs on
            self._forward_takes_use_cache = "use_cache" in params or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        if self._forward_takes_use_cache:
            kwargs["use_cache"] = True

    def note_resident_params(self) -> None:
        """Record the version counters (bumped only by in-place writes through them) of the resident
        parameters and of the decoder layers' placeholder parameters, and the resident ones' storage."""
        if self.resident is not None:
            self._resident_versions = record_params(self.units, self.resident)

    def check_resident_params(self, where: str, overwritten=()) -> None:
        """Raise if a parameter was written in place since wrap, given new storage or replaced
        (:func:`.param_checks.check_params`; ``overwritten``: names a ``model.load_state_dict`` is about to write).

        Raises:
            RuntimeError: one line naming the parameters, ``where`` it was seen and how to set weights instead.
        """
        recorded = getattr(self, "_resident_versions", None)
        if self.resident is None or recorded is None:  # (not before wrap has finished)
            return
        check_params(recorded, where, overwritten, self.compute_dtype)

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
        """Raise ``RuntimeError`` if a parameter frozen at wrap time was unfrozen (it has no fp32 state to train)."""
        refuse_unfrozen(self.units)

    def begin_forward(self, kwargs=None) -> None:
        """At each forward of the wrapped model: the checks of what changed since wrap, then the resident load.

        Raises:
            ModelInUseError: another thread is running a forward or backward of this model (or holds
                the graph of a forward whose backward has not finished): one line, before anything
                is touched (:mod:`.thread_guard`).
            UnsupportedModelError: the MoE router logits were asked for (``output_router_logits``).
            RuntimeError: the model was closed (``close()``); the CPU worker (or the disk tier) failed
                earlier: the sticky failure, first
                (the state may be partly updated; whatever thread asks).
            ValueError: with autograd on, a param group of the optimizer no update can run with.
        """
        self.check_failed()  # before the thread guard: a failed backward may still hold its graph
        if self.worker.closed:
            raise RuntimeError("megatrain: this model was closed (model.megatrain.close()) and cannot run a forward "
                               "any more; wrap a new model (and load the last checkpoint into it) to go on")
        if torch.is_grad_enabled() and self.optimizer is not None:
            self.optimizer.check_param_groups()  # without max_grad_norm this backward starts the updates
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
        elif kwargs is not None and kwargs.get("use_cache") is None:
            self._cache_as_the_user_set(kwargs, cfg)
        self.check_frozen()
        self.check_resident_params("the forward")
        masters = getattr(self, "masters", None)
        if masters is not None:
            masters.take_writes()  # writes into model.state_dict()'s tensors reach the compute copy
        self._timeline_step_begin()  # before the resident load (it waits for the last step's update)
        self.policy.begin_forward()
        if self.resident is not None:
            self._hook_resident_grads()
        if self.disk is not None:
            self.disk_read_ahead()
        self.load_resident()
        self.replanner.begin_forward()

    def disk_read_ahead(self) -> None:
        """With eager updates: read the disk layers the coming backward updates first, once no update of
        the last step still waits for the disk (at the forward's start, or when it reaches the disk layers)."""
        opt = self.optimizer
        self.disk.on_forward(eager=self.eager_updates and opt is not None and opt.max_grad_norm is None)
