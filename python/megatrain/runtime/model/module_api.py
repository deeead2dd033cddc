"""The ``nn.Module`` surface of a wrapped model: ``state_dict``, ``load_state_dict``, ``save_pretrained``,
``clip_grad_norm_``, pickling.

A wrapped model's decoder-layer parameters are meta-device placeholders and its resident
parameters are views of a device buffer holding the compute copy; the authoritative weights are
the fp32 master weights in the host store. This module makes the ordinary calls of a training
script read and write those masters:

* ``model.state_dict()`` (and any submodule's): the parameters are zero-copy fp32 CPU views of the
  host store's master section (no copy of the model in RAM; tied parameters are one tensor under
  every name, as torch gives them); buffers are torch's. As torch's, a held one reads the current
  weights after later steps: the CPU Adam writes the host store, and ``optimizer.step()`` copies
  the new masters of the device-state layers whose tensors are alive there
  (:meth:`.state_dict_views._Masters.held_units`). An in-place write into one reaches the compute
  copy at the next forward, a device-state layer's before its next update
  (:meth:`.state_dict_views._Masters.take_writes`). The layers whose fp32 state is on disk
  (``wrap(offload_dir=...)``) give fp32 copies read from the disk tier.
  A frozen parameter (``requires_grad=False`` at wrap: no master) gives its compute copy: with an
  fp32 compute copy a zero-copy view of it (a write reaches the next forward, as above); with a
  bf16 one an fp32 copy, and a write into that copy raises at the next forward (or, for a
  device-state layer, the next ``step()``), naming ``load_state_dict``.
* ``model.load_state_dict(sd, strict=..., assign=False)``: torch's own loading (dtype conversion,
  shape checks, ``_IncompatibleKeys`` return value, error messages) copies each parameter straight
  into its master (a frozen one: into its compute copy, converted to the compute dtype); the
  compute copy (and the resident device buffer, the device-state layers' state) is then rebuilt
  from the masters. On the model itself the strict key check and the shape checks run before
  anything is written, so a refused load changes nothing.
* ``model.save_pretrained(dir, ...)``: transformers' own ``save_pretrained`` (its arguments, its
  sharding and tied-weight handling) over that state dict, with each safetensors shard written
  tensor by tensor straight from the host store (no shard-sized copy in RAM, :mod:`...state.save_pretrained`); ``config.json``
  records ``dtype: float32`` (the masters' dtype) and ``use_cache: true``.
* ``torch.nn.utils.clip_grad_norm_`` over a wrapped model's parameters: the exact global norm
  from the engine's per-parameter squared norms, and the clip coefficient applied inside the
  next ``CPUAdamW.step()`` (:func:`megatrain.runtime.compat.clip_grad.clip_grad_norm_`, installed at the first ``wrap``).
* ``torch.save(model)`` / ``copy.deepcopy(model)``: refused with one line naming what to use; so are
  casts and moves of the resident weights, PEFT's merges and embedding resizes (:mod:`.module_guards`).

Every read waits for the CPU updates in flight and copies the device-state layers' state to the host
store first (``engine.sync_host()``); every write refreshes them after (``engine.host_written()``).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Mapping
from typing import Dict, List, Tuple

import torch
from torch import nn

from .module_guards import (_install_cast_guard, _install_grad_hook_guard, _install_peft_merge_guard,
                            _install_resize_guard)
from ...state.save_pretrained import _save_pretrained
from .state_dict_views import _compute_from_masters, _Masters


_PICKLE_MSG = ("megatrain: a model wrapped by megatrain.wrap cannot be pickled (torch.save(model), copy.deepcopy): its "
               "weights live in megatrain's host store. Save with torch.save(model.state_dict(), path) (fp32 master "
               "weights), model.save_pretrained(dir), or megatrain.save_checkpoint(dir, model, optimizer, scheduler) "
               "to resume training")


def refuse_pickle(protocol):
    """The wrapped engine's ``__reduce_ex__``: it holds a host store and a worker thread.

    Raises:
        TypeError: always (one line naming what to save instead).
    """
    raise TypeError(_PICKLE_MSG)


# ---------------------------------------------------------------------------- state_dict
def _owned(eng) -> Dict[int, List[Tuple[str, object, int]]]:
    """id(module) -> [(attribute, unit, entry index)] for every module holding a parameter of ``eng``."""
    out: Dict[int, list] = {}
    for u in eng.units:
        for i, e in enumerate(u.entries):
            for mod, attr in e.owners:
                out.setdefault(id(mod), []).append((attr, u, i))
    return out


class ModuleApi:
    """The ``state_dict`` / ``load_state_dict`` / ``save_pretrained`` surface of a wrapped model (the
    ``module_api`` part of its engine; see the module docstring), installed on ``model`` here.

    Args:
        engine: the model's :class:`~.wrapped_engine.WrappedEngine` (``model.megatrain``, already set).
        model: the wrapped model.

    ``masters``: the fp32 master views ``state_dict()`` hands out (:class:`~.state_dict_views._Masters`).
    """

    def __init__(self, engine, model: nn.Module):
        self.engine = engine
        self.masters = _Masters(engine)
        self._owned = _owned(engine)
        self._loading = threading.local()
        self._hook_modules(model)
        object.__setattr__(model, "load_state_dict", types.MethodType(self._load_state_dict_method(), model))
        _install_cast_guard(engine, model)
        _install_peft_merge_guard(model)
        _install_resize_guard(model)
        _install_grad_hook_guard(engine)
        _install_zero_grad(engine, model)
        if hasattr(model, "save_pretrained"):
            object.__setattr__(model, "save_pretrained", types.MethodType(_save_pretrained, model))
        _engine_first(model)

    def _hook_modules(self, model: nn.Module) -> None:
        """The state_dict / load hooks of every module that holds a parameter of the engine, and the model's reload."""
        eng, masters, owned, loading = self.engine, self.masters, self._owned, self._loading
        # Checks first: whichever module load_state_dict is called on (prefix "") validates before any
        # write (registered before the owners' hooks, so it runs before their swap).
        for m in model.modules():
            m.register_load_state_dict_pre_hook(_make_load_check_hook(eng, loading, owned))
        mods = {id(m): m for m in model.modules()}
        for mid, items in owned.items():
            mod = mods.get(mid)
            if mod is None:
                continue
            mod.register_state_dict_post_hook(_make_sd_hook(eng, masters, items, loading))
            mod.register_load_state_dict_pre_hook(_make_load_pre_hook(masters, items, loading))
            mod.register_load_state_dict_post_hook(_make_load_post_hook(eng, masters, items))

        def reloaded(m, incompatible) -> None:
            masters.note_loaded()
            eng.load_resident()
            eng.note_resident_params()

        model.register_load_state_dict_post_hook(reloaded)

    def _load(self, module, state_dict, strict, assign, mode="write"):
        """``nn.Module.load_state_dict`` of ``module`` through the hooks (``mode``: "write", or "buffers":
        a data-parallel rank that does not write the shared store)."""
        eng, loading = self.engine, self._loading
        # a resident parameter written in place since wrap: fine when this load replaces it, else refused
        eng.check_resident_params("model.load_state_dict", overwritten=set(state_dict.keys()))
        eng.note_resident_params()
        loading.strict = bool(strict) if mode == "write" else None
        loading.mode = mode
        try:
            return nn.Module.load_state_dict(module, state_dict, strict=strict, assign=assign)
        finally:
            loading.strict = None
            loading.mode = None
            _restore_placeholders(eng, self.masters, [(mod, attr, u, i) for u in eng.units
                                                      for i, e in enumerate(u.entries) for mod, attr in e.owners])

    def _load_state_dict_method(self):
        """The model's ``load_state_dict`` (a function bound to the model)."""
        eng, load = self.engine, self._load

        def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
            """``nn.Module.load_state_dict`` into the fp32 master weights (checks run before any write).

            Data parallel: a collective call (every rank calls it with the same ``state_dict``, at the
            same point; see :mod:`megatrain.runtime.data_parallel.calls`): each node's local rank 0
            writes the node's shared store, every rank loads its own buffers and reloads its device copies.
            """
            if not isinstance(state_dict, Mapping):  # torch's check, before megatrain's read the keys
                raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
            dp = getattr(eng, "dp", None)
            if dp is None:
                return load(self, state_dict, strict, assign)
            from ..data_parallel.calls import fingerprint

            with dp.collective("model.load_state_dict", f"{fingerprint(dict(state_dict))} strict={bool(strict)} "
                                                        f"assign={bool(assign)}"):
                eng.sync_host()
                out = dp.on_local0(lambda: load(self, state_dict, strict, assign), "model.load_state_dict")
                if not dp.fills_store:  # the store is written: this rank's buffers, and its device copies anew
                    params = {n for n, _ in self.named_parameters(remove_duplicate=False)}
                    load(self, {k: v for k, v in state_dict.items() if k not in params}, False, False, mode="buffers")
                    eng.invalidate(eng.units)
                    eng.load_resident()
                return out
        return load_state_dict


def _install_zero_grad(eng, model: nn.Module) -> None:
    """``model.zero_grad(set_to_none=...)`` also drops the gradients held in the host store (the optimizer's
    ``zero_grad``, or the engine's before any CPUAdamW exists): torch's drops every parameter's ``.grad``, but a
    wrapped model's decoder-layer gradients never reach ``.grad``, so the next ``step()`` would sum them in."""
    plain = model.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        opt = eng.optimizer
        if opt is not None:
            opt.zero_grad(set_to_none=set_to_none)
        elif not eng.worker.closed:
            eng.zero_grad()
        plain(set_to_none=set_to_none)

    object.__setattr__(model, "zero_grad", zero_grad)


def _engine_first(model: nn.Module) -> None:
    """Pickling walks the model's __dict__ in order: the engine goes first, so its refusal is the
    error a user sees (not one about a hook's lambda further down)."""
    d = model.__dict__
    eng_ref = d.pop("megatrain")
    rest = dict(d)
    d.clear()
    d["megatrain"] = eng_ref
    d.update(rest)


def _make_sd_hook(eng, masters, items, loading):
    def hook(module, state_dict, prefix, local_metadata):
        if getattr(loading, "shapes_only", False):
            return  # a load's shape check: the placeholders have the shapes (no copy, no disk read)
        eng.sync_host()
        for attr, u, i in items:
            key = prefix + attr
            if key in state_dict:
                state_dict[key] = masters.get(u, i)
    return hook


def _expected(module, loading) -> dict:
    """key -> shape of what ``module.state_dict()`` holds (parameters: the masters' shapes, read from
    the placeholders: no fp32 copy of a frozen bf16 entry, no read of a disk unit's masters)."""
    loading.shapes_only = True
    try:
        return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    finally:
        loading.shapes_only = False


def _refuse_load_after_eager_updates(eng, module, state_dict, owned) -> None:
    """Without ``max_grad_norm`` a host-stored layer's update runs during backward: a load between
    ``backward()`` and ``step()`` would replace the updated weights (torch updates the loaded ones).
    Refused before anything is written, as a write through a ``state_dict()`` tensor there is."""
    flags = {}
    for name, mod in module.named_modules():
        for attr, u, i in owned.get(id(mod), ()):
            if u.device_state is not None or (name + "." if name else "") + attr not in state_dict:
                continue
            if u.index not in flags:
                flags[u.index] = u.eager  # one ledger read per unit
            if flags[u.index][i]:
                raise RuntimeError(
                    f"megatrain: load_state_dict between backward() and optimizer.step(): without max_grad_norm the "
                    f"update of {u.entries[i].name} already ran during backward(), so the load would replace the "
                    "updated weights (torch would update the loaded ones). Load before backward() or after step() "
                    "(or optimizer.zero_grad() first), or set max_grad_norm (updates then wait for step())")


def _make_load_check_hook(eng, loading, owned):
    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if prefix != "":
            return
        mode = getattr(loading, "mode", None)
        if mode == "buffers":
            return  # data parallel: the store's writer checked this very state dict
        if mode is None and getattr(eng, "dp", None) is not None:
            raise RuntimeError("megatrain data parallel: load_state_dict on a part of a wrapped model (or through "
                               "nn.Module.load_state_dict) would write the shared host store from this rank alone; "
                               "call model.load_state_dict(...) on the wrapped model itself, on every rank")
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("megatrain: load_state_dict(assign=True) cannot replace the parameters of a model wrapped by "
                             "megatrain.wrap (its weights live in the host store); use assign=False: the values are "
                             "copied into the fp32 master weights")
        eng.sync_host()
        strict_now = getattr(loading, "strict", None)
        want = _expected(module, loading)
        msgs = []
        if strict_now:
            miss = [k for k in want if k not in state_dict]
            unexp = [k for k in state_dict if k not in want]
            if miss:
                msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in miss)))
            if unexp:
                msgs.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexp)))
        for k, shape in want.items():
            if k not in state_dict:
                continue
            v = state_dict[k]
            if not torch.overrides.is_tensor_like(v):
                msgs.append(f'While copying the parameter named "{k}", expected torch.Tensor or Tensor-like object '
                            f"from checkpoint but received {type(v)}")
                continue
            vs = tuple(v.shape)
            if vs != shape and not (len(shape) == 0 and len(vs) == 1):
                msgs.append(f"size mismatch for {k}: copying a param with shape {v.shape} from checkpoint, the shape "
                            f"in current model is {torch.Size(shape)}.")
        if msgs:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                module.__class__.__name__, "\n\t".join(msgs)))
        _refuse_load_after_eager_updates(eng, module, state_dict, owned)
    return hook


def _make_load_pre_hook(masters, items, loading):
    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if getattr(loading, "mode", None) == "buffers":
            return  # data parallel, not the store's writer: the parameters stay as they are
        # torch's own _load_from_state_dict then copies each value straight into its master. Only the
        # entries this state dict holds: the others stay untouched (for a frozen bf16 entry or a disk
        # unit, for_load makes a copy; an adapter-only load must not copy the whole frozen base).
        for attr, u, i in items:
            if prefix + attr in state_dict:
                module._parameters[attr] = masters.for_load(u, i)
    return hook


def _make_load_post_hook(eng, masters, items):
    def hook(module, incompatible):
        _restore_placeholders(eng, masters, [(module, attr, u, i) for attr, u, i in items])
    return hook


def _restore_placeholders(eng, masters, where) -> None:
    """Put the placeholders back where a load swapped in the masters; rebuild those entries' compute copy
    (a frozen entry's copy loaded into: converted into its compute copy)."""
    units = {}
    for mod, attr, u, i in where:
        e = u.entries[i]
        if mod._parameters.get(attr) is not e.param:
            mod._parameters[attr] = e.param
            units.setdefault(u.index, (u, set()))[1].add(i)
    with torch.no_grad():
        for u, idx in units.values():
            loaded = masters.take_loaded(u, idx)
            # a disk unit: its masters written back through the tier
            with eng.state_window(write=any(name == "master" for _, name in loaded)):
                for (i, name), t in loaded.items():
                    eng.entry_view(u, i, name).copy_(t)
                _compute_from_masters(eng, [(u, idx)], refresh_device=False)
    eng.host_written([u for u, _ in units.values()])  # device-state layers take the loaded masters
