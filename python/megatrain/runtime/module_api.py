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
  (:meth:`_Masters.held_units`). An in-place write into one reaches the compute copy at the next
  forward, a device-state layer's before its next update (:meth:`_Masters.take_writes`). The layers
  whose fp32 state is on disk (``wrap(offload_dir=...)``) give fp32 copies read from the disk tier.
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
  tensor by tensor straight from the host store (no shard-sized copy in RAM, :mod:`.save_pretrained`); ``config.json``
  records ``dtype: float32`` (the masters' dtype) and ``use_cache: true``.
* ``torch.nn.utils.clip_grad_norm_`` over a wrapped model's parameters: the exact global norm
  from the engine's per-parameter squared norms, and the clip coefficient applied inside the
  next ``CPUAdamW.step()`` (:func:`megatrain.runtime.clip_grad.clip_grad_norm_`, installed at import).
* ``torch.save(model)`` / ``copy.deepcopy(model)``: refused with one line naming what to use; so are
  casts and moves of the resident weights, PEFT's merges and embedding resizes (:mod:`.module_guards`).

Every read waits for the CPU updates in flight and copies the device-state layers' state to the host
store first (``engine.sync_host()``); every write refreshes them after (``engine.host_written()``).
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import Dict, List, Tuple

import torch
from torch import nn

from .module_guards import _install_cast_guard, _install_peft_merge_guard, _install_resize_guard
from .save_pretrained import _save_pretrained


_PICKLE_MSG = ("megatrain: a model wrapped by megatrain.wrap cannot be pickled (torch.save(model), copy.deepcopy): its "
               "weights live in megatrain's host store. Save with torch.save(model.state_dict(), path) (fp32 master "
               "weights), model.save_pretrained(dir), or megatrain.save_checkpoint(dir, model, optimizer, scheduler) "
               "to resume training")


class EngineModuleApi:
    """Mixed into the wrapped engine: refuses pickling (it holds a host store and a worker thread)."""

    def __reduce_ex__(self, protocol):
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


class _Masters:
    """The fp32 master weights that ``model.state_dict()`` hands out, and the writes made through them.

    Each entry's master has one cached zero-copy view of the host store (:attr:`_views`, kept: it is
    store memory, and its version counter records the writes). The tensor handed out is a
    ``detach()`` of it (the same memory and version counter, the same tensor for tied names while it
    is alive), tracked by a weak reference only: a dropped state dict leaves nothing behind, and
    :meth:`held_units` tells which units still have one alive (held, or viewed by a tensor held).
    After an optimizer step the engine copies the new masters of the device-state units among
    those into the host store (``refresh_state_dict_views``), so a held tensor reads the current
    weights as torch's do; the other device-state units' host masters are refreshed when read.

    A unit whose fp32 state is in the disk tier has no lasting view: :meth:`get` reads a copy, and
    :meth:`for_load` hands torch's load a copy that :func:`_restore_placeholders` writes back.

    A frozen entry has no master: its value is its compute copy. An fp32 compute copy is handed out
    as the masters are (a cached view, its writes taken by :meth:`take_writes`); a bf16 one as an
    fp32 copy, tracked by a weak reference with its version counter (:attr:`_copies`): a write into
    it cannot reach the store, and :meth:`take_writes` refuses it. Its loads go through an fp32
    copy too (:meth:`for_load`), converted into the compute copy by :func:`_restore_placeholders`.
    """

    def __init__(self, eng):
        self.eng = eng
        self._views: dict = {}  # (unit index, entry) -> zero-copy view of the entry's host master
        self._handed: dict = {}  # (unit index, entry) -> weakref to the tensor handed out (a detach() of the view)
        self._seen: dict = {}  # (unit index, entry) -> the view's version counter when last handed out / checked
        self._loading: dict = {}  # (unit index, entry) -> (section, the copy a load writes into): disk / bf16 frozen
        self._copies: dict = {}  # (unit index, entry) -> [(weakref, version)] of a frozen entry's handed-out fp32 copies

    def get(self, u, i) -> torch.Tensor:
        key = (u.index, i)
        v = self._views.get(key)
        if v is None:
            if u.entries[i].frozen:  # no fp32 sections: its compute copy is its value
                v = self.eng.entry_view(u, i, "compute")
                if v.dtype != torch.float32:  # a copy, tracked: a write into it is refused (take_writes)
                    out = v.float()
                    live = [(r, ver) for r, ver in self._copies.get(key, ()) if r() is not None]
                    self._copies[key] = live + [(weakref.ref(out), out._version)]
                    return out
            elif u.disk is not None:  # on disk: a copy, read now
                return self.eng.disk.read(u, i, "master")
            else:
                v = self.eng.entry_view(u, i, "master")
            self._views[key] = v
        self._seen.setdefault(key, v._version)
        ref = self._handed.get(key)
        out = ref() if ref is not None else None
        if out is None:
            out = v.detach()  # shares the view's memory and version counter; not kept alive here
            self._handed[key] = weakref.ref(out)
        return out

    def held_units(self, units) -> list:
        """Those of ``units`` with a handed-out master tensor alive (forgets the dead references; a frozen
        entry's tensor does not count: a step does not change it)."""
        want = {u.index: u for u in units}
        held: dict = {}
        for key, ref in list(self._handed.items()):
            if ref() is None:
                del self._handed[key]
            elif key[0] in want and not want[key[0]].entries[key[1]].frozen:
                held[key[0]] = want[key[0]]
        return list(held.values())

    def _changed(self, only=None) -> dict:
        """``{unit index: (unit, [entry])}`` of the entries written through a handed-out tensor since the
        writes were last taken (their view's version counter moved); ``only``: unit indices (None: all)."""
        found: dict = {}
        for key, ver in self._seen.items():
            if (only is None or key[0] in only) and self._views[key]._version != ver:
                u = self.eng.units[key[0]]
                found.setdefault(key[0], (u, []))[1].append(key[1])
        return found

    def written(self, units, only=None) -> list:
        """``(unit, entry names)`` of those of ``units`` whose trainable entries were written through a
        handed-out master tensor since the writes were last taken (:meth:`take_writes`; a frozen
        entry has no update a write could race). ``only(unit, entry)``: count only those entries."""
        out = []
        for u, idx in self._changed({u.index for u in units}).values():
            names = [u.entries[i].name for i in idx if not u.entries[i].frozen and (only is None or only(u, i))]
            if names:
                out.append((u, names))
        return out

    def note_loaded(self) -> None:
        """A load wrote through the views (and rebuilt the compute copies): nothing left to pick up (a write
        into a frozen entry's handed-out copy before it is superseded by the load)."""
        for key in self._seen:
            self._seen[key] = self._views[key]._version
        self._copies = {key: [(r, r()._version) for r, _ in refs if r() is not None]
                        for key, refs in self._copies.items()}
        self._copies = {key: refs for key, refs in self._copies.items() if refs}

    def take_writes(self, units=None) -> None:
        """Pick up in-place writes into handed-out master tensors (``model.state_dict()[k].copy_(...)``, as
        torch's state_dict tensors are the parameters): rebuild those entries' compute copies, and hand
        the device-state units their written masters (``host_written``).

        Called before each forward, and by the optimizer's ``step()`` for the device-state units
        (``units``; default: every unit) before their update. The view's version counter moves only
        with writes through the handed-out tensors (the CPU Adam and the copies from the device write
        the store directly). A device-state unit updated since its host master was last refreshed
        cannot take a write (the tensor written holds an older master): refused. A held tensor is
        refreshed after each step (:meth:`held_units`), so this is a tensor that was not alive then
        (e.g. a ``.detach()`` of a state_dict tensor, kept after the state dict was dropped).

        A frozen entry's write (into its fp32 compute copy, the tensor handed out) needs no master:
        its unit's device copies reload it (``invalidate``, ``host_written``). A write into a frozen
        entry's fp32 copy of a bf16 compute copy is refused, before any write is taken.

        Raises:
            RuntimeError: such a device-state unit was written through a tensor holding an older master;
                a frozen entry's copy (bf16 compute copy) was written.
        """
        only = None if units is None else {u.index for u in units}
        self._refuse_copy_writes(only)
        written = self._changed(only)
        if not written:
            return
        for u, idx in written.values():
            trained = [i for i in idx if not u.entries[i].frozen]  # a frozen entry's value does not age
            if trained and u.device_state is not None and u.device_state.host_master_stale:
                raise RuntimeError(
                    f"megatrain: {u.entries[trained[0]].name} was written through a state_dict() tensor holding an older "
                    "master than the last optimizer step's, and its state is on the device (device_state_layers): "
                    "only the state_dict() tensors alive through a step are refreshed by it (not a .detach() of one "
                    "kept after the state dict was dropped). Write through a tensor of a state dict kept alive, or "
                    "of a new model.state_dict(), or use model.load_state_dict")
        on_device = [u for u, _ in written.values() if u.device_state is not None]
        if on_device:  # their other sections to the host store (the written masters stay): host_written() reloads all
            self.eng.sync_host(on_device)
        for u, idx in written.values():
            self.eng.wait_update(u)
            for i in idx:
                self._seen[(u.index, i)] = self._views[(u.index, i)]._version
        _compute_from_masters(self.eng, written.values())

    def _refuse_copy_writes(self, only) -> None:
        """Raise if a frozen entry's handed-out fp32 copy (of a bf16 compute copy) of the units ``only``
        (None: all) was written in place; that copy is forgotten (the error is raised once)."""
        for key, refs in list(self._copies.items()):
            live = [(r, ver) for r, ver in refs if r() is not None]
            self._copies[key] = live
            if not live:
                del self._copies[key]
                continue
            if only is not None and key[0] not in only:
                continue
            if any(r()._version != ver for r, ver in live):
                self._copies[key] = [(r, ver) for r, ver in live if r()._version == ver]
                e = self.eng.units[key[0]].entries[key[1]]
                dt = str(self.eng.compute_dtype).replace("torch.", "")
                raise RuntimeError(
                    f"megatrain: {e.name} was written in place through a model.state_dict() tensor, but it is frozen "
                    f"(requires_grad=False at megatrain.wrap) and its only copy in the host store is {dt}: that tensor "
                    f"is an fp32 copy, and the write was not applied. Set it with model.load_state_dict(...) (it "
                    f"converts the value to {dt})")

    def for_load(self, u, i) -> torch.Tensor:
        """The tensor ``load_state_dict`` copies entry ``i`` of ``u`` into (its current value): the master
        view, or a copy that :meth:`take_loaded` hands back (a disk unit's master, a frozen entry's
        bf16 compute copy)."""
        frozen = u.entries[i].frozen
        if frozen and self.eng.compute_dtype == torch.float32 or not frozen and u.disk is None:
            return self.get(u, i)
        key = (u.index, i)
        if key not in self._loading:
            if frozen:
                self._loading[key] = ("compute", self.eng.entry_view(u, i, "compute").float())
            else:
                self._loading[key] = ("master", self.eng.disk.read(u, i, "master"))
        return self._loading[key][1]

    def take_loaded(self, u, idx) -> dict:
        """``{(entry, section): tensor}`` that a load wrote for ``u``'s entries ``idx`` through copies
        (:meth:`for_load`; forgotten here)."""
        out = {}
        for i in idx:
            got = self._loading.pop((u.index, i), None)
            if got is not None:
                out[(i, got[0])] = got[1]
        return out


def install(eng, model: nn.Module) -> None:
    """Give ``model`` (wrapped, engine ``eng``) the state_dict / load_state_dict / save_pretrained surface."""
    masters = _Masters(eng)
    eng.masters = masters
    owned = _owned(eng)
    loading = threading.local()
    # Checks first: whichever module load_state_dict is called on (prefix "") validates before any
    # write (registered before the owners' hooks, so it runs before their swap).
    for m in model.modules():
        m.register_load_state_dict_pre_hook(_make_load_check_hook(eng, loading))
    mods = {id(m): m for m in model.modules()}
    for mid, items in owned.items():
        mod = mods.get(mid)
        if mod is None:
            continue
        mod.register_state_dict_post_hook(_make_sd_hook(eng, masters, items))
        mod.register_load_state_dict_pre_hook(_make_load_pre_hook(masters, items, loading))
        mod.register_load_state_dict_post_hook(_make_load_post_hook(eng, items))
    def reloaded(m, incompatible) -> None:
        masters.note_loaded()
        eng.load_resident()
        eng.note_resident_params()

    model.register_load_state_dict_post_hook(reloaded)

    def load(module, state_dict, strict, assign, mode="write"):
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
            _restore_placeholders(eng, [(mod, attr, u, i) for u in eng.units for i, e in enumerate(u.entries)
                                        for mod, attr in e.owners])

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into the fp32 master weights (checks run before any write).

        Data parallel: a collective call (every rank calls it with the same ``state_dict``, at the
        same point; see :mod:`megatrain.runtime.data_parallel.calls`): each node's local rank 0
        writes the node's shared store, every rank loads its own buffers and reloads its device copies.
        """
        dp = getattr(eng, "dp", None)
        if dp is None:
            return load(self, state_dict, strict, assign)
        from .data_parallel.calls import fingerprint

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

    object.__setattr__(model, "load_state_dict", types.MethodType(load_state_dict, model))
    _install_cast_guard(eng, model)
    _install_peft_merge_guard(model)
    _install_resize_guard(model)
    if hasattr(model, "save_pretrained"):
        object.__setattr__(model, "save_pretrained", types.MethodType(_save_pretrained, model))
    # Pickling walks the model's __dict__ in order: the engine goes first, so its refusal is the
    # error a user sees (not one about a hook's lambda further down).
    d = model.__dict__
    eng_ref = d.pop("megatrain")
    rest = dict(d)
    d.clear()
    d["megatrain"] = eng_ref
    d.update(rest)


def _make_sd_hook(eng, masters, items):
    def hook(module, state_dict, prefix, local_metadata):
        eng.sync_host()
        for attr, u, i in items:
            key = prefix + attr
            if key in state_dict:
                state_dict[key] = masters.get(u, i)
    return hook


def _expected(module) -> dict:
    """key -> shape of what ``module.state_dict()`` holds (parameters: the masters' shapes)."""
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def _make_load_check_hook(eng, loading):
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
        want = _expected(module)
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
    return hook


def _make_load_pre_hook(masters, items, loading):
    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if getattr(loading, "mode", None) == "buffers":
            return  # data parallel, not the store's writer: the parameters stay as they are
        # torch's own _load_from_state_dict then copies each value straight into its master.
        for attr, u, i in items:
            module._parameters[attr] = masters.for_load(u, i)
    return hook


def _make_load_post_hook(eng, items):
    def hook(module, incompatible):
        _restore_placeholders(eng, [(module, attr, u, i) for attr, u, i in items])
    return hook


def _restore_placeholders(eng, where) -> None:
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
            loaded = eng.masters.take_loaded(u, idx)
            # a disk unit: its masters written back through the tier
            with eng.state_window(write=any(name == "master" for _, name in loaded)):
                for (i, name), t in loaded.items():
                    eng.entry_view(u, i, name).copy_(t)
                _compute_from_masters(eng, [(u, idx)], refresh_device=False)
    eng.host_written([u for u, _ in units.values()])  # device-state layers take the loaded masters


@torch.no_grad()
def _compute_from_masters(eng, written, refresh_device: bool = True) -> None:
    """The masters of ``written`` (``(unit, entry indices)`` pairs) changed: rebuild those entries'
    compute copies (not where a direct gradient is held: the update rebuilds it from the master; not
    a frozen entry's: its compute copy is what was written), make the device copies reload
    (``invalidate``), and (``refresh_device``) hand the device-state units their new state (``host_written``)."""
    written = list(written)
    for u, idx in written:
        for i in sorted(idx):
            if not u.entries[i].frozen and not u.direct[i]:
                eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))
        eng.invalidate([u])  # device slots / the resident buffer reload from the new compute copy
    if refresh_device:
        eng.host_written([u for u, _ in written])
