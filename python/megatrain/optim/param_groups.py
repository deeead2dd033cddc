"""Param groups and state of :class:`~megatrain.optim.CPUAdamW`: ``add_param_group``, ``optimizer.state``,
``state_dict`` / ``load_state_dict``, a replacing optimizer's fresh moments, and writes through the
``exp_avg`` / ``exp_avg_sq`` tensors handed out.

:class:`ParamGroups` is mixed into ``CPUAdamW`` (before ``torch.optim.Optimizer``); it reaches the
engine only through the optimizer's :class:`~megatrain.runtime.engine.optimizer_port.OptimizerPort`
(``self._port``), built from the engine of the first parameter added.
"""

from __future__ import annotations

import torch

from ..runtime.engine.core import locate
from ..runtime.engine.optimizer_port import MOMENTS, OptimizerPort
from .hyperparams import check_hyper, check_options
from .param_state import ParamState, TierCopies, TierValue, value_of


def locate_param(p: torch.Tensor):
    """``(engine, unit, entry index)`` of a parameter of a wrapped model.

    Raises:
        TypeError: ``p`` is not a tensor.
        ValueError: ``p`` is not managed by megatrain (not wrapped, or added after wrap).
    """
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"megatrain.optim.CPUAdamW: expected parameters (tensors) or (name, parameter) pairs, got a "
                        f"{type(p).__name__}; pass model.parameters(), model.named_parameters() or groups of them")
    ref = locate(p)
    if ref is None:
        raise ValueError(
            f"megatrain.optim.CPUAdamW: got a parameter of shape {tuple(p.shape)} that megatrain does not manage; "
            "call megatrain.wrap(model) first and pass model.parameters() (or groups of them) to CPUAdamW; a parameter "
            "added to the model after wrap (e.g. by peft.get_peft_model) is not in its store: apply PEFT before "
            "megatrain.wrap, or use megatrain.from_config / from_pretrained(transform=...)")
    return ref


class ParamGroups:
    """The param-group and state half of ``CPUAdamW`` (see module docstring).

    Uses the optimizer's ``_port``, ``_entry`` (``(unit index, entry index) -> (group, param)``) and
    ``_moment_versions`` (``(unit index, entry index, moment) -> the handed-out tensor's version seen``).
    """

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``: the group's parameters are updated from the next ``step()``.

        Raises:
            ValueError: a parameter not managed by megatrain, from another wrapped model, already in
                a group or twice in this one, or an option CPUAdamW refuses (``amsgrad`` / ``maximize`` / ``differentiable``).
        """
        # a group given to the constructor is named by its index there, not as an add_param_group call
        where = f" (param group {len(self.param_groups)})" if getattr(self, "_constructing", False) else ".add_param_group"
        check_options(where, param_group)
        check_hyper(where, param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # torch >= 2.6 takes model.named_parameters(): (name, parameter) pairs, kept as the group's param_names
        params = [q[1] if isinstance(q, tuple) and len(q) == 2 and isinstance(q[0], str) else q for q in params]
        if len({id(p) for p in params}) != len(params):  # torch warns and updates it twice; it will refuse it
            raise ValueError("megatrain.optim.CPUAdamW: a param group lists a parameter more than once "
                             "(torch.optim.AdamW would update it twice per step); pass each parameter once")
        refs = [locate_param(p) for p in params]
        for eng, _, _ in refs:
            if self._port is None:
                self._port = OptimizerPort(eng)
            elif not self._port.serves(eng):
                raise ValueError("megatrain.optim.CPUAdamW: parameters come from two different wrapped models")
        super().add_param_group(param_group)  # torch's checks (duplicates, defaults)
        group = self.param_groups[-1]
        for p, (_, unit, i) in zip(group["params"], refs):
            if unit.entries[i].frozen:  # frozen at wrap: no fp32 state, never trains (torch keeps no state either)
                continue
            self._entry[(unit.index, i)] = (group, p)
            self.state[p] = self._new_state(unit, i)

    def _new_state(self, unit, i: int) -> ParamState:
        """``optimizer.state[p]`` of entry ``i`` of ``unit``: step 0 and its moments (store views, or tier reads)."""
        port = self._port
        # a read waits for the unit's update (and copies a device-state layer's state to the host store)
        if port.on_disk(unit):  # on disk: read at each access
            if getattr(self, "_tier_copies", None) is None:
                self._tier_copies = TierCopies()
            moments = {k: TierValue(lambda u=unit, i=i, k=k: port.read_state(u, i, k), unit.entries[i].name, k,
                                    self._tier_copies) for k in MOMENTS}
        else:
            moments = {k: port.state_view(unit, i, k) for k in MOMENTS}
            for k, t in moments.items():
                self._moment_versions[(unit.index, i, k)] = t._version
        return ParamState(lambda u=unit: port.sync([u], for_write=True), {"step": torch.tensor(0.0), **moments})

    def _start_fresh(self) -> None:
        """A CPUAdamW that replaces the model's earlier one starts as a new ``torch.optim.AdamW`` does:
        ``exp_avg`` / ``exp_avg_sq`` zero (its step counts are 0 already). The moments live in the
        host store, so without this they stayed the earlier optimizer's under fresh step counts (a
        notebook cell run again trained 0.25 relative away from torch within 3 steps)."""
        port = self._port
        port.sync(for_write=True)  # the earlier optimizer's updates land first
        for (ui, i), (_group, p) in self._entry.items():
            unit = locate_param(p)[1]
            if port.on_disk(unit):
                z = torch.zeros(tuple(p.shape), dtype=torch.float32)
                port.write_state(unit, {(i, "exp_avg"): z, (i, "exp_avg_sq"): z})
                continue
            st = self.state[p]
            for k in MOMENTS:
                t = dict.__getitem__(st, k)  # the host-store view handed out as optimizer.state[p][k]
                t.zero_()
                self._moment_versions[(ui, i, k)] = t._version  # megatrain's write, not the user's
        port.host_written()  # device-state layers take the zeros

    def moments_written(self, unit) -> bool:
        """Whether a tensor handed out as ``optimizer.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` of one of
        ``unit``'s parameters was written in place since the last call (its version counter moved)."""
        return bool(self._written_moments(unit))

    def _written_moments(self, unit) -> list:
        """``[(entry index, "exp_avg" | "exp_avg_sq")]`` of ``unit`` whose handed-out tensor was written in
        place since the last call (:meth:`moments_written`; the versions seen are updated)."""
        written = []
        for i in range(len(unit.entries)):
            gp = self._entry.get((unit.index, i))
            if gp is None:
                continue
            st = self.state[gp[1]]
            for k in MOMENTS:
                t = dict.get(st, k)
                if isinstance(t, torch.Tensor) and self._moment_versions.get((unit.index, i, k), 0) != t._version:
                    self._moment_versions[(unit.index, i, k)] = t._version
                    written.append((i, k))
        return written

    def _check_held_moments(self) -> None:
        """Refuse a write into ``optimizer.state[p]["exp_avg"]`` of a device-state unit through a tensor
        taken before its last update (the host copy it views was not refreshed since: the write would
        put back the older moments), before anything of this step is touched."""
        self._check_tier_copies()
        for u in self._port.units:
            written = self._written_moments(u) if self._port.device_state_clean(u) else []
            if not written:
                continue
            keys = " / ".join(f"['{k}']" for k in MOMENTS if any(w == k for _, w in written))
            names = ", ".join(dict.fromkeys(u.entries[i].name for i, _ in written))  # the parameters written
            raise RuntimeError(
                f"megatrain: optimizer.state[p]{keys} of {names} (its state is on the "
                "device) was written through a tensor taken before the last optimizer.step(); that tensor holds the "
                "moments of that time, so the write would undo the steps since. Look the tensor up again "
                "(optimizer.state[p]['exp_avg']) after each step() before writing into it")

    def _check_tier_copies(self) -> None:
        """Refuse, before anything of this step is touched, an in-place write into ``optimizer.state[p]["exp_avg"]``
        (or ``["exp_avg_sq"]``) of a parameter whose state is in the disk tier: that tensor was a copy read from
        the tier, so the write cannot take effect (it would be lost silently)."""
        copies = getattr(self, "_tier_copies", None)
        written = copies.take_written() if copies is not None else None
        if written is not None:
            raise RuntimeError(f"megatrain: optimizer.state[p]['{written[1]}'] of {written[0]} was written in place, "
                               "but its state is in the disk tier (offload_dir): that tensor is a copy read from the "
                               "tier, and the write was not applied. Set the moments with "
                               "optimizer.load_state_dict(...)")

    def state_dict(self):
        """``torch.optim.Optimizer.state_dict()`` after the updates in flight: ``exp_avg`` / ``exp_avg_sq``
        are zero-copy fp32 CPU views of the host store (plain dicts and tensors: ``torch.load(...,
        weights_only=True)`` reads them)."""
        self._port.sync()
        sd = super().state_dict()
        # (no waiting per parameter: synced above; disk units: copies read from the tier)
        sd["state"] = {k: {n: value_of(x) for n, x in dict.items(v)} for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict produced by ``state_dict()`` (same parameter order) into the host store.

        Data parallel: a collective call (every rank calls it with the same ``state_dict``, at the
        same point; :mod:`megatrain.runtime.data_parallel.calls`): each node's local rank 0 writes
        ``exp_avg`` / ``exp_avg_sq`` into the shared store, every rank sets its step counts and groups.

        Raises:
            ValueError: if the groups or state shapes do not match this optimizer's parameters.
        """
        dp = self._port.data_parallel
        if dp is None:
            return self._load_state_dict(state_dict, write_moments=True)
        from ..runtime.data_parallel.calls import fingerprint

        with dp.collective("optimizer.load_state_dict", fingerprint(state_dict)):
            self._load_state_dict(state_dict, write_moments=False)  # checks and per-rank state (same on every rank)
            dp.on_local0(lambda: self._load_state_dict(state_dict, write_moments=True), "optimizer.load_state_dict")

    def _load_state_dict(self, state_dict, write_moments: bool) -> None:
        self._port.sync()
        groups = state_dict["param_groups"]
        ids, params = self._check_loadable(state_dict, groups)
        for pid, p in zip(ids, params):
            st = state_dict["state"].get(pid)
            if st is None:
                continue
            _, unit, i = locate_param(p)
            if write_moments and self._port.on_disk(unit):  # written through the tier's buffer
                self._port.write_state(unit, {(i, k): st[k] for k in MOMENTS})
            elif write_moments:
                self.state[p]["exp_avg"].copy_(st["exp_avg"])
                self.state[p]["exp_avg_sq"].copy_(st["exp_avg_sq"])
            self.state[p]["step"] = torch.as_tensor(st["step"], dtype=torch.float32).to("cpu").clone()
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        self._port.host_written()  # device-state layers take the loaded exp_avg / exp_avg_sq

    def _check_loadable(self, state_dict, groups) -> tuple:
        """``(state ids, parameters)`` in group order, after checking that ``state_dict`` fits this optimizer.

        Raises:
            ValueError: a refused option in a group; another number of groups or parameters; a moment's shape.
        """
        for g in groups:
            check_options(".load_state_dict", g)
        if len(groups) != len(self.param_groups):
            raise ValueError(f"megatrain.optim.CPUAdamW.load_state_dict: {len(groups)} param groups in the state dict, "
                             f"{len(self.param_groups)} in the optimizer")
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in groups for i in g["params"]]
        if len(ids) != len(params):
            raise ValueError("megatrain.optim.CPUAdamW.load_state_dict: the number of parameters does not match")
        for pid, p in zip(ids, params):
            st = state_dict["state"].get(pid)
            if st is None:
                continue
            for k in MOMENTS:
                if tuple(st[k].shape) != tuple(p.shape):
                    raise ValueError(f"megatrain.optim.CPUAdamW.load_state_dict: {k} of parameter {pid} has shape "
                                     f"{tuple(st[k].shape)}, expected {tuple(p.shape)}")
        return ids, params
