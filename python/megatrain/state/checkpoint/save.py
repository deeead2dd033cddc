"""``save_checkpoint``: every training state of a wrapped model, unit by unit, into a directory swapped in atomically."""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch

from ...errors import CheckpointError
from ...runtime.engine.state_access import StateAccess
from ..atomic import atomic_directory, check_replaceable
from ..safetensors_file import HashingWriter, file_digest, write_state_safetensors
from .manifest import FORMAT, MANIFEST, SCHEDULER, SECTIONS, STATE, VERSION, is_checkpoint_dir, unit_file
from .rng import jsonable, rng_state

WHERE = "megatrain.save_checkpoint"


def write_json(path: str, obj, sync: bool = True) -> dict:
    """Write ``obj`` as indented JSON; returns ``{"sha256": hex, "bytes": n}`` of the file."""
    w = HashingWriter(path, sync)
    w.write(json.dumps(obj, indent=1).encode())
    return w.close()


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
        ValueError: the optimizer is not this model's, ``lr_scheduler`` has no ``state_dict()``, the call falls
            between backward() and step() while updates run, or ``extra`` is not a JSON-serialisable dict.
        TypeError: ``directory`` is not a path.

    Warns:
        UserWarning: called between backward() and step() (with clipping, or within accumulation): the
            gradients since the last step are not saved, so a resume runs those micro-batches again.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"megatrain.save_checkpoint: directory must be a path (str or os.PathLike), got "
                        f"{type(directory).__name__}; the call is save_checkpoint(directory, model, optimizer, ...)")
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"megatrain.save_checkpoint: extra must be a dict (load_checkpoint returns it as one), got "
                         f"{type(extra).__name__}")
    if lr_scheduler is not None and (isinstance(lr_scheduler, torch.optim.Optimizer)
                                     or not callable(getattr(lr_scheduler, "state_dict", None))):
        raise ValueError(f"megatrain.save_checkpoint: lr_scheduler must be an LR scheduler (with state_dict), got a "
                         f"{type(lr_scheduler).__name__}; the call is save_checkpoint(directory, model, optimizer, "
                         "lr_scheduler=None, extra=None): pass extra=... by keyword")
    access = StateAccess.of_model(model, "megatrain checkpoint")
    check_replaceable(directory, WHERE, is_checkpoint_dir, "a megatrain checkpoint", CheckpointError)
    if optimizer is not None:
        optimizer = getattr(optimizer, "optimizer", optimizer) if not hasattr(optimizer, "engine") else optimizer
        if not access.is_engine_of(optimizer):
            raise ValueError("megatrain.save_checkpoint: the optimizer is not a megatrain.optim.CPUAdamW of this model")
    access.check_failed()  # a failed CPU worker or disk tier: its error, not a checkpoint of partial state
    if access.updates_running():
        # Without clipping the layers' updates start during backward: a checkpoint now would hold
        # some units after this step's update and the others before it.
        raise ValueError("megatrain.save_checkpoint: called between backward() and optimizer.step() while updates "
                         "are already running (no max_grad_norm); save after optimizer.step()")
    if optimizer is not None and access.grads_pending():
        warnings.warn("megatrain.save_checkpoint: called between backward() and optimizer.step(): the gradients of the "
                      "micro-batches since the last step() are not saved (torch's state_dicts hold no gradients "
                      "either), so a resume from it runs that step's micro-batches again; save after step()",
                      UserWarning, stacklevel=2)
    try:
        extra_json = json.loads(json.dumps(extra if extra is not None else {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"megatrain.save_checkpoint: extra must be JSON-serialisable: {e}") from None
    dp = access.data_parallel
    if dp is not None:  # data parallel: every rank calls it at the same point; global rank 0 writes the one checkpoint
        with dp.collective(WHERE, os.path.abspath(directory)):
            access.sync_before_read()  # this rank's updates; rank 0's also waits for every peer's
            return dp.on_rank0(lambda: _save(directory, access, optimizer, lr_scheduler, extra_json),
                               "save_checkpoint", os.path.abspath(directory))
    access.sync_before_read()  # queued Adam updates and gradient accumulation are done; device-state layers copied
    return _save(directory, access, optimizer, lr_scheduler, extra_json)


def _save(directory: str, access: StateAccess, optimizer, lr_scheduler, extra_json) -> str:
    # A unit whose state is on disk is written from the tier's buffer (acquired, written, released).
    with atomic_directory(directory, WHERE, is_checkpoint_dir, "a megatrain checkpoint", CheckpointError) as tmp, \
            access.window(write=False):
        files = {}
        units = [_write_unit(tmp, access, u, files) for u in access.units]
        state = {"extra": extra_json, "rng": rng_state(), "optimizer": None}
        if optimizer is not None:
            state["optimizer"] = _optimizer_state(access, optimizer)
        files[STATE] = write_json(os.path.join(tmp, STATE), state, sync=False)
        if lr_scheduler is not None:
            torch.save(lr_scheduler.state_dict(), os.path.join(tmp, SCHEDULER))
            files[SCHEDULER] = file_digest(os.path.join(tmp, SCHEDULER))
        manifest = {"format": FORMAT, "version": VERSION, "compute_dtype": str(access.compute_dtype),
                    "num_params": sum(u.numel for u in access.units), "units": units, "files": files}
        write_json(os.path.join(tmp, MANIFEST), manifest, sync=False)
    return os.path.abspath(directory)


def _write_unit(tmp: str, access: StateAccess, u, files: dict) -> dict:
    """Write unit ``u``'s file into ``tmp`` (its digest into ``files``); returns its manifest entry."""
    fname = unit_file(u.index)
    tensors = [(f"{sec}.{e.name}", access.view(u, i, sec))
               for sec in SECTIONS for i, e in enumerate(u.entries) if not e.frozen]
    # frozen entries (no fp32 state): their compute copy, exactly what trains against
    frozen = [(f"compute.{e.name}", access.view(u, i, "compute").contiguous())
              for i, e in enumerate(u.entries) if e.frozen]
    # each in its own dtype: the fp32 state, and a frozen entry's compute copy in the compute dtype (what
    # load_checkpoint reads back); sync=False: atomic_directory fsyncs every file of tmp once, before the swap
    files[fname] = write_state_safetensors(os.path.join(tmp, fname), tensors, frozen=frozen,
                                           metadata={"format": "pt", "megatrain_unit": u.index}, sync=False)
    return {"index": u.index, "kind": u.kind, "file": fname, "entries": [[e.name, list(e.shape)] for e in u.entries]}


def _optimizer_state(access: StateAccess, optimizer) -> dict:
    """Param groups (by parameter name), per-parameter Adam steps and ``max_grad_norm``, as JSON."""
    groups = []
    steps = {}
    for g in optimizer.param_groups:
        hyper = {k: jsonable(v) for k, v in g.items() if k != "params"}
        groups.append({"params": [access.param_name(p) for p in g["params"]], **hyper})
        for p in g["params"]:
            # (the state was synced above: a plain dict read, which hands nothing out writable)
            steps[access.param_name(p)] = float(dict.__getitem__(optimizer.state[p], "step"))
    return {"param_groups": groups, "steps": steps, "max_grad_norm": optimizer.max_grad_norm}
