"""Export a wrapped model's fp32 master weights as a standard Hugging Face model directory."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from torch import nn

from ..errors import CheckpointError
from ..runtime.engine.state_access import StateAccess
from ..runtime.model.model_config import write_cache_flags
from .atomic import umask_file_mode
from .safetensors_file import DeferredTensor, read_header, write_fp32_safetensors


def master_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict:
    """Return ``{name: tensor}`` for every parameter of a wrapped model, from the host store.

    Tensors are CPU copies in ``dtype`` (fp32: the master weights themselves, not the compute
    copy). Tied parameters appear under every name that holds them (as ``model.state_dict()``
    does); Hugging Face's ``save_pretrained`` drops the tied duplicates.

    Raises:
        ValueError: if ``model`` was not wrapped by ``megatrain.wrap``.
    """
    access = StateAccess.of_model(model, "megatrain.export_pretrained")
    access.sync_before_read()  # queued updates done, device-state layers copied to the host store
    by_id = {}
    for u in access.units:
        for i, e in enumerate(u.entries):
            by_id[id(e.param)] = (u, i)
    sd = {}
    with access.window(write=False):  # the disk units' masters are read through the tier
        for name, p in model.named_parameters(remove_duplicate=False):
            u, i = by_id[id(p)]
            sec = "compute" if u.entries[i].frozen else "master"  # frozen at wrap: only a compute copy
            sd[name] = access.view(u, i, sec).to(dtype=dtype, copy=True)
    for mname, mod in model.named_modules():  # persistent buffers only, as model.state_dict()
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                sd[f"{mname}.{bname}" if mname else bname] = b.detach().to("cpu", copy=True)
    return sd


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
            header, _ = read_header(f, path)
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
    access = StateAccess.of_model(model, "megatrain checkpoint")
    access.sync_before_read()
    os.makedirs(out_dir, exist_ok=True)
    # frozen entries (no master): their compute copy
    tensors = [(e.name, _entry_tensor(access, u, i, "compute" if e.frozen else "master"))
               for u in access.units for i, e in enumerate(u.entries)]
    persistent = []
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set and b.is_floating_point():
                persistent.append((f"{mname}.{bname}" if mname else bname, b.detach().to("cpu", torch.float32)
                                   .contiguous()))
    tmp = os.path.join(out_dir, ".model.safetensors.tmp")
    with access.window(write=False):  # the disk units' masters: one unit's buffer at a time
        write_fp32_safetensors(tmp, tensors + persistent, metadata={"format": "pt", "producer": EXPORT_PRODUCER},
                               dtype=dtype, hashing=False)
    os.replace(tmp, os.path.join(out_dir, "model.safetensors"))
    cfg = getattr(model, "config", None)
    if cfg is not None:
        cfg.save_pretrained(out_dir)
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            c = json.load(f)
        c["use_cache"] = True  # (no user flags recorded: a saved model generates with a cache)
        write_cache_flags(c, access.user_cache_flags or {})  # the user's, nested configs too
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


def _entry_tensor(access: StateAccess, u, i: int, sec: str):
    """Entry ``i``'s section view, taken only when its bytes are written for a disk unit's fp32 sections (a
    file is then written from one unit's buffer at a time instead of from a copy of every disk unit)."""
    if access.on_disk(u) and sec != "compute":
        return DeferredTensor(u.entries[i].shape, torch.float32, access.view_later(u, i, sec))
    return access.view(u, i, sec)


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _export_peft(model, tmp: str, dtype: torch.dtype, merge_adapter: bool) -> None:
    """A PEFT model: its adapter in PEFT's own format, or (``merge_adapter``) the merged base model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    sd = master_state_dict(model, dtype=torch.float32)
    if not merge_adapter:
        adapter = get_peft_model_state_dict(model, state_dict=sd)
        save_file({k: v.to(dtype).contiguous() for k, v in adapter.items()},
                  os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        umask_file_mode(os.path.join(tmp, "adapter_model.safetensors"))  # save_file makes it 0600
        model.peft_config[model.active_adapter].save_pretrained(tmp)
        return
    from peft.tuners.lora import LoraLayer

    name = model.active_adapter
    kind = str(getattr(model.peft_config[name], "peft_type", ""))
    if not kind.endswith("LORA"):  # (PeftType.LORA); IA3, prompt tuning, ... have no W + B @ A merge here
        raise ValueError(f"megatrain.export_pretrained: merge_adapter=True merges LoRA adapters only, this one is "
                         f"{kind.rsplit('.', 1)[-1]}; export the adapter (merge_adapter=False) and merge it with PEFT")
    prefix = "base_model.model."
    for mname, mod in model.named_modules():
        if isinstance(mod, LoraLayer) and name in getattr(mod, "lora_A", {}):
            if getattr(mod, "fan_in_fan_out", False) or getattr(mod, "use_dora", {}).get(name, False):
                raise ValueError(f"megatrain.export_pretrained: merging adapter {mname} (fan_in_fan_out / DoRA) is not "
                                 "supported; export the adapter (merge_adapter=False)")
            a = sd.pop(f"{mname}.lora_A.{name}.weight")
            b = sd.pop(f"{mname}.lora_B.{name}.weight")
            w = f"{mname}.base_layer.weight"
            sd[w] = sd[w] + (b @ a) * mod.scaling[name]
    out = {}
    for k, v in sd.items():
        if ".lora_" in k or ".original_module." in k:  # modules_to_save: the trained copy replaces the original
            continue
        k = k[len(prefix):] if k.startswith(prefix) else k
        out[k.replace(".base_layer.", ".").replace(f".modules_to_save.{name}.", ".")] = v
    stray = [k for k in out if ".modules_to_save." in k]
    if stray:
        raise ValueError(f"megatrain.export_pretrained: {stray[0]} belongs to another adapter than the active one "
                         f"({name}); export the adapter (merge_adapter=False)")
    base = model.get_base_model()
    seen, tensors = set(), {}
    for n, p in base.named_parameters(remove_duplicate=False):  # tied weights saved once (as save_pretrained)
        if id(p) in seen:
            out.pop(n, None)
        seen.add(id(p))
    for k, v in out.items():
        tensors[k] = v.to(dtype).contiguous()
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    umask_file_mode(os.path.join(tmp, "model.safetensors"))
    base.config.save_pretrained(tmp)


def export_pretrained(model: nn.Module, out_dir: str, dtype: torch.dtype = torch.float32,
                      merge_adapter: bool = False) -> str:
    """Write ``config.json`` + safetensors weights that ``AutoModelForCausalLM.from_pretrained`` loads.

    Weights come from the fp32 master copies, streamed from the host store tensor by tensor
    (extra host memory: one tensor for bf16, none for fp32). The directory is written under a
    temporary name next to ``out_dir`` and swapped into place atomically
    (:func:`megatrain.state.atomic.atomic_directory`), so a crash leaves the old or the new model there.

    Args:
        model: a model wrapped by ``megatrain.wrap`` (a ``transformers.PreTrainedModel``).
        out_dir: destination directory: new, empty, or an earlier megatrain export (only
            ``config.json``, ``generation_config.json`` and megatrain-marked ``model.safetensors``),
            which is replaced. It may also hold a run's ``checkpoint-N/`` folders (the Hugging Face
            layout): they are kept, and the model files are then replaced one by one (each
            atomically) instead of the whole directory. Any other model directory is refused
            (nothing is deleted).
        dtype: dtype of the saved weights (``torch.float32`` or ``torch.bfloat16``).
        merge_adapter: a PEFT model only. False (default): write the adapter in PEFT's format
            (``adapter_config.json`` + ``adapter_model.safetensors``, loaded back by
            ``PeftModel.from_pretrained(base, out_dir)``). True: write the base model with the
            LoRA update merged into it (``W + scaling * B @ A``), a plain transformers directory.
            Frozen weights come from their compute copy (the store keeps no master for them).

    Returns:
        ``out_dir``.

    Raises:
        ValueError: the model is not wrapped, ``dtype`` is neither fp32 nor bf16, or ``out_dir``
            is a file or a non-empty directory that is not its own earlier export (it would be deleted).
    """
    from .atomic import atomic_directory, check_replaceable, make_temp_dir
    if getattr(model, "megatrain", None) is None:
        raise ValueError("megatrain.export_pretrained: the model is not wrapped by megatrain.wrap")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"megatrain.export_pretrained: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    expected = ("an earlier megatrain.export_pretrained output (config.json, generation_config.json, "
                "model.safetensors marked by megatrain, beside checkpoint-N/ folders, nothing else)")
    if _is_peft(model):
        out_dir = check_replaceable(out_dir, "megatrain.export_pretrained", None, "a new or empty directory")
        with atomic_directory(out_dir, "megatrain.export_pretrained", None, "a new or empty directory") as tmp:
            _export_peft(model, tmp, dtype, merge_adapter)
        return out_dir
    if merge_adapter:
        raise ValueError("megatrain.export_pretrained: merge_adapter=True needs a PEFT model")
    out_dir = check_replaceable(out_dir, "megatrain.export_pretrained", _own_or_run_dir, expected)
    keep = _run_checkpoints(out_dir) if os.path.isdir(out_dir) else []
    if not keep:
        with atomic_directory(out_dir, "megatrain.export_pretrained", _own_or_run_dir, expected) as tmp:
            save_pretrained_streamed(model, tmp, dtype=dtype)
        return out_dir
    # The run's checkpoint-N/ folders stay: the model files are written beside the directory and
    # moved in one by one (each atomically, weights first); an own file the new export lacks goes.
    tmp = make_temp_dir(os.path.dirname(out_dir), f".{os.path.basename(out_dir)}.tmp-export-")
    try:
        save_pretrained_streamed(model, tmp, dtype=dtype)
        new = sorted(os.listdir(tmp), key=lambda n: n != "model.safetensors")
        for name in new:
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
        for name in _EXPORT_FILES - set(new):
            if os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


_EXPORT_FILES = {"config.json", "generation_config.json", "model.safetensors"}
_RUN_CHECKPOINT = re.compile(r"checkpoint-\d+")


def _run_checkpoints(path: str) -> list:
    """The ``checkpoint-N/`` folders of a training run's output directory (the Hugging Face layout)."""
    return [n for n in os.listdir(path) if _RUN_CHECKPOINT.fullmatch(n) and os.path.isdir(os.path.join(path, n))
            and not os.path.islink(os.path.join(path, n))]


def _own_or_run_dir(path: str) -> bool:
    """An earlier export, or a run directory whose only other content is checkpoint-N/ folders."""
    runs = _run_checkpoints(path)
    return set(os.listdir(path)) <= set(runs) or is_megatrain_export(path, ignore=runs)
