"""Replaying a model's own initialisation into the host store, one tensor at a time (``from_config``)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..runtime.engine.state_access import StateAccess


def _aliases(model: nn.Module) -> Dict[str, List[str]]:
    """first parameter name -> every name that holds the same parameter (tied weights)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


_RNG_INPLACE = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
                "cauchy_"}
_RNG_FACTORIES = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson"}
_OVERWRITE = _RNG_INPLACE | {"fill_", "zero_", "copy_"}
_RNG_INIT = {"uniform_", "normal_", "trunc_normal_", "xavier_uniform_", "xavier_normal_", "kaiming_uniform_",
             "kaiming_normal_", "orthogonal_", "sparse_"}
_NO_VALUE = {"requires_grad_", "share_memory_", "retain_grad"}  # in-place on metadata only


def _geom(t: torch.Tensor):
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _has_meta(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.device.type == "meta"
    if isinstance(x, (list, tuple)):
        return any(_has_meta(y) for y in x)
    if isinstance(x, dict):
        return any(_has_meta(y) for y in x.values())
    return False


class _InitRecorder(TorchFunctionMode):
    """Sends every tensor factory to the meta device and records, in order, each factory and each
    in-place op on a meta tensor (the model's weight initialisation, run on meta: nothing computed,
    no random number drawn)."""

    def __init__(self):
        super().__init__()
        from torch.utils._device import _device_constructors

        # Data-carrying constructors stay on the CPU (their values are known; transformers also
        # probes the device context with torch.tensor([]) to decide whether to initialise).
        self._ctors = _device_constructors() - {torch.tensor, torch.asarray, torch.scalar_tensor}
        self.ops: list = []  # (kind, storage, geom, func, args, kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._ctors:
            if kwargs.get("device") is None:
                kwargs["device"] = "meta"
                out = func(*args, **kwargs)
                if isinstance(out, torch.Tensor):
                    kw = {k: v for k, v in kwargs.items() if k != "device"}
                    if out.is_floating_point() and "dtype" not in kw:
                        kw["dtype"] = out.dtype  # the default dtype at construction time
                    self.ops.append(("factory", out.untyped_storage(), _geom(out), func, args, kw))
                return out
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if getattr(func, "__module__", "") in ("torch.nn.init", "transformers.initialization"):
            # torch.nn.init.* (or transformers' guarded versions patched in for them) hand themselves
            # to the mode with the tensor as a keyword (and then run with the mode off): recorded as
            # one op, replayed by calling the same function.
            t = kwargs.get("tensor", args[0] if args else None)
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                if "tensor" in kwargs:
                    kw = {k: v for k, v in kwargs.items() if k != "tensor"}
                    self.ops.append(("init_kw", t.untyped_storage(), _geom(t), func, args, kw))
                else:
                    self.ops.append(("init", t.untyped_storage(), _geom(t), func, args[1:], kwargs))
        elif (args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"
                and (name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))):
            t = args[0]
            self.ops.append(("inplace", t.untyped_storage(), _geom(t), func, args[1:], kwargs))
        return func(*args, **kwargs)


class _RecordedInitSource:
    """Replays a recorded initialisation on real memory: the ops whose result survives write the
    store's masters; the ones overwritten later run on a scratch tensor of the same geometry, so the
    random number generator advances exactly as in the eager initialisation."""

    def __init__(self, model: nn.Module, recorder: _InitRecorder, rng_state, init_device: torch.device):
        from ..runtime.model.wrap import UnsupportedModelError

        self.ops = recorder.ops
        self.rng_state = rng_state  # (cpu state, cuda state or None)
        self.dev = torch.device(init_device)
        self.param_of: Dict[int, Tuple[str, tuple]] = {}
        for first, _ in _aliases(model).items():
            p = model.get_parameter(first)
            if p.device.type != "meta":
                raise UnsupportedModelError(f"megatrain.from_config: parameter {first} was created on {p.device}, "
                                            "not through the default device; build the model in memory and use wrap")
            self.param_of[p.untyped_storage()._cdata] = (first, _geom(p))
        self.live_start: Dict[int, int] = {}
        self.last: Dict[int, int] = {}
        for k, (kind, st, g, func, a, kw) in enumerate(self.ops):
            key = st._cdata
            if key not in self.param_of:
                continue
            self.last[key] = k
            full = g == self.param_of[key][1]
            name = getattr(func, "__name__", "")
            if kind == "factory" or (full and (name in _OVERWRITE or kind.startswith("init"))):
                self.live_start[key] = k
        for key, (first, _) in self.param_of.items():
            if key not in self.live_start:
                raise UnsupportedModelError(f"megatrain.from_config: no initialisation of parameter {first} was seen")
            kind, _, _, func, a, kw = self.ops[self.live_start[key]]
            name = getattr(func, "__name__", "")
            if name.startswith("empty") and self.live_start[key] == self.last[key]:
                raise UnsupportedModelError(f"megatrain.from_config: parameter {first} is created uninitialised "
                                            "(torch.empty) and never initialised")
        self._scratch: Dict[torch.dtype, torch.Tensor] = {}

    def _scratch_view(self, g) -> torch.Tensor:
        size, stride, _, dtype = g
        extent = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(s > 0 for s in size) else 0
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < extent:
            buf = self._scratch[dtype] = torch.empty(max(extent, 1), dtype=dtype, device=self.dev)
        return buf.as_strided(size, stride, 0)

    def _apply(self, op, view: torch.Tensor, what: str) -> None:
        kind, _, _, func, a, kw = op
        if _has_meta(a) or _has_meta(kw):
            from ..runtime.model.wrap import UnsupportedModelError
            raise UnsupportedModelError(f"megatrain.from_config: the initialisation of {what} reads a tensor computed "
                                        f"during construction ({getattr(func, '__name__', func)}); build the model in "
                                        "memory and use megatrain.wrap")
        if kind == "factory":
            view.copy_(func(*a, **kw) if self.dev.type == "cpu" else func(*a, device=self.dev, **kw))
        elif kind == "init_kw":
            func(*a, tensor=view, **kw)
        else:
            func(view, *a, **kw)

    def fill(self, eng) -> None:
        access = StateAccess(eng)
        where = {}
        for u in access.units:
            for i, e in enumerate(u.entries):
                where[e.name] = (u, i)
        temps: Dict[int, torch.Tensor] = {}
        cuda = self.dev.type == "cuda"
        with torch.random.fork_rng(devices=[self.dev] if cuda else []):
            torch.set_rng_state(self.rng_state[0])
            if cuda:
                torch.cuda.set_rng_state(self.rng_state[1], self.dev)
            with torch.no_grad():
                for k, op in enumerate(self.ops):
                    kind, st, g, func, a, kw = op
                    key = st._cdata
                    name = getattr(func, "__name__", "")
                    owner = self.param_of.get(key)
                    if name in _NO_VALUE:
                        continue
                    if owner is not None and k >= self.live_start[key]:
                        first, pg = owner
                        u, i = where[first]
                        master = access.view(u, i, "compute" if u.entries[i].frozen else "master")
                        if not cuda and pg[3] == master.dtype and pg[1] == tuple(master.stride()):
                            base = master
                        else:
                            base = temps.get(key)
                            if base is None:
                                base = temps[key] = torch.empty_strided(pg[0], pg[1], dtype=pg[3], device=self.dev)
                        view = base.as_strided(g[0], g[1], base.storage_offset() + g[2] - pg[2])
                        self._apply(op, view, f"parameter {first}")
                        if k == self.last[key] and key in temps:
                            master.copy_(temps.pop(key))
                    elif ((kind == "inplace" and name in _RNG_INPLACE) or (kind.startswith("init") and name in _RNG_INIT)
                          or (kind == "factory" and name in _RNG_FACTORIES)):
                        view = self._scratch_view(g)
                        self._apply(op, view, "a tensor overwritten later")
            end_state = torch.get_rng_state()
            end_cuda = torch.cuda.get_rng_state(self.dev) if cuda else None
        self._scratch.clear()
        torch.set_rng_state(end_state)  # as after AutoModelForCausalLM.from_config
        if cuda:
            torch.cuda.set_rng_state(end_cuda, self.dev)


# ---------------------------------------------------------------------------------------------- public
