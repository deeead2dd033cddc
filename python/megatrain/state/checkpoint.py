"""Checkpoint / resume for wrapped models: every fp32 training state, streamed unit by unit.

A checkpoint is a directory::

    manifest.json            format, model layout, sha256 + size of every other file (written last)
    unit-00000.safetensors   one file per unit (decoder layer / resident unit), fp32 tensors
    ...                      "master.<name>", "exp_avg.<name>", "exp_avg_sq.<name>" for each parameter
    state.json               optimizer hyperparameters (param groups by parameter name), per-parameter
                             Adam steps, max_grad_norm, RNG states, the caller's ``extra`` dict
    scheduler.pt             ``lr_scheduler.state_dict()`` (only when a scheduler is given)

Unit files are standard safetensors files (``safetensors.safe_open`` reads them), written here
straight from the host store's memory (no staging copy: extra host memory is a few KiB, not a
unit) and read back straight into it (``readinto`` on the store's views). A layer whose fp32
state is in the disk tier (``wrap(offload_dir=...)``) is written from, and read into, the tier's
RAM buffer of that unit (acquired for the file, released after it): no extra RAM either. The directory is built
under a temporary name next to the destination and swapped into place only once complete
(:func:`megatrain.state.atomic.atomic_directory`), so a crash mid-save leaves the previous checkpoint
intact. Loading first verifies every file's size
and sha256 against the manifest (and refuses with :class:`CheckpointError` naming the file),
then writes the store.

Tied parameters are one host-store entry, saved once under the first name that holds them.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import random
import struct
import warnings
from typing import Optional

import torch

from .atomic import atomic_directory, check_replaceable, existing_ancestor  # noqa: F401 - public here too
from ..errors import CheckpointError  # noqa: F401 - public here too
from ..runtime.engine.core import locate
from ..runtime.model.model_config import write_cache_flags

FORMAT = "megatrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
SCHEDULER = "scheduler.pt"
SECTIONS = ("master", "exp_avg", "exp_avg_sq")
_CHUNK = 16 << 20


# ---------------------------------------------------------------------------- helpers
def _engine(model):
    eng = getattr(model, "megatrain", None)
    if eng is None:
        raise ValueError("megatrain checkpoint: the model is not wrapped by megatrain.wrap")
    return eng


def _buffer(t: torch.Tensor):
    """Writable zero-copy memoryview of a contiguous CPU tensor's bytes."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("megatrain checkpoint: expected a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _HashingWriter:
    """Writes a file while hashing it; ``close()`` fsyncs it unless ``sync=False`` (the caller's
    :func:`~megatrain.state.atomic.atomic_directory` fsyncs every file before its swap: one fsync per
    file, each a device cache flush)."""

    def __init__(self, path: str, sync: bool = True):
        self.path = path
        self.sync = sync
        self.f = open(path, "wb")
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, data) -> None:
        self.h.update(data)
        self.f.write(data)
        self.n += len(data)

    def close(self) -> dict:
        self.f.flush()
        if self.sync:
            os.fsync(self.f.fileno())
        self.f.close()
        return {"sha256": self.h.hexdigest(), "bytes": self.n}


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16"}


class _Deferred:
    """An fp32 tensor of a unit whose state is in the disk tier: viewed (``get()``) only when its bytes
    are written, inside the engine's ``state_window``, so a file is written from one unit's buffer
    at a time instead of from a copy of every disk unit."""

    dtype = torch.float32

    def __init__(self, shape, get):
        self.shape = torch.Size(shape)
        self.get = get

    def numel(self) -> int:
        return self.shape.numel()


def _entry_tensor(eng, u, i, sec):
    """``eng.entry_view(u, i, sec)``, deferred for a disk unit's fp32 sections (see :class:`_Deferred`)."""
    if u.disk is not None and sec != "compute":
        return _Deferred(u.entries[i].shape, lambda: eng.entry_view(u, i, sec))
    return eng.entry_view(u, i, sec)


def _write_safetensors(path: str, tensors: list, metadata: Optional[dict] = None,
                       dtype: torch.dtype = torch.float32, sync: bool = True) -> dict:
    """Write ``[(key, contiguous CPU fp32 tensor or _Deferred)]`` as a safetensors file of ``dtype``.

    fp32 is written without copying the data; bf16 converts one tensor at a time (extra memory:
    the largest tensor). ``sync=False``: not fsynced (inside an ``atomic_directory``, which fsyncs
    it). Returns ``{"sha256": ..., "bytes": ...}`` of the file.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"megatrain: safetensors dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    esize = torch.tensor([], dtype=dtype).element_size()
    header = {}
    off = 0
    for key, t in tensors:
        if t.dtype != torch.float32:
            raise ValueError(f"megatrain checkpoint: {key} is {t.dtype}, expected float32")
        n = t.numel() * esize
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    w = _HashingWriter(path, sync)
    try:
        w.write(struct.pack("<Q", len(hb)))
        w.write(hb)
        for _, t in tensors:
            t = t.get() if isinstance(t, _Deferred) else t
            data = t if dtype == torch.float32 else t.to(dtype).contiguous()  # held while its bytes are written
            w.write(_buffer(data))
        return w.close()
    except BaseException:
        w.f.close()
        raise


def _read_header(f, path: str) -> tuple:
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"megatrain.load_checkpoint: {path} is truncated (no safetensors header)")
    (n,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise CheckpointError(f"megatrain.load_checkpoint: {path} has a malformed safetensors header: {e}") from None
    return header, 8 + n


def _write_json(path: str, obj, sync: bool = True) -> dict:
    w = _HashingWriter(path, sync)
    w.write(json.dumps(obj, indent=1).encode())
    return w.close()


def _file_digest(path: str) -> dict:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
    return {"sha256": h.hexdigest(), "bytes": n}


def _param_name(p) -> str:
    _, unit, i = locate(p)
    return unit.entries[i].name


def _jsonable(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


# ---------------------------------------------------------------------------- RNG
def _rng_state() -> dict:
    st = {"python": _jsonable(list(random.getstate())), "torch": torch.get_rng_state().tolist()}
    try:
        import numpy as np
        s = np.random.get_state()
        st["numpy"] = [s[0], s[1].tolist(), int(s[2]), int(s[3]), float(s[4])]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [t.tolist() for t in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: dict) -> None:
    v, state, gauss = st["python"]
    random.setstate((v, tuple(state), gauss))
    torch.set_rng_state(torch.tensor(st["torch"], dtype=torch.uint8))
    if "numpy" in st:
        try:
            import numpy as np
            name, keys, pos, has_gauss, cached = st["numpy"]
            np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in st and torch.cuda.is_available():
        states = [torch.tensor(s, dtype=torch.uint8) for s in st["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# ---------------------------------------------------------------------------- save
def _is_checkpoint_dir(path: str) -> bool:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(directory: str, model, optimizer, lr_scheduler=None, extra: Optional[dict] = None) -> str:
    """Save every training state of a wrapped model to ``directory`` (replaced atomically).

    Saved: fp32 master weights, Adam ``exp_avg`` / ``exp_avg_sq``, per-parameter step counts,
    the optimizer's param groups (lr, betas, eps, weight_decay, anything a scheduler added) and
    ``max_grad_norm``, ``lr_scheduler.state_dict()``, RNG states (Python, NumPy, torch CPU,
    CUDA when initialised) and ``extra`` (a JSON-serialisable dict: data position, epoch, ...).

    Units are written one file at a time straight from host memory (no second copy of the
    model). The checkpoint is assembled in a temporary directory next to ``directory`` and
    renamed into place when complete: a crash leaves any previous checkpoint there intact.

    Args:
        directory: destination directory: new, empty, or an earlier megatrain checkpoint (replaced).
        model: a model wrapped by ``megatrain.wrap``.
        optimizer: its ``megatrain.optim.CPUAdamW`` (None: weights only, no optimizer state).
        lr_scheduler: an object with ``state_dict()`` (e.g. a ``torch.optim.lr_scheduler``), or None.
        extra: JSON-serialisable dict returned by :func:`load_checkpoint`.

    Returns:
        ``directory`` (absolute).

    Raises:
        CheckpointError: ``directory`` (or a folder above it) is a file, or ``directory`` is a
            non-empty directory that is not a megatrain checkpoint (it would be deleted); checked
            before anything is written. A ``ValueError`` subclass.
        ValueError: the optimizer is not this model's, the call falls
            between backward() and step() while updates run, or ``extra`` is not a JSON-serialisable dict.
        TypeError: ``directory`` is not a path.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"megatrain.save_checkpoint: directory must be a path (str or os.PathLike), got "
                        f"{type(directory).__name__}; the call is save_checkpoint(directory, model, optimizer, ...)")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"megatrain.save_checkpoint: extra must be a dict (load_checkpoint returns it as one), got "
                         f"{type(extra).__name__}")
    eng = _engine(model)
    check_replaceable(directory, "megatrain.save_checkpoint", _is_checkpoint_dir, "a megatrain checkpoint",
                      CheckpointError)
    if optimizer is not None:
        optimizer = getattr(optimizer, "optimizer", optimizer) if not hasattr(optimizer, "engine") else optimizer
        if getattr(optimizer, "engine", None) is not eng:
            raise ValueError("megatrain.save_checkpoint: the optimizer is not a megatrain.optim.CPUAdamW of this model")
    eng.check_failed()  # a failed CPU worker or disk tier: its error, not a checkpoint of partial state
    if any(u.eager_queued for u in eng.units):
        # Without clipping the layers' updates start during backward: a checkpoint now would hold
        # some units after this step's update and the others before it.
        raise ValueError("megatrain.save_checkpoint: called between backward() and optimizer.step() while updates "
                         "are already running (no max_grad_norm); save after optimizer.step()")
    try:
        extra_json = json.loads(json.dumps(extra if extra is not None else {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"megatrain.save_checkpoint: extra must be JSON-serialisable: {e}") from None
    dp = getattr(eng, "dp", None)
    if dp is not None:  # data parallel: every rank calls it at the same point; global rank 0 writes the one checkpoint
        with dp.collective("megatrain.save_checkpoint", os.path.abspath(directory)):
            eng.sync_host()  # this rank's updates; rank 0's also waits for every peer's
            return dp.on_rank0(lambda: _save(directory, eng, optimizer, lr_scheduler, extra_json), "save_checkpoint",
                               os.path.abspath(directory))
    eng.sync_host()  # queued Adam updates and gradient accumulation are done; device-state layers copied
    return _save(directory, eng, optimizer, lr_scheduler, extra_json)


def _save(directory: str, eng, optimizer, lr_scheduler, extra_json) -> str:
    # A unit whose state is on disk is written from the tier's buffer (acquired, written, released).
    with atomic_directory(directory, "megatrain.save_checkpoint", _is_checkpoint_dir,
                          "a megatrain checkpoint", CheckpointError) as tmp, eng.state_window(write=False):
        files = {}
        units = []
        for u in eng.units:
            fname = f"unit-{u.index:05d}.safetensors"
            tensors = [(f"{sec}.{e.name}", eng.entry_view(u, i, sec))
                       for sec in SECTIONS for i, e in enumerate(u.entries) if not e.frozen]
            # frozen entries (no fp32 state): their compute copy, exactly what trains against
            tensors += [(f"compute.{e.name}", eng.entry_view(u, i, "compute").contiguous())
                        for i, e in enumerate(u.entries) if e.frozen]
            # sync=False: atomic_directory fsyncs every file of tmp once, before the swap
            files[fname] = _write_safetensors(os.path.join(tmp, fname), tensors,
                                              metadata={"format": "pt", "megatrain_unit": u.index}, sync=False)
            del tensors
            units.append({"index": u.index, "kind": u.kind, "file": fname,
                          "entries": [[e.name, list(e.shape)] for e in u.entries]})

        state = {"extra": extra_json, "rng": _rng_state(), "optimizer": None}
        if optimizer is not None:
            groups = []
            steps = {}
            for g in optimizer.param_groups:
                hyper = {k: _jsonable(v) for k, v in g.items() if k != "params"}
                groups.append({"params": [_param_name(p) for p in g["params"]], **hyper})
                for p in g["params"]:
                    # (the state was synced above: a plain dict read, which hands nothing out writable)
                    steps[_param_name(p)] = float(dict.__getitem__(optimizer.state[p], "step"))
            state["optimizer"] = {"param_groups": groups, "steps": steps,
                                  "max_grad_norm": optimizer.max_grad_norm}
        files[STATE] = _write_json(os.path.join(tmp, STATE), state, sync=False)
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), os.path.join(tmp, SCHEDULER))
            files[SCHEDULER] = _file_digest(os.path.join(tmp, SCHEDULER))
        manifest = {"format": FORMAT, "version": VERSION, "compute_dtype": str(eng.compute_dtype),
                    "num_params": sum(u.numel for u in eng.units), "units": units, "files": files}
        _write_json(os.path.join(tmp, MANIFEST), manifest, sync=False)
    return os.path.abspath(directory)


# ---------------------------------------------------------------------------- load
def read_manifest(directory: str, where: str = "megatrain.read_manifest") -> dict:
    """Read and sanity-check ``manifest.json`` of a checkpoint directory.

    ``where``: the caller named at the start of an error message.

    Raises:
        CheckpointError: no checkpoint there, or not a megatrain checkpoint.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        hint = ""
        parent, base = os.path.split(os.path.abspath(directory))
        olds = glob.glob(os.path.join(parent, f".{base}.old-*"))
        if olds:
            hint = f" (a save was interrupted while replacing it; the previous checkpoint is at {olds[0]})"
        raise CheckpointError(f"{where}: {path} not found: {directory} is not a complete "
                              f"megatrain checkpoint{hint}")
    try:
        with open(path) as f:
            m = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{where}: {path} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {path} is not a megatrain checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{where}: {path} has format version {m.get('version')}, "
                              f"this megatrain reads version {VERSION}")
    return m


def verify_checkpoint(directory: str, where: str = "megatrain.verify_checkpoint") -> dict:
    """Check every file listed in the manifest: present, right size, right sha256. Returns the manifest.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    m = read_manifest(directory, where)
    for fname, want in m["files"].items():
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            raise CheckpointError(f"{where}: {path} is missing (listed in the manifest)")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{where}: {path} is truncated or altered: "
                                  f"{size} bytes, the manifest says {want['bytes']}")
        got = _file_digest(path)["sha256"]
        if got != want["sha256"]:
            raise CheckpointError(f"{where}: {path} is corrupted: sha256 {got} does not match "
                                  f"the manifest ({want['sha256']})")
    return m


def load_checkpoint(directory: str, model, optimizer=None, lr_scheduler=None, restore_rng: bool = True) -> dict:
    """Restore a checkpoint written by :func:`save_checkpoint` into a wrapped model (and optimizer, scheduler).

    Every file is verified (size + sha256) before anything is written. Master weights and Adam
    moments are read straight into the host store; the compute copies are refreshed from the
    master weights and the device slots invalidated, so the next forward uses the loaded weights.

    Args:
        directory: a checkpoint directory.
        model: the same architecture, wrapped by ``megatrain.wrap`` (compute dtype may differ).
        optimizer: its ``CPUAdamW`` (None: weights only). Param groups are matched by parameter name.
            Its ``max_grad_norm`` is kept (a warning names the checkpoint's when they differ).
        lr_scheduler: restored from ``scheduler.pt`` when given (error if the checkpoint has none).
        restore_rng: restore Python / NumPy / torch (CPU, CUDA) RNG states.

    Returns:
        The ``extra`` dict given to :func:`save_checkpoint`.

    Raises:
        CheckpointError: missing / truncated / altered file (named), or a model / optimizer mismatch.
        ValueError: the optimizer is not this model's ``CPUAdamW``, or ``lr_scheduler`` is not a
            scheduler (an optimizer passed there). TypeError: ``restore_rng`` is not a bool.
        All of them before anything is written.
    """
    eng = _engine(model)
    if optimizer is not None and not hasattr(optimizer, "engine"):
        optimizer = getattr(optimizer, "optimizer", optimizer)
    if optimizer is not None and getattr(optimizer, "engine", None) is not eng:
        raise ValueError("megatrain.load_checkpoint: the optimizer is not a megatrain.optim.CPUAdamW of this model")
    if lr_scheduler is not None and (isinstance(lr_scheduler, torch.optim.Optimizer)
                                     or not callable(getattr(lr_scheduler, "load_state_dict", None))):
        raise ValueError(f"megatrain.load_checkpoint: lr_scheduler must be an LR scheduler (with load_state_dict), got "
                         f"a {type(lr_scheduler).__name__}; pass the optimizer as optimizer=...")
    if not isinstance(restore_rng, bool):
        raise TypeError(f"megatrain.load_checkpoint: restore_rng must be True or False, got {restore_rng!r}")
    m = verify_checkpoint(directory, "megatrain.load_checkpoint")
    # Layout check before touching the store.
    if len(m["units"]) != len(eng.units):
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} has {len(m['units'])} units, the model has "
                              f"{len(eng.units)} (a different architecture?)")
    for mu, u in zip(m["units"], eng.units):
        want = [[e.name, list(e.shape)] for e in u.entries]
        if mu["entries"] != want:
            names = lambda es: [e[0] for e in es]  # noqa: E731
            raise CheckpointError(
                f"megatrain.load_checkpoint: unit {u.index} of {directory} holds {names(mu['entries'])}, the model's "
                f"holds {names(want)} (a different architecture, shapes or tie_word_embeddings?)"
                if names(mu["entries"]) != names(want) else
                f"megatrain.load_checkpoint: unit {u.index} of {directory} has shapes "
                f"{[e[1] for e in mu['entries']]}, the model's {[e[1] for e in want]} (a different model size?)")
    with open(os.path.join(directory, STATE)) as f:
        state = json.load(f)
    if optimizer is not None and state.get("optimizer") is None:
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} was saved without optimizer state")
    if lr_scheduler is not None and SCHEDULER not in m["files"]:
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} has no {SCHEDULER} (saved without a scheduler)")
    if lr_scheduler is None and optimizer is not None and SCHEDULER in m["files"]:
        warnings.warn(f"megatrain.load_checkpoint: {directory} holds an LR scheduler state ({SCHEDULER}) that is not "
                      "restored: pass lr_scheduler=... to resume the schedule where it stopped", UserWarning,
                      stacklevel=2)
    # read before anything is written: a scheduler state that cannot be loaded fails here
    sched_state = (torch.load(os.path.join(directory, SCHEDULER), weights_only=True)
                   if lr_scheduler is not None else None)
    opt_state = state.get("optimizer")
    by_name = {}
    if optimizer is not None:
        names = [[_param_name(p) for p in g["params"]] for g in optimizer.param_groups]
        saved = [g["params"] for g in opt_state["param_groups"]]
        if names != saved:
            raise CheckpointError(f"megatrain.load_checkpoint: the optimizer's param groups ({len(names)} groups, "
                                  f"{[len(n) for n in names]} params) differ from the checkpoint's "
                                  f"({len(saved)} groups, {[len(n) for n in saved]} params)")
        by_name = {_param_name(p): p for g in optimizer.param_groups for p in g["params"]}

    dp = getattr(eng, "dp", None)
    if dp is not None:  # data parallel: every rank calls it at the same point; local rank 0 reads into the node's store
        what = f"{os.path.abspath(directory)} optimizer={optimizer is not None} scheduler={lr_scheduler is not None}"
        with dp.collective("megatrain.load_checkpoint", what):
            eng.zero_grad()
            eng.sync_host()
            sections = SECTIONS if optimizer is not None else ("master",)
            dp.on_local0(lambda: _read_units(directory, m, eng, sections), "load_checkpoint")
            eng.invalidate(eng.units)
            _restore_state(directory, eng, optimizer, lr_scheduler, restore_rng, state, opt_state, by_name, sched_state)
        return state.get("extra") or {}
    eng.zero_grad()  # gradients accumulated before the load belong to other weights
    eng.sync_host()  # (without the optimizer only masters are read: the moments stay as they are)
    sections = SECTIONS if optimizer is not None else ("master",)
    _read_units(directory, m, eng, sections)
    _restore_state(directory, eng, optimizer, lr_scheduler, restore_rng, state, opt_state, by_name, sched_state)
    return state.get("extra") or {}


def _read_units(directory: str, m: dict, eng, sections) -> None:
    with eng.state_window(write=True):  # a unit on disk: read into the tier's buffer, written back
        _read_units_into(directory, m, eng, sections)


def _read_units_into(directory: str, m: dict, eng, sections) -> None:
    for mu, u in zip(m["units"], eng.units):
        path = os.path.join(directory, mu["file"])
        with open(path, "rb") as f:
            header, base = _read_header(f, path)
            for sec in sections:
                for i, e in enumerate(u.entries):
                    if e.frozen and sec != "master":
                        continue
                    key = f"{'compute' if e.frozen else sec}.{e.name}"
                    want = "F32" if not e.frozen or eng.compute_dtype == torch.float32 else "BF16"
                    info = header.get(key)
                    if info is None or info["dtype"] != want or list(info["shape"]) != list(e.shape):
                        raise CheckpointError(f"megatrain.load_checkpoint: {path} has no {want} tensor {key} "
                                              f"of shape {list(e.shape)}")
                    dst = eng.entry_view(u, i, "compute" if e.frozen else sec)
                    b, end = info["data_offsets"]
                    mv = _buffer(dst)
                    if end - b != len(mv):
                        raise CheckpointError(f"megatrain.load_checkpoint: {path}: {key} has {end - b} bytes, "
                                              f"expected {len(mv)}")
                    f.seek(base + b)
                    if f.readinto(mv) != len(mv):
                        raise CheckpointError(f"megatrain.load_checkpoint: {path} is truncated at {key}")
        with torch.no_grad():
            for i, e in enumerate(u.entries):
                if not e.frozen:
                    eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))
        eng.invalidate([u])  # device slots / the resident buffer reload from the new compute copy


def _restore_state(directory, eng, optimizer, lr_scheduler, restore_rng, state, opt_state, by_name,
                   sched_state=None) -> None:
    eng.host_written()  # device-state layers take the loaded state
    if optimizer is not None:
        for g, sg in zip(optimizer.param_groups, opt_state["param_groups"]):
            for k, v in sg.items():
                if k == "params":
                    continue
                if k == "betas":
                    v = tuple(v)
                if isinstance(g.get(k), torch.Tensor):
                    g[k].fill_(v)
                else:
                    g[k] = v
        for name, step in opt_state["steps"].items():
            optimizer.state[by_name[name]]["step"] = torch.tensor(float(step))
        saved_mgn = opt_state.get("max_grad_norm")
        if saved_mgn != optimizer.max_grad_norm:
            # The caller's optimizer settings win (as torch's load_state_dict keeps the caller's clipping).
            warnings.warn(f"megatrain.load_checkpoint: {directory} was saved with max_grad_norm={saved_mgn!r}; the "
                          f"optimizer's max_grad_norm={optimizer.max_grad_norm!r} is kept. Pass "
                          f"CPUAdamW(max_grad_norm={saved_mgn!r}) to train on as before", UserWarning, stacklevel=2)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(sched_state)
    if restore_rng:
        _set_rng_state(state["rng"])


# ---------------------------------------------------------------------------- HF export, streamed
# safetensors metadata "producer" of the weights megatrain exports: how export_pretrained knows a
# directory is its own earlier output (which it may replace) and not a model someone else saved.
EXPORT_PRODUCER = "megatrain.export_pretrained"


def is_megatrain_export(path: str, ignore=()) -> bool:
    """Whether directory ``path`` holds only what :func:`save_pretrained_streamed` writes
    (``config.json``, ``generation_config.json``, ``model.safetensors``) and its weights carry
    megatrain's producer mark. A model directory saved by anything else is not one (a tokenizer,
    a README or another tool's weights next to the config make it foreign). Entries named in
    ``ignore`` (e.g. a run's ``checkpoint-N`` folders) are left out of the comparison."""
    names = set(os.listdir(path)) - set(ignore)
    if "config.json" not in names or "model.safetensors" not in names or \
            not names <= {"config.json", "generation_config.json", "model.safetensors"}:
        return False
    try:
        with open(os.path.join(path, "model.safetensors"), "rb") as f:
            header, _ = _read_header(f, path)
    except (OSError, CheckpointError):
        return False
    return (header.get("__metadata__") or {}).get("producer") == EXPORT_PRODUCER


def save_pretrained_streamed(model, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write a standard Hugging Face model directory (config + ``model.safetensors``) from the fp32 masters.

    The weights are written straight from the host store (no copy of the model in memory; bf16
    converts one tensor at a time) into ``out_dir``, which may already hold other files (they are
    kept; ``model.safetensors`` / ``config.json`` are replaced). Tied weights are saved once,
    under the first name that holds them (as ``save_pretrained`` does).
    :func:`megatrain.export_pretrained` is the atomic (temporary directory + rename) form.
    """
    eng = _engine(model)
    eng.sync_host()
    os.makedirs(out_dir, exist_ok=True)
    # frozen entries (no master): their compute copy
    tensors = [(e.name, _entry_tensor(eng, u, i, "compute" if e.frozen else "master"))
               for u in eng.units for i, e in enumerate(u.entries)]
    persistent = []
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set and b.is_floating_point():
                persistent.append((f"{mname}.{bname}" if mname else bname, b.detach().to("cpu", torch.float32)
                                   .contiguous()))
    tmp = os.path.join(out_dir, ".model.safetensors.tmp")
    with eng.state_window(write=False):  # the disk units' masters: one unit's buffer at a time
        _write_safetensors(tmp, tensors + persistent, metadata={"format": "pt", "producer": EXPORT_PRODUCER},
                           dtype=dtype)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg.save_pretrained(out_dir)
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            c = json.load(f)
        c["use_cache"] = True  # (no user flags recorded: a saved model generates with a cache)
        write_cache_flags(c, getattr(eng, "user_cache_flags", {}))  # the user's, nested configs too
        c["dtype"] = str(dtype).replace("torch.", "")
        with open(path, "w") as f:
            json.dump(c, f, indent=2)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(out_dir)
        except Exception:  # noqa: BLE001 - an invalid generation config must not lose the weights
            pass
    return out_dir
