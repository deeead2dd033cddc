"""Build a wrapped model without ever holding the whole model in memory.

* :func:`from_pretrained` reads a local Hugging Face model directory (safetensors, one file or
  sharded with ``model.safetensors.index.json``, any float dtype) tensor by tensor into the host
  store's fp32 master and compute sections.
* :func:`from_config` initialises the store with exactly the values
  ``torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`` gives, one tensor at a time.

In both, the model is built with its parameters on the meta device; non-persistent buffers
(rotary ``inv_freq`` ...) are computed by the model's own ``_init_weights``, as transformers does
for buffers missing from a checkpoint.

Every header is read and checked (file present, shapes, dtypes, byte ranges inside the file, every
parameter present) before the store is allocated. Tensors are read with ``readinto`` into the
store (fp32 files) or into one temporary tensor (other dtypes) instead of through a file mapping:
mapped pages a loader touched count in the process RSS until the file is closed, so a 16 GB bf16
file read through ``mmap`` would add 16 GB to the peak.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
_MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ValueError):
    """A model directory that cannot be loaded (missing/truncated file, wrong shape or dtype, missing tensor)."""


# ---------------------------------------------------------------------------------------------- reading
def read_safetensors_header(path: str) -> Tuple[dict, int]:
    """Parse a safetensors file's header and check every tensor's byte range against the file size.

    Returns:
        ``({name: {"dtype", "shape", "data_offsets"}}, data_start_byte)`` (``__metadata__`` dropped).

    Raises:
        CheckpointError: missing, truncated or malformed file (names the file, and the tensor).
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"megatrain: checkpoint file {path} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"megatrain: {path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"megatrain: {path} is truncated or not a safetensors file (header of {n} bytes, "
                                  f"file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"megatrain: {path} has a malformed safetensors header ({e})") from None
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        try:
            b, e = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"megatrain: {path}: tensor {name} has a malformed header entry") from None
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"megatrain: {path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if e - b != numel * _ST_DTYPES[dtype].itemsize or b < 0:
            raise CheckpointError(f"megatrain: {path}: tensor {name} ({dtype} {shape}) has a byte range "
                                  f"[{b}, {e}) of the wrong length")
        if start + e > size:
            raise CheckpointError(f"megatrain: {path} is truncated: tensor {name} ends at byte {start + e}, "
                                  f"the file has {size} bytes")
    return header, start


class CheckpointIndex:
    """Where each tensor of a local model directory lives (headers read and checked up front).

    Args:
        path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json`` + shards.

    Raises:
        CheckpointError: no safetensors weights, an index naming a file that is not there, a
            truncated or malformed file, an index entry the shard does not hold.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self.tensors: Dict[str, Tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"megatrain: {index} is not a safetensors index ({e!r})") from None
            by_file: Dict[str, List[str]] = {}
            for name, fn in weight_map.items():
                by_file.setdefault(fn, []).append(name)
            for fn, names in by_file.items():
                fp = os.path.join(path, fn)
                if not os.path.isfile(fp):
                    raise CheckpointError(f"megatrain: {index} names {fn} (holding {names[0]} and {len(names) - 1} "
                                          f"more tensors), but {fp} does not exist")
                header, start = read_safetensors_header(fp)
                for name in names:
                    if name not in header:
                        raise CheckpointError(f"megatrain: {index} puts tensor {name} in {fp}, which does not hold it")
                    self.tensors[name] = (fp, header[name], start)
        elif os.path.isfile(single):
            header, start = read_safetensors_header(single)
            for name, info in header.items():
                self.tensors[name] = (single, info, start)
        else:
            raise CheckpointError(f"megatrain: {path} has no model.safetensors or model.safetensors.index.json "
                                  "(only safetensors checkpoints are read; convert .bin weights with save_pretrained)")
        self._files: Dict[str, object] = {}

    def lookup(self, names: List[str], prefix: str = "") -> Optional[str]:
        """The first of ``names`` (or, with the model's base prefix added/removed, its variant) present."""
        for n in names:
            for cand in (n, n[len(prefix) + 1:] if prefix and n.startswith(prefix + ".") else None,
                         f"{prefix}.{n}" if prefix else None):
                if cand is not None and cand in self.tensors:
                    return cand
        return None

    def check(self, key: str, shape: tuple, what: str, float_only: bool = True) -> None:
        fp, info, _ = self.tensors[key]
        if float_only and info["dtype"] not in _FLOAT_CODES:
            raise CheckpointError(f"megatrain: {fp}: tensor {key} has dtype {info['dtype']}, expected a float "
                                  f"dtype (F32, BF16, F16, F64) for {what}")
        if tuple(info["shape"]) != tuple(shape):
            raise CheckpointError(f"megatrain: {fp}: tensor {key} has shape {tuple(info['shape'])}, the model's "
                                  f"{what} has shape {tuple(shape)}")

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Read tensor ``key`` into ``dst`` (CPU, contiguous, same shape; converted to its dtype)."""
        fp, info, start = self.tensors[key]
        dtype = _ST_DTYPES[info["dtype"]]
        f = self._files.get(fp)
        if f is None:
            f = self._files[fp] = open(fp, "rb", buffering=0)
        b, e = info["data_offsets"]
        direct = dst.dtype == dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(tuple(info["shape"]), dtype=dtype)
        mv = memoryview(buf.view(-1).view(torch.uint8).numpy()) if buf.numel() else memoryview(b"")
        f.seek(start + b)
        got = 0
        while got < e - b:
            n = f.readinto(mv[got:])
            if not n:
                raise CheckpointError(f"megatrain: {fp} is truncated: tensor {key} could not be read")
            got += n
        if not direct:
            dst.copy_(buf)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# ---------------------------------------------------------------------------------------------- model
def _aliases(model: nn.Module) -> Dict[str, List[str]]:
    """first parameter name -> every name that holds the same parameter (tied weights)."""
    by_id: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {names[0]: names for names in by_id.values()}


def _load_config(config_or_path):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config_or_path, PretrainedConfig):
        return config_or_path
    return AutoConfig.from_pretrained(config_or_path)


_NOT_FOR_MEGATRAIN = {
    "device_map": "the layers are streamed from host memory; pass device='cuda' (a megatrain.wrap option)",
    "quantization_config": "megatrain trains full-precision weights (fp32 masters); load without quantization",
    "load_in_8bit": "megatrain trains full-precision weights (fp32 masters); load without quantization",
    "load_in_4bit": "megatrain trains full-precision weights (fp32 masters); load without quantization",
}


def _check_model_kwargs(model_kwargs: dict) -> None:
    """Refuse transformers loading options that megatrain would otherwise ignore or misapply.

    ``dtype`` / ``torch_dtype``: only float32 (the masters' dtype) or "auto" are accepted; both mean
    nothing more (the compute precision is ``compute_dtype``). Raises ValueError (one line).
    """
    for key in ("dtype", "torch_dtype"):
        v = model_kwargs.pop(key, None)
        if v is None or v == "auto" or v in (torch.float32, "float32"):
            continue
        raise ValueError(f"megatrain: {key}={v} is not used: the master weights are always fp32 and the compute "
                         f"precision is megatrain.wrap's; pass compute_dtype={v} instead")
    for key, why in _NOT_FOR_MEGATRAIN.items():
        if key in model_kwargs:
            raise ValueError(f"megatrain: {key}= is not supported: {why}")


def meta_model(config, recorder: Optional[TorchFunctionMode] = None, **model_kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with every parameter and buffer on the meta device.

    Buffers are left on meta: :func:`init_buffers` computes them. With ``recorder`` (an
    ``_InitRecorder``), every factory call is sent to the meta device by it and the weight
    initialisation runs (on meta tensors: it is recorded, not executed); without, the model is
    built under ``torch.device("meta")`` and no initialisation runs.
    """
    from transformers import AutoModelForCausalLM

    _check_model_kwargs(model_kwargs)
    model_kwargs["dtype"] = torch.float32
    if recorder is not None:
        with recorder:
            model = AutoModelForCausalLM.from_config(config, **model_kwargs)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **model_kwargs)
    return model


def init_buffers(model: nn.Module, index: Optional[CheckpointIndex] = None) -> None:
    """Give every meta buffer its value: from the checkpoint (persistent buffers it holds), else
    from the model's ``_init_weights`` (as transformers initialises buffers a checkpoint lacks).

    Raises:
        UnsupportedModelError: a buffer that neither provides (named).
    """
    from .wrap import UnsupportedModelError

    prefix = getattr(model, "base_model_prefix", "")
    init_fn = getattr(model, "_init_weights", None)
    for mname, mod in model.named_modules():
        metas = [(n, b) for n, b in mod._buffers.items() if b is not None and b.device.type == "meta"]
        if not metas:
            continue
        todo = []
        for n, b in metas:
            full = f"{mname}.{n}" if mname else n
            key = index.lookup([full], prefix) if index is not None and n not in mod._non_persistent_buffers_set else None
            real = torch.empty(b.shape, dtype=b.dtype)
            if key is not None:
                index.check(key, tuple(b.shape), f"buffer {full}", float_only=False)
                index.read_into(key, real)
            else:
                if real.is_floating_point():
                    real.fill_(float("nan"))
                todo.append((n, full))
            mod._buffers[n] = real
        if todo:
            if init_fn is not None:
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    init_fn(mod)
            for n, full in todo:
                b = mod._buffers[n]
                if b.device.type == "meta" or (b.is_floating_point() and torch.isnan(b).all() and b.numel() > 0):
                    raise UnsupportedModelError(
                        f"megatrain: buffer {full} of {type(model).__name__} is neither in the checkpoint nor set by the "
                        "model's _init_weights; build the model with AutoModelForCausalLM.from_pretrained and use "
                        "megatrain.wrap")


class _CheckpointSource:
    """Fills the store's masters from a :class:`CheckpointIndex` (validated before allocation)."""

    def __init__(self, model: nn.Module, index: CheckpointIndex):
        self.index = index
        self.keys: Dict[str, str] = {}
        prefix = getattr(model, "base_model_prefix", "")
        for first, names in _aliases(model).items():
            key = index.lookup(names, prefix)
            if key is None:
                raise CheckpointError(
                    f"megatrain: tensor {first} is missing from the checkpoint in {index.path} (transformers would "
                    "initialise it randomly; megatrain refuses). If this architecture renames or fuses weights when "
                    "loading, use AutoModelForCausalLM.from_pretrained and megatrain.wrap")
            p = model.get_parameter(first)
            index.check(key, tuple(p.shape), f"parameter {first}")
            self.keys[first] = key

    def fill(self, eng) -> None:
        try:
            for u in eng.units:
                for i, e in enumerate(u.entries):
                    self.index.read_into(self.keys[e.name], eng.entry_view(u, i, "compute" if e.frozen else "master"))
        finally:
            self.index.close()


# ---------------------------------------------------------------------------------------------- init replay
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
        from .wrap import UnsupportedModelError

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
            from .wrap import UnsupportedModelError
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
        where = {}
        for u in eng.units:
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
                        master = eng.entry_view(u, i, "compute" if u.entries[i].frozen else "master")
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
def _split_kwargs(kwargs: dict) -> Tuple[dict, dict]:
    wrap_keys = {"device", "compute_dtype", "activation_policy", "num_slots", "grad_accumulator", "chunked_loss",
                 "tile_mlp", "device_state_layers"}
    return {k: v for k, v in kwargs.items() if k in wrap_keys}, {k: v for k, v in kwargs.items() if k not in wrap_keys}


def _wrap_with(model, source, wrap_kwargs):
    from .wrap import _wrap

    kw = dict(device=None, compute_dtype=None, activation_policy="recompute", num_slots=2, grad_accumulator=None)
    kw.update(wrap_kwargs)
    return _wrap(model, kw["device"], kw["compute_dtype"], kw["activation_policy"], kw["num_slots"],
                 kw["grad_accumulator"], source=source, chunked_loss=kw.get("chunked_loss", "auto"),
                 tile_mlp=kw.get("tile_mlp", "auto"), device_state_layers=kw.get("device_state_layers"))


def from_pretrained(path: str, **kwargs) -> nn.Module:
    """Load a local Hugging Face model directory straight into megatrain's host store.

    The model is built on the meta device; each tensor is read from its safetensors file into the
    store's fp32 master (and compute copy) one at a time, so the whole model never sits in RAM
    beside the store (peak: the store plus one tensor). The result equals
    ``megatrain.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), ...)`` bit
    for bit. Tied weights are one entry, read from whichever name the checkpoint holds.

    Args:
        path: a local directory with ``config.json`` and ``model.safetensors`` (or
            ``model.safetensors.index.json`` and its shards); tensors in F32, BF16, F16 or F64.
        **kwargs: :func:`megatrain.wrap` options (``device``, ``compute_dtype``,
            ``activation_policy``, ``num_slots``, ``grad_accumulator``, ``chunked_loss``, ``tile_mlp``,
            ``device_state_layers``); the others go to
            ``AutoModelForCausalLM.from_config`` (e.g. ``attn_implementation``).

    Returns:
        The wrapped model (as :func:`megatrain.wrap` returns it).

    Raises:
        CheckpointError: no config / weights, a shard missing, an index naming a file that is not
            there, a truncated file, a tensor of the wrong shape or dtype, a parameter the
            checkpoint lacks. Raised before the store is allocated; the message names the file
            and the tensor.
        UnsupportedModelError, ValueError, HostMemoryError: as :func:`megatrain.wrap`.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"megatrain.from_pretrained: {path} is not a local directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"megatrain.from_pretrained: {path} has no config.json")
    wrap_kwargs, model_kwargs = _split_kwargs(kwargs)
    index = CheckpointIndex(path)
    config = _load_config(path)
    model = meta_model(config, **model_kwargs)
    source = _CheckpointSource(model, index)  # validates every parameter before anything is allocated
    init_buffers(model, index)
    model.eval()  # as AutoModelForCausalLM.from_pretrained returns it
    return _wrap_with(model, source, wrap_kwargs)


def from_config(config, seed: Optional[int] = None, init_device="cpu", transform=None, **kwargs) -> nn.Module:
    """A freshly initialised model, built straight into megatrain's host store.

    The values equal ``torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`` bit for
    bit (the default CPU generator is left in the same state), but no tensor of the model is ever
    materialised whole: the initialisation is recorded on the meta device and replayed into the
    store's masters one tensor at a time (overwritten draws run on a scratch tensor).

    Args:
        config: a ``transformers.PretrainedConfig`` (or a path / hub name ``AutoConfig`` reads).
        seed: ``torch.manual_seed(seed)`` first; None: continue from the current RNG state.
        init_device: where the initialisation runs: ``"cpu"`` (default: HF's CPU values) or a
            CUDA device (the values of ``with torch.device(init_device): from_config(config)``,
            drawn from the CUDA generator; ~100x faster for multi-billion-parameter models; each
            tensor is copied to the store as soon as it is final).
        transform: ``model -> model`` run on the meta model, its initialisation recorded too, e.g.
            ``lambda m: peft.get_peft_model(m, lora_config)``: the result equals
            ``torch.manual_seed(seed); transform(AutoModelForCausalLM.from_config(config))``, and
            what it freezes is frozen in the store (compute copy only).
        **kwargs: :func:`megatrain.wrap` options; the others go to ``from_config``.

    Raises:
        UnsupportedModelError: the model's initialisation cannot be replayed (it reads tensors
            computed during construction, or creates parameters on an explicit device).
        ValueError, HostMemoryError: as :func:`megatrain.wrap`.
    """
    wrap_kwargs, model_kwargs = _split_kwargs(kwargs)
    config = _load_config(config)
    if seed is not None:
        torch.manual_seed(seed)
    init_device = torch.device(init_device)
    if init_device.type == "cuda" and init_device.index is None:
        init_device = torch.device("cuda", torch.cuda.current_device())
    state = (torch.get_rng_state(), torch.cuda.get_rng_state(init_device) if init_device.type == "cuda" else None)
    rec = _InitRecorder()
    model = meta_model(config, recorder=rec, **model_kwargs)
    if transform is not None:
        with rec:
            model = transform(model)
    source = _RecordedInitSource(model, rec, state, init_device)
    init_buffers(model)
    return _wrap_with(model, source, wrap_kwargs)
