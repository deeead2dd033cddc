"""Export a wrapped model's fp32 master weights as a standard Hugging Face model directory."""

from __future__ import annotations

import os
import re
import shutil

import torch
from torch import nn


def master_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict:
    """Return ``{name: tensor}`` for every parameter of a wrapped model, from the host store.

    Tensors are CPU copies in ``dtype`` (fp32: the master weights themselves, not the compute
    copy). Tied parameters appear under every name that holds them (as ``model.state_dict()``
    does); Hugging Face's ``save_pretrained`` drops the tied duplicates.

    Raises:
        ValueError: if ``model`` was not wrapped by ``megatrain.wrap``.
    """
    eng = getattr(model, "megatrain", None)
    if eng is None:
        raise ValueError("megatrain.export_pretrained: the model is not wrapped by megatrain.wrap")
    eng.sync_host()  # queued updates done, device-state layers copied to the host store
    by_id = {}
    for u in eng.units:
        for i, e in enumerate(u.entries):
            by_id[id(e.param)] = (u, i)
    sd = {}
    with eng.state_window(write=False):  # the disk units' masters are read through the tier
        for name, p in model.named_parameters(remove_duplicate=False):
            u, i = by_id[id(p)]
            sec = "compute" if u.entries[i].frozen else "master"  # frozen at wrap: only a compute copy
            sd[name] = eng.entry_view(u, i, sec).to(dtype=dtype, copy=True)
    for mname, mod in model.named_modules():  # persistent buffers only, as model.state_dict()
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                sd[f"{mname}.{bname}" if mname else bname] = b.detach().to("cpu", copy=True)
    return sd


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
    from .checkpoint import save_pretrained_streamed

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
    from .checkpoint import is_megatrain_export

    runs = _run_checkpoints(path)
    return set(os.listdir(path)) <= set(runs) or is_megatrain_export(path, ignore=runs)
