"""The fp32 master weights that ``model.state_dict()`` hands out for a wrapped model, and the writes
made through them.

:class:`_Masters` (the engine's ``masters``) owns the handed-out tensors: a cached zero-copy view of
each entry's host-store master, the weak references to the tensors handed out and their version
counters, and the copies handed out where no lasting view exists (a disk-tier unit's masters, a
frozen entry's bf16 compute copy). It tells which units hold a tensor alive (refreshed after each
step), picks up in-place writes into them (before each forward and each device-state update) and
refuses the ones that cannot be applied, and gives ``load_state_dict`` the tensors it copies into.
:func:`_compute_from_masters` rebuilds the compute copies from changed masters.

The hooks that put these tensors into ``state_dict`` / ``load_state_dict`` are
:class:`megatrain.runtime.model.module_api.ModuleApi`'s.
"""

from __future__ import annotations

import weakref

import torch

from ..placement.device_tier import is_exclusive


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

    A unit whose fp32 state is in the disk tier, or on the device only (an exclusive device-state
    layer), has no lasting view: :meth:`get` reads a copy (tracked like a frozen bf16 entry's, below:
    a write into it is refused, not lost), and
    :meth:`for_load` hands torch's load a copy that :func:`.module_api._restore_placeholders` writes
    back.

    A frozen entry has no master: its value is its compute copy. An fp32 compute copy is handed out
    as the masters are (a cached view, its writes taken by :meth:`take_writes`); a bf16 one as an
    fp32 copy, tracked by a weak reference with its version counter (:attr:`_copies`): a write into
    it cannot reach the store, and :meth:`take_writes` refuses it. Its loads go through an fp32
    copy too (:meth:`for_load`), converted into the compute copy by
    :func:`.module_api._restore_placeholders`.
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
            elif self.eng.state_tier(u) is not None:  # on disk / on the device only: a copy, read now
                out = self.eng.state_tier(u).read(u, i, "master")
                # tracked: a write into it is refused (take_writes), not lost
                live = [(r, ver) for r, ver in self._copies.get(key, ()) if r() is not None]
                self._copies[key] = live + [(weakref.ref(out), out._version)]
                return out
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
                if not e.frozen:  # the master of an exclusive device-state layer or a disk-tier layer (get)
                    where = "lives on the device only (an exclusive device-state layer, placed there because host " \
                        "memory is short)" if is_exclusive(self.eng.units[key[0]]) else "is in the disk tier (offload_dir)"
                    raise RuntimeError(
                        f"megatrain: {e.name} was written in place through a model.state_dict() tensor, but its layer's "
                        f"fp32 state {where}: that tensor is a copy, and the write was not applied. Set it with "
                        f"model.load_state_dict({{{e.name!r}: value}}, strict=False)")
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
        if frozen and self.eng.compute_dtype == torch.float32 or not frozen and self.eng.state_tier(u) is None:
            return self.get(u, i)
        key = (u.index, i)
        if key not in self._loading:
            if frozen:
                self._loading[key] = ("compute", self.eng.entry_view(u, i, "compute").float())
            else:
                self._loading[key] = ("master", self.eng.state_tier(u).read(u, i, "master"))
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


@torch.no_grad()
def _compute_from_masters(eng, written, refresh_device: bool = True) -> None:
    """The masters of ``written`` (``(unit, entry indices)`` pairs) changed: rebuild those entries'
    compute copies (not where a direct gradient is held: the update rebuilds it from the master; not
    a frozen entry's: its compute copy is what was written), make the device copies reload
    (``invalidate``), and (``refresh_device``) hand the device-state units their new state (``host_written``)."""
    written = list(written)
    for u, idx in written:
        for i in sorted(idx):
            if not u.entries[i].frozen and not u.compute_absent and not u.direct[i]:  # absent: cast at load
                eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))
        eng.invalidate([u])  # device slots / the resident buffer reload from the new compute copy
    if refresh_device:
        eng.host_written([u for u, _ in written])
