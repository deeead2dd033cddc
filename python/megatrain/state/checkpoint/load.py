"""``load_checkpoint``: verify a checkpoint directory, check it against the model, then read it into the store."""

from __future__ import annotations

import json
import os
import re
import warnings

import torch

from ...errors import CheckpointError
from ...runtime.engine.state_access import StateAccess
from ..safetensors_file import DTYPE_CODES, read_header, tensor_bytes
from .manifest import SCHEDULER, SECTIONS, STATE, verify_checkpoint
from .rng import set_rng_state

WHERE = "megatrain.load_checkpoint"


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
    access = StateAccess.of_model(model, "megatrain checkpoint")
    optimizer = _check_arguments(access, optimizer, lr_scheduler, restore_rng)
    m = verify_checkpoint(directory, WHERE)
    _check_layout(directory, m, access)  # before touching the store
    with open(os.path.join(directory, STATE)) as f:
        state = json.load(f)
    _check_saved_parts(directory, m, state, optimizer, lr_scheduler)
    # read before anything is written: a scheduler state that cannot be loaded fails here
    sched_state = (torch.load(os.path.join(directory, SCHEDULER), weights_only=True)
                   if lr_scheduler is not None else None)
    opt_state = state.get("optimizer")
    by_name = _params_by_name(access, optimizer, opt_state)
    sections = SECTIONS if optimizer is not None else ("master",)

    def restore() -> None:
        _restore_state(directory, access, optimizer, lr_scheduler, restore_rng, state, opt_state, by_name,
                       sched_state)

    dp = access.data_parallel
    if dp is not None:  # data parallel: every rank calls it at the same point; local rank 0 reads into the node's store
        what = f"{os.path.abspath(directory)} optimizer={optimizer is not None} scheduler={lr_scheduler is not None}"
        with dp.collective(WHERE, what):
            access.zero_grad()
            access.sync_before_read()
            dp.on_local0(lambda: _read_units(directory, m, access, sections), "load_checkpoint")
            access.reload()
            restore()
        return state.get("extra") or {}
    access.zero_grad()  # gradients accumulated before the load belong to other weights
    access.sync_before_read()  # (without the optimizer only masters are read: the moments stay as they are)
    _read_units(directory, m, access, sections)
    restore()
    return state.get("extra") or {}


def _check_arguments(access: StateAccess, optimizer, lr_scheduler, restore_rng):
    """The optimizer itself (unwrapped from an accelerate wrapper); refuses a foreign optimizer, a
    scheduler that is not one, a ``restore_rng`` that is not a bool."""
    if optimizer is not None and not hasattr(optimizer, "engine"):
        optimizer = getattr(optimizer, "optimizer", optimizer)
    if optimizer is not None and not access.is_engine_of(optimizer):
        raise ValueError("megatrain.load_checkpoint: the optimizer is not a megatrain.optim.CPUAdamW of this model")
    if lr_scheduler is not None and (isinstance(lr_scheduler, torch.optim.Optimizer)
                                     or not callable(getattr(lr_scheduler, "load_state_dict", None))):
        raise ValueError(f"megatrain.load_checkpoint: lr_scheduler must be an LR scheduler (with load_state_dict), got "
                         f"a {type(lr_scheduler).__name__}; pass the optimizer as optimizer=...")
    if not isinstance(restore_rng, bool):
        raise TypeError(f"megatrain.load_checkpoint: restore_rng must be True or False, got {restore_rng!r}")
    return optimizer


def _check_layout(directory: str, m: dict, access: StateAccess) -> None:
    """The manifest's units hold the model's entries, names and shapes, in order."""
    if len(m["units"]) != len(access.units):
        saved, model = (sum(k == "layer" for k in kinds) for kinds in
                        ([mu.get("kind") for mu in m["units"]], [u.kind for u in access.units]))
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} holds {saved} decoder layers, the model has {model} "
                              f"({len(m['units'])} against {len(access.units)} units with the embedding, norm and head: "
                              "a different num_hidden_layers or architecture?)")
    for mu, u in zip(m["units"], access.units):
        want = [[e.name, list(e.shape)] for e in u.entries]
        if mu["entries"] != want:
            names = lambda es: [e[0] for e in es]  # noqa: E731
            # the cause first, before the name / shape lists (long for a big layer)
            raise CheckpointError(
                f"megatrain.load_checkpoint: {directory} was saved from another model (a different architecture, "
                f"shapes or tie_word_embeddings?): {_unit_name(u)} holds {names(mu['entries'])}, the model's "
                f"{names(want)}"
                if names(mu["entries"]) != names(want) else
                f"megatrain.load_checkpoint: {directory} was saved from a model of another size: {_unit_name(u)} has "
                f"shapes {[e[1] for e in mu['entries']]}, the model's {[e[1] for e in want]}")


def _unit_name(u) -> str:
    """``unit 1 (model.layers.1.*)`` / ``unit 0 (the embedding, final norm and head)``: a unit as the user knows it."""
    if u.kind != "layer":
        return f"unit {u.index} (the embedding, final norm and head)"
    first = u.entries[0].name if u.entries else ""
    layer = re.match(r"^(.*?\.\d+)\.", first)
    return f"unit {u.index} ({layer.group(1) if layer else first}.*)"


def _check_saved_parts(directory: str, m: dict, state: dict, optimizer, lr_scheduler) -> None:
    """The optimizer / scheduler state asked for was saved; warns of a saved scheduler state left out."""
    if optimizer is not None and state.get("optimizer") is None:
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} was saved without optimizer state")
    if lr_scheduler is not None and SCHEDULER not in m["files"]:
        raise CheckpointError(f"megatrain.load_checkpoint: {directory} has no {SCHEDULER} (saved without a scheduler)")
    if lr_scheduler is None and optimizer is not None and SCHEDULER in m["files"]:
        warnings.warn(f"megatrain.load_checkpoint: {directory} holds an LR scheduler state ({SCHEDULER}) that is not "
                      "restored: pass lr_scheduler=... to resume the schedule where it stopped", UserWarning,
                      stacklevel=3)


def _params_by_name(access: StateAccess, optimizer, opt_state) -> dict:
    """``{entry name: parameter}`` of the optimizer's params, after checking its groups match the saved ones."""
    if optimizer is None:
        return {}
    names = [[access.param_name(p) for p in g["params"]] for g in optimizer.param_groups]
    saved = [g["params"] for g in opt_state["param_groups"]]
    if names != saved:
        raise CheckpointError(f"megatrain.load_checkpoint: the optimizer's param groups ({len(names)} groups, "
                              f"{[len(n) for n in names]} params) differ from the checkpoint's "
                              f"({len(saved)} groups, {[len(n) for n in saved]} params)")
    return {access.param_name(p): p for g in optimizer.param_groups for p in g["params"]}


def _read_units(directory: str, m: dict, access: StateAccess, sections) -> None:
    with access.window(write=True):  # a unit on disk: read into the tier's buffer, written back
        for mu, u in zip(m["units"], access.units):
            _read_unit(os.path.join(directory, mu["file"]), access, u, sections)


def _read_unit(path: str, access: StateAccess, u, sections) -> None:
    """Read unit ``u``'s ``sections`` from its file straight into the store; refresh its compute copy."""
    with open(path, "rb") as f:
        header, base = read_header(f, path)
        for sec in sections:
            for i, e in enumerate(u.entries):
                if e.frozen and sec != "master":
                    continue
                key = f"{'compute' if e.frozen else sec}.{e.name}"
                want = DTYPE_CODES[torch.float32 if not e.frozen or access.compute_dtype == torch.float32
                                   else torch.bfloat16]
                info = header.get(key)
                if info is None or info["dtype"] != want or list(info["shape"]) != list(e.shape):
                    raise CheckpointError(f"megatrain.load_checkpoint: {path} has no {want} tensor {key} "
                                          f"of shape {list(e.shape)}")
                dst = access.view(u, i, "compute" if e.frozen else sec)
                b, end = info["data_offsets"]
                mv = tensor_bytes(dst)
                if end - b != len(mv):
                    raise CheckpointError(f"megatrain.load_checkpoint: {path}: {key} has {end - b} bytes, "
                                          f"expected {len(mv)}")
                f.seek(base + b)
                if f.readinto(mv) != len(mv):
                    raise CheckpointError(f"megatrain.load_checkpoint: {path} is truncated at {key}")
    with torch.no_grad():
        for i, e in enumerate(u.entries):
            if not e.frozen and not u.compute_absent:  # none in the store: cast from the master where it is loaded
                access.view(u, i, "compute").copy_(access.view(u, i, "master"))
    access.reload([u])  # device slots / the resident buffer reload from the new compute copy


def _restore_state(directory, access: StateAccess, optimizer, lr_scheduler, restore_rng, state, opt_state, by_name,
                   sched_state=None) -> None:
    access.mark_written()  # device-state layers take the loaded state
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
                          f"CPUAdamW(max_grad_norm={saved_mgn!r}) to train on as before", UserWarning, stacklevel=3)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(sched_state)
    if restore_rng:
        set_rng_state(state["rng"])
