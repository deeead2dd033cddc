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

import os
from typing import Dict, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..runtime.engine.state_access import StateAccess
from ..runtime.wrap_options import WrapOptions
from .init_replay import _aliases, _InitRecorder, _RecordedInitSource  # noqa: F401 - _aliases: public here too
from .safetensors_index import CheckpointError, CheckpointIndex, read_safetensors_header  # noqa: F401 - public here


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
    from ..runtime.model.wrap import UnsupportedModelError

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


def count_nonfinite(t: torch.Tensor, chunk_numel: int = 1 << 24) -> int:
    """How many elements of floating-point tensor ``t`` (any device, any float dtype; not changed) are
    NaN or +-inf, checked ``chunk_numel`` elements at a time (a temporary of 1 B per element of a
    chunk, never of the whole tensor: an embedding can be gigabytes)."""
    flat = t.detach().reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), chunk_numel):
        part = flat[start:start + chunk_numel]
        if not bool(torch.isfinite(part).all()):
            bad += int(part.numel() - torch.isfinite(part).sum())
    return bad


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
        """Reads every parameter into the store.

        Raises:
            CheckpointError: a tensor holds NaN or inf (names it and its file): training would start
                from it and every loss would be NaN.
        """
        access = StateAccess(eng)
        try:
            for u in access.units:
                for i, e in enumerate(u.entries):
                    key = self.keys[e.name]
                    dst = access.view(u, i, "compute" if e.frozen else "master")
                    self.index.read_into(key, dst)
                    bad = count_nonfinite(dst)
                    if bad:
                        raise CheckpointError(
                            f"megatrain: tensor {key} in {self.index.tensors[key][0]} holds {bad} non-finite "
                            f"value(s) (NaN or inf) of {dst.numel()}; training would start from them: use an intact "
                            "checkpoint")
        finally:
            self.index.close()


# ---------------------------------------------------------------------------------------------- init replay
def _check_offload(options, where: str) -> None:
    """``offload_dir`` / ``host_memory_limit`` checked first, as ``wrap`` checks them (ValueError)."""
    from ..runtime.placement.disk_plan import check_offload_args

    check_offload_args(options.offload_dir, options.host_memory_limit, where)


def _wrap_with(model, source, options):
    from ..runtime.model.wrap import _wrap

    return _wrap(model, options, source=source)


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
            ``device_state_layers``, ``offload_dir``, ``host_memory_limit``, ``gpu_memory_limit``,
            ``liger_kernel``, ...; the same defaults: ``activation_policy="auto"`` on CUDA); the others go to
            ``AutoModelForCausalLM.from_config`` (e.g. ``attn_implementation``).

    Returns:
        The wrapped model (as :func:`megatrain.wrap` returns it).

    Raises:
        CheckpointError: no config / weights, a shard missing, an index naming a file that is not
            there, a truncated file, a tensor of the wrong shape or dtype, a parameter the
            checkpoint lacks (raised before the store is allocated), or a tensor holding NaN or inf
            (raised while the store is filled). The message names the file and the tensor.
        UnsupportedModelError, ValueError, HostMemoryError: as :func:`megatrain.wrap`.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"megatrain.from_pretrained: {path} is not a local directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"megatrain.from_pretrained: {path} has no config.json")
    options, model_kwargs = WrapOptions.split(kwargs, "megatrain.from_pretrained")
    _check_offload(options, "megatrain.from_pretrained")
    index = CheckpointIndex(path)
    config = _load_config(path)
    model = meta_model(config, **model_kwargs)
    source = _CheckpointSource(model, index)  # validates every parameter before anything is allocated
    init_buffers(model, index)
    model.eval()  # as AutoModelForCausalLM.from_pretrained returns it
    return _wrap_with(model, source, options)


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
    options, model_kwargs = WrapOptions.split(kwargs, "megatrain.from_config")
    _check_offload(options, "megatrain.from_config")  # before the RNG is seeded or anything is built
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
    return _wrap_with(model, source, options)

