"""``megatrain.estimate``: the memory a wrapped model will take, said before anything is allocated.

The host numbers come from the code that allocates: the model's units are built the way
``wrap`` builds them (:func:`megatrain.runtime.model.wrap.model_units`, on a meta model when given a
config or a directory) and sized by :func:`megatrain.runtime.engine.units.plan_host_memory`, whose
store part is the C++ ``HostStore.layout_required`` (the planning the store's constructor runs).
Whether they fit is decided by the rules of the engine's budget check
(:func:`megatrain.runtime.placement.host_memory.host_budget_shortfall`).
"""

from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
from torch import nn


from .memory_estimate import MemoryEstimate, _count, _fmt  # noqa: F401 - _count: public here too
from ..model.model_config import config_value

# Host memory ``megatrain train`` keeps free beyond everything the estimate counts (the Python
# process and its libraries, allocator slack, the rough activation estimate on the CPU device):
# a run that would leave less is refused before it starts, by --dry-run and the real run alike.
RUN_HOST_MARGIN_BYTES = 1 << 30


def _cfg_int(cfg, *names, default=None):
    for n in names:
        v = config_value(cfg, n, None)  # a per-layer attribute (heterogeneous config): its largest value
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def _activation_bytes(config, num_layers: int, tokens: int, elem: int, policy: str, block_k: int,
                      free: Optional[int], mlp_rows: Optional[int] = None) -> tuple:
    """Rough device bytes of activations (and the policy ``auto`` would pick) for ``tokens`` tokens."""
    if not tokens or config is None:
        return 0, policy
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = _cfg_int(cfg, "hidden_size", "n_embd", "d_model", default=0)
    inter = _cfg_int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h
    heads = _cfg_int(cfg, "num_attention_heads", "n_head", default=1) or 1
    kv = _cfg_int(cfg, "num_key_value_heads", default=heads) or heads
    head_dim = _cfg_int(cfg, "head_dim", default=h // heads if heads else h) or 1
    q_dim = heads * head_dim
    kv_dim = kv * head_dim
    layer_in = tokens * h * elem
    # One layer's saved activations with a fused attention kernel: norms, q/k/v, attention output,
    # o_proj, residuals, and the MLP's gate/up/activation/product.
    per_layer = tokens * elem * (6 * h + 2 * q_dim + 2 * kv_dim + 4 * inter)
    if mlp_rows:  # tiled MLP: its input is kept, one tile's intermediates and gradients exist at a time
        per_layer += mlp_rows * inter * elem * 6 - tokens * elem * 4 * inter
    chosen = policy
    if policy == "auto":
        from ..activations.policies import AUTO_STORE_FRACTION

        chosen = "store" if free is not None and per_layer * num_layers <= AUTO_STORE_FRACTION * free else "recompute"
        if free is not None and chosen == "recompute" and num_layers * layer_in > AUTO_STORE_FRACTION * free:
            from ..activations.long_context import checkpoint_spacing  # as wrap's auto: not one saved input per layer fits

            block_k = checkpoint_spacing(num_layers, layer_in, AUTO_STORE_FRACTION * free)
            chosen = f"block:{block_k}" if block_k > 1 else chosen
    if chosen == "store":
        act = num_layers * per_layer
    elif chosen == "offload":  # inputs parked in host memory: the one prefetched and the one in use
        act = 2 * layer_in + per_layer
    elif chosen.startswith("block:"):
        act = math.ceil(num_layers / block_k) * layer_in + block_k * per_layer
    else:
        act = num_layers * layer_in + per_layer
    return act + 2 * layer_in, chosen  # + the gradient flowing back and the current input


def _logits_bytes(config, tokens: int, elem: int, loss_rows: Optional[int]) -> int:
    if not tokens or config is None:
        return 0
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = _cfg_int(cfg, "vocab_size", default=0)
    if loss_rows:  # the chunked loss: one chunk of logits at a time (docs/long_context.md)
        return min(tokens, loss_rows) * vocab * (2 * elem + 20)
    return tokens * vocab * (elem + 4 + 4)  # logits, their fp32 upcast, the fp32 gradient


def _long_context_rows(module, config, layers, tokens: int, elem: int, free: Optional[int], chunked_loss,
                       tile_mlp) -> tuple:
    """``(loss_rows, mlp_rows, norm_rows)`` that ``wrap``'s ``chunked_loss`` / ``tile_mlp`` would use at ``tokens``."""
    from ..activations import long_context as lc
    from ..activations.tiling import mlp_of, norms_of

    if not tokens or config is None:
        return None, None, None
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    h = _cfg_int(cfg, "hidden_size", "n_embd", "d_model", default=0)
    inter = _cfg_int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h
    vocab = _cfg_int(cfg, "vocab_size", default=0)
    room = float("inf") if free is None else free  # unknown (CUDA not here): as if it all fits
    loss_rows = lc.loss_rows_for(chunked_loss, tokens, vocab, elem, room) if lc.loss_supported(module)[0] else None
    has_mlp = any(mlp_of(layer) is not None for layer in layers)
    mlp_rows = lc.mlp_rows_for(tile_mlp, tokens, inter, elem, room) if has_mlp else None
    has_norms = any(norms_of(layer) for layer in layers)
    norm_rows = lc.norm_rows_for(tile_mlp, tokens, h, room) if has_norms else None
    return loss_rows, mlp_rows, norm_rows


# Weight files of a Hugging Face model directory (any of them: not "config.json alone").
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def has_weight_files(path: str) -> bool:
    """Whether model directory ``path`` holds weight files (:data:`WEIGHT_FILES`); without, it is
    estimated from its ``config.json`` alone (before the weights are downloaded)."""
    import glob

    return any(glob.glob(os.path.join(glob.escape(path), p)) for p in WEIGHT_FILES)


def device_name(device: torch.device) -> str:
    """How messages name the device a run was checked against: "this CPU", "cuda:0 (NVIDIA H200)"."""
    if device.type == "cpu":
        return "this CPU"
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def _offload_would_fit(units, compute_dtype, accum_mode, staging_buffers, reclaim, cuda, accumulating,
                       host_memory_limit, device_need) -> Optional[tuple]:
    """``(disk layers, disk bytes, host_memory_limit)`` of the fewest decoder layers whose fp32 state on
    disk makes the host part fit, or None when even every layer on disk does not (the compute copies,
    the resident unit and the staging stay in host memory): then ``offload_dir`` cannot help.

    ``device_need``: bytes the CPU device's slots and activations take beside the store. The disk tier
    plans for the host part alone, so the ``host_memory_limit`` returned (None: none needed) keeps
    that much free."""
    from .disk_plan import plan_offload
    from .host_memory import host_budget_shortfall, host_memory_limits
    from ..options import options

    cap = host_memory_limit
    available = host_memory_limits()["mem_available_bytes"]
    if device_need and available is not None:  # the CPU device's bytes come out of the same memory
        cap = min(cap if cap is not None else available, available - device_need)
        if cap <= 0:
            return None
    # offload_dir only names a filesystem to plan for: nothing is created there
    plan = plan_offload(units, compute_dtype, accum_mode, staging_buffers, offload_dir=os.sep,
                        host_memory_limit=cap, reclaimable_bytes=reclaim, cuda=cuda,
                        num_buffers=options().disk_buffers, with_accumulator=accumulating, check=False)
    if not plan.disk_units or host_budget_shortfall(plan.host_bytes, plan.pinned_bytes, reclaim) is not None:
        return None
    if cap is not None and plan.host_bytes > cap:
        return None
    return len(plan.disk_units), plan.disk_total_bytes, cap if cap != host_memory_limit else None


def _model_and_kind(model, model_kwargs, transform):
    """The model to plan (meta for a config / directory), its config, and whether its weights are in memory."""
    from ...state.loading import CheckpointError, CheckpointIndex, _CheckpointSource, _load_config, meta_model

    if isinstance(model, nn.Module):
        if getattr(model, "megatrain", None) is not None:
            raise ValueError("megatrain.estimate: this model is already wrapped; its store is "
                             "model.megatrain.store.section_bytes (model.megatrain.memory_stats())")
        if transform is not None:
            raise ValueError("megatrain.estimate: transform= applies to a config or a model directory; transform "
                             "the module before estimating it")
        return model, getattr(model, "config", None), True
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise CheckpointError(f"megatrain.estimate: {path} is not a local directory (give a model directory, a "
                                  "transformers config or an nn.Module)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"megatrain.estimate: {path} has no config.json")
        weights = has_weight_files(path)
        index = CheckpointIndex(path) if weights else None  # headers only
        config = _load_config(path)
        meta = meta_model(config, **model_kwargs)
        if index is not None:
            _CheckpointSource(meta, index)  # every parameter present with its shape (headers only)
    else:
        from transformers import PretrainedConfig

        if not isinstance(model, PretrainedConfig):
            raise TypeError(f"megatrain.estimate: expected an nn.Module, a transformers config or a local model "
                            f"directory, got {type(model).__name__}")
        config = model
        meta = meta_model(config, **model_kwargs)
    if transform is not None:
        with torch.device("meta"):
            meta = transform(meta)
    return meta, config, False


def estimate(model, *, device=None, compute_dtype: Optional[torch.dtype] = None, activation_policy: Optional[str] = None,
             num_slots: int = 2, grad_accumulator: Optional[bool] = None, gradient_accumulation_steps: int = 1,
             max_grad_norm: Optional[float] = None, trainable: Optional[Callable[[str], bool]] = None,
             transform=None, micro_batch_size: int = 1, seq_len: Optional[int] = None,
             staging_buffers: int = 4, chunked_loss="auto", tile_mlp="auto", offload_dir=None,
             host_memory_limit: Optional[int] = None, host_margin_bytes: int = 0, gpu_memory_limit=None,
             **model_kwargs) -> MemoryEstimate:
    """The host and device memory ``wrap`` / ``from_pretrained`` / ``from_config`` would take, without allocating.

    Args:
        model: an ``nn.Module`` (as ``wrap`` takes it; not changed), a ``transformers``
            ``PretrainedConfig`` (as ``from_config``) or a local Hugging Face model directory
            (as ``from_pretrained``: only ``config.json`` and the safetensors headers are read,
            and every parameter is checked present with its shape; never the weights). A
            directory with ``config.json`` and no weight files is estimated from the config alone
            (a note says so): whether a model fits can be asked before downloading it.
        device, compute_dtype, activation_policy, num_slots, grad_accumulator: as :func:`megatrain.wrap`
            (same defaults: CUDA when available; bf16 on CUDA, fp32 on CPU; ``activation_policy``
            ``"auto"`` on CUDA, ``"recompute"`` on CPU).
        gpu_memory_limit: as :func:`megatrain.wrap`: the free device memory the estimate checks
            against is capped the same way.
        gradient_accumulation_steps, max_grad_norm: as ``CPUAdamW`` will get them. With the default
            ``grad_accumulator=None``, ``gradient_accumulation_steps > 1`` allocates the fp32
            accumulator (4 B per trainable parameter); ``max_grad_norm`` changes no byte (the
            clip reads the gradients where they are).
        trainable: ``name -> bool`` (parameter names as ``named_parameters`` gives them); the
            others are frozen (2 B/param in bf16). None: as the model has them
            (``requires_grad``), everything for a config or a directory.
        transform: ``model -> model`` run on the meta model of a config / directory (as
            ``from_config(transform=)``), e.g. ``lambda m: peft.get_peft_model(m, lora_config)``.
        micro_batch_size, seq_len: the batch the activation estimate is for (``seq_len=None``:
            no activation estimate).
        staging_buffers: the engine's gradient staging buffers (4).
        chunked_loss, tile_mlp: as :func:`megatrain.wrap`; the estimate says what they would use
            at this batch (``loss_rows`` / ``mlp_rows`` / ``norm_rows``) and counts it.
        offload_dir, host_memory_limit: as :func:`megatrain.wrap`: which layers' fp32 state would
            go to disk (the same planning, :func:`megatrain.runtime.placement.disk_plan.plan_offload`), the
            disk bytes against the free space of ``offload_dir``'s filesystem, and the tier's RAM
            buffers in the host bytes. Nothing is created.
        host_margin_bytes: host memory kept free beyond everything counted (the Python process,
            allocator slack, the error of the rough activation estimate): it must fit too, beside
            the host bytes (and, on the CPU device, beside the slots and activations). 0 (default):
            the engine's own allocation check, exact; ``megatrain train`` passes
            :data:`RUN_HOST_MARGIN_BYTES`.
        **model_kwargs: passed to ``AutoModelForCausalLM.from_config`` for a config / directory.

    Returns:
        :class:`MemoryEstimate` (``str()`` prints it): host bytes per store section (exact: the
        same planning as the allocation), the accumulator, staging, pinned bytes, frozen vs
        trainable counts, device bytes (slots and the resident unit exact, activations and
        logits rough), the disk tier (``disk_layers``, ``disk_bytes`` vs ``disk_free_bytes``,
        ``disk_pool_bytes``), whether it fits this machine (the budget check's limits: MemAvailable,
        cgroup, RLIMIT_MEMLOCK, ``host_memory_limit``; ``torch.cuda.mem_get_info`` for a CUDA
        device; the disk's free space) and, if not, why (``reason()``, one line) and what to
        change (``advice``: only changes that would make it fit there). Messages name the device
        checked (``device_name``: "this CPU", "cuda:0 (NVIDIA H200)").

    Raises:
        CheckpointError: a directory without config.json, with weights but no safetensors, or
            missing a parameter.
        UnsupportedModelError: no decoder layer list (as ``wrap``).
        ValueError / TypeError: a bad option or input.
    """
    from .disk_plan import check_offload_args, plan_offload
    from .host_memory import host_budget_shortfall, host_memory_limits
    from ..options import options
    from ..engine.units import plan_host_memory
    from ..model.wrap import UnsupportedModelError, check_activation_policy, find_decoder_layers, model_units

    from .device_state_plan import capped_free_bytes, check_gpu_memory_limit, resolve_gpu_memory_limit
    from ..activations.policies import default_activation_policy

    offload_dir = check_offload_args(offload_dir, host_memory_limit, "megatrain.estimate")
    check_gpu_memory_limit(gpu_memory_limit, "megatrain.estimate: gpu_memory_limit")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if activation_policy is None:
        activation_policy = default_activation_policy(device)
    block_k = check_activation_policy(activation_policy, "megatrain.estimate: activation_policy")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"megatrain.estimate: device must be a CUDA device or 'cpu', got {str(device)!r}")
    if compute_dtype is None:
        compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"megatrain.estimate: compute_dtype must be torch.bfloat16 or torch.float32, got {compute_dtype}")
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(f"megatrain.estimate: gradient_accumulation_steps must be an int >= 1, got "
                         f"{gradient_accumulation_steps!r}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"megatrain.estimate: micro_batch_size must be an int >= 1 (sequences per micro-batch), "
                         f"got {micro_batch_size!r}")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
        raise ValueError(f"megatrain.estimate: seq_len must be an int >= 1 (tokens per sequence) or None, got {seq_len!r}")
    if gradient_accumulation_steps > 1 and grad_accumulator is False:
        raise ValueError("megatrain.estimate: gradient_accumulation_steps > 1 needs the fp32 accumulator; "
                         "grad_accumulator=False forbids it (use None or True)")
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")

    from ..activations import long_context as lc

    chunked_loss = lc._check_mode(chunked_loss, "chunked_loss")
    tile_mlp = lc._check_mode(tile_mlp, "tile_mlp")
    module, config, in_memory = _model_and_kind(model, model_kwargs, transform)
    layers_name, layers = find_decoder_layers(module)
    try:
        lc.check(module, layers, chunked_loss, tile_mlp)
    except ValueError as exc:  # True / rows asked for a model that cannot have it
        raise UnsupportedModelError(str(exc).replace("megatrain.wrap:", "megatrain.estimate:")) from None
    units = model_units(module, layers_name, layers)
    if trainable is not None:
        for u in units:
            for e in u.entries:
                e.frozen = not trainable(e.name)
    accum_mode = None if grad_accumulator is None else bool(grad_accumulator)
    cuda = device.type == "cuda"
    pin_after_fill = options().pin_after_fill
    reclaim = 0
    if in_memory and pin_after_fill:
        reclaim = sum(e.numel * e.param.element_size() for u in units for e in u.entries
                      if e.param.device.type == "cpu")
    accumulating = accum_mode is None and gradient_accumulation_steps > 1
    # The layers wrap would put on disk (none without offload_dir), by the engine's own planning.
    oplan = plan_offload(units, compute_dtype, accum_mode, staging_buffers, offload_dir=offload_dir,
                         host_memory_limit=host_memory_limit, reclaimable_bytes=reclaim, cuda=cuda,
                         num_buffers=options().disk_buffers, with_accumulator=accumulating, check=False)
    plan = oplan.host_plan
    layout = plan["layout"]
    accum = plan["accumulator_bytes"] if accumulating else 0
    store, staging = plan["store_bytes"], plan["staging_bytes"]
    pools = oplan.pool_bytes + oplan.accum_pool_bytes
    host = store + staging + accum + pools
    pinned = store + staging if cuda else 0
    limits = host_memory_limits()
    if isinstance(host_margin_bytes, bool) or not isinstance(host_margin_bytes, int) or host_margin_bytes < 0:
        raise ValueError(f"megatrain.estimate: host_margin_bytes must be an int >= 0, got {host_margin_bytes!r}")
    margin = host_margin_bytes
    short = host_budget_shortfall(host + margin, pinned, reclaim, limits)
    over_limit = host_memory_limit is not None and host > host_memory_limit
    cands = []  # the memory limits that apply, the tightest first
    if limits["mem_available_bytes"] is not None:
        cands.append((limits["mem_available_bytes"], "MemAvailable limit (/proc/meminfo)"))
    if limits["cgroup_limit_bytes"] is not None:
        cands.append((limits["cgroup_limit_bytes"] - (limits["cgroup_usage_bytes"] or 0),
                      f"cgroup memory limit ({limits['cgroup_path']}, minus current usage)"))
    cands.sort()
    if options().skip_host_memory_check:
        available, limit_name = None, None
    elif short is not None:
        available, limit_name = short["available_bytes"], short["limit"]
    else:
        available, limit_name = cands[0] if cands else (None, None)

    # ---- device
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    unit_numel = layout["unit_numel"]
    per_template = {}
    for u, n in zip(units, unit_numel):
        if u.kind == "layer":
            per_template[u.template] = n
    slot_bytes = num_slots * elem * sum(per_template.values())
    resident = [(u, n) for u, n in zip(units, unit_numel) if u.kind != "layer"]
    resident_bytes = sum(elem * n + elem * sum(e.numel for e in u.entries if not e.frozen) for u, n in resident)
    free = None
    if cuda and torch.cuda.is_available():
        free = capped_free_bytes(int(torch.cuda.mem_get_info(device)[0]), torch.cuda.memory_allocated(device),
                                 resolve_gpu_memory_limit(gpu_memory_limit, device))
    elif not cuda and cands:  # the CPU device's memory is the host's: what the host store
        free = max(0, cands[0][0] - host - margin)  # and the margin leave under the tightest limit
    # wrap's default on CUDA outside activation_policy="auto": the step boundary's units (resident, then
    # layer 0) keep their state on the device when it fits in 1/8 of the free memory (device_state_plan)
    boundary_bytes = 0
    if cuda and activation_policy != "auto":
        from .device_state_plan import BOUNDARY_DEVICE_STATE_FRACTION
        state_numel = layout["unit_state_numel"]
        budget = BOUNDARY_DEVICE_STATE_FRACTION * free if free is not None else float("inf")
        for k, u in enumerate(units):
            if u.kind != "layer" and state_numel[k]:  # the resident unit (its compute copy is counted above)
                if boundary_bytes + 16 * state_numel[k] <= budget:
                    boundary_bytes += 16 * state_numel[k]
        first = next((k for k, u in enumerate(units) if u.kind == "layer"), None)
        if first is not None and boundary_bytes + elem * unit_numel[first] + 16 * state_numel[first] <= budget:
            boundary_bytes += elem * unit_numel[first] + 16 * state_numel[first]
    tokens = micro_batch_size * seq_len if seq_len else 0
    # On the CPU device a host store that does not fit leaves no memory to plan the batch against:
    # the rows and the policy are then those of ample memory, and the device part is not checked.
    host_short_cpu = not cuda and short is not None
    rows_free = None if host_short_cpu else free
    loss_rows, mlp_rows, norm_rows = _long_context_rows(module, config, layers, tokens, elem, rows_free,
                                                        chunked_loss, tile_mlp)
    act, chosen = _activation_bytes(config, len(layers), tokens, elem, activation_policy, block_k, rows_free,
                                    mlp_rows)
    logits = _logits_bytes(config, tokens, elem, loss_rows)
    gpu = slot_bytes + resident_bytes + boundary_bytes + act + logits
    # CPU device: checked for a training run (seq_len given), against what the host store leaves
    checked = cuda or (tokens > 0 and not options().skip_host_memory_check and not host_short_cpu)
    gpu_fits = (gpu <= free) if free is not None and checked else None

    total = int(layout["total_numel"])
    frozen = int(layout["frozen_numel"])
    trainable_n = total - frozen
    est = MemoryEstimate(
        model_class=type(module).__name__, device=str(device), compute_dtype=str(compute_dtype).replace("torch.", ""),
        activation_policy=activation_policy if chosen == activation_policy else f"{activation_policy} ({chosen})",
        num_slots=num_slots, micro_batch_size=micro_batch_size, seq_len=seq_len,
        gradient_accumulation_steps=gradient_accumulation_steps, num_params=total, trainable_params=trainable_n,
        frozen_params=frozen, num_layers=len(layers), host_sections=dict(layout["section_bytes"]), store_bytes=store,
        accumulator_bytes=accum, staging_bytes=staging, host_bytes=host, pinned_bytes=pinned,
        reclaimable_bytes=reclaim, host_available_bytes=available, host_limit=limit_name,
        host_fits=short is None and not over_limit, host_available_fits=short is None,
        host_memory_limit=host_memory_limit, offload_dir=offload_dir, host_margin_bytes=margin,
        disk_layers=len(oplan.disk_units), disk_bytes=oplan.disk_total_bytes, disk_pool_bytes=pools,
        disk_free_bytes=oplan.free_bytes,
        disk_fits=None if offload_dir is None else oplan.disk_total_bytes <= (oplan.free_bytes or 0),
        slot_bytes=slot_bytes, resident_bytes=resident_bytes, device_state_bytes=boundary_bytes,
        activation_bytes=act, logits_bytes=logits,
        gpu_bytes=gpu, gpu_free_bytes=free if gpu_fits is not None else None, gpu_fits=gpu_fits,
        chunked_loss=str(chunked_loss).lower(), tile_mlp=str(tile_mlp).lower(), loss_rows=loss_rows, mlp_rows=mlp_rows,
        norm_rows=norm_rows, device_name=device_name(device))
    if isinstance(model, (str, os.PathLike)) and not has_weight_files(os.fspath(model)):
        est.notes.append(f"{os.fspath(model)} holds no weights: estimated from its config.json alone")
    if host_short_cpu and tokens:
        est.notes.append(f"this CPU's layer slots and activations (~{_fmt(gpu)}) need host memory too, beside the "
                         "host store: not checked while the store alone does not fit")
    if cuda and not torch.cuda.is_available():
        est.notes.append("CUDA is not available here: GPU memory not checked")

    # ---- why not, and what to change
    gib = 2**30
    if over_limit:
        what = f" with the fp32 state of {len(oplan.disk_units)} layers on disk" if oplan.disk_units else ""
        est.reasons.append(f"needs {_fmt(host)} ({host} bytes) of host memory{what} but host_memory_limit is "
                           f"{_fmt(host_memory_limit)} ({host_memory_limit} bytes)")
        if offload_dir is not None:
            est.advice.append("raise host_memory_limit")
        elif _offload_would_fit(units, compute_dtype, accum_mode, staging_buffers, reclaim, cuda, accumulating,
                                host_memory_limit, 0) is not None:
            est.advice.append("pass offload_dir=<a local disk> to keep the fp32 state of the layers that do not fit "
                              "there")
        else:
            est.advice.append("raise host_memory_limit (the compute copies alone exceed it: offload_dir cannot help)")
    if est.disk_fits is False:
        est.reasons.append(f"the disk tier needs {_fmt(oplan.disk_total_bytes)} under {offload_dir} but its filesystem has "
                           f"{_fmt(oplan.free_bytes)} free")
        est.advice.append("free space there, point offload_dir at a larger disk, or raise host_memory_limit")
    if short is not None:
        if short["kind"] == "memlock":
            est.reasons.append(f"{_fmt(pinned)} must be page-locked but the {short['limit']} allows "
                               f"{_fmt(short['available_bytes'])}")
            est.advice.append(short["advice"].rstrip("."))
        else:
            have = short["available_bytes"] + short["credit_bytes"]
            plus = f" + {_fmt(margin)} margin" if margin else ""
            est.reasons.append(f"needs {_fmt(host)}{plus} of host memory but only {_fmt(short['available_bytes'])} are "
                               f"available under the {short['limit']}")
            est.advice.append(f"needs {(host + margin - have) / gib:.2f} GiB more host RAM")
            if offload_dir is None:
                disk = _offload_would_fit(units, compute_dtype, accum_mode, staging_buffers, reclaim, cuda,
                                          accumulating, host_memory_limit, 0 if cuda or not tokens else gpu)
                if disk is not None:  # never when the compute copies alone do not fit: it cannot help then
                    cap = f" and host_memory_limit={disk[2]} (room for this CPU's batch)" if disk[2] else ""
                    est.advice.append(f"or offload_dir=<a local disk>{cap}: the fp32 state of {disk[0]} of "
                                      f"{len(layers)} decoder layers goes there ({_fmt(disk[1])} on disk; "
                                      "megatrain.wrap(..., offload_dir=...))")
            if accum and host - accum <= have:
                est.advice.append(f"gradient_accumulation_steps={gradient_accumulation_steps} allocates the fp32 "
                                  f"accumulator, 4 B/param more ({_fmt(accum)}): use 1 with a larger micro-batch")
            elif accum_mode is True and host - layout['section_bytes'].get('grad_accum', 0) <= have:
                est.advice.append(f"grad_accumulator=True puts 4 B/param in the store ({_fmt(layout['section_bytes'].get('grad_accum', 0))}): "
                                  "use the default grad_accumulator=None")
            frozen_all = plan_host_memory(_all_frozen(units), compute_dtype, None, staging_buffers)
            if trainable_n and frozen_all["store_bytes"] + frozen_all["staging_bytes"] <= have:
                est.advice.append(f"freeze the base / use LoRA (a frozen parameter costs {elem} B; all frozen: "
                                  f"{_fmt(frozen_all['store_bytes'])})")
            if host and have > 0:  # on the CPU device its slots and activations share the same memory
                need = host + (gpu if host_short_cpu else 0)
                est.advice.append(f"or a smaller model (about {_count(int(total * have / need))} parameters fit)")
    if gpu_fits is False:
        est.reasons.append(f"needs ~{_fmt(gpu)} of GPU memory on {est.device_name} but {_fmt(free)} are free" if cuda else
                           f"needs ~{_fmt(gpu)} of host memory for the CPU device's slots and activations, but "
                           f"{_fmt(free)} are left beside the {_fmt(host)} of the host store"
                           + (f" and the {_fmt(margin)} margin" if margin else ""))
        if slot_bytes + resident_bytes + boundary_bytes < free:  # a smaller batch can fit
            tip = "lower micro_batch_size or seq_len"
            if chosen == "store" or chosen.startswith("block:"):
                tip += ", or activation_policy='recompute'"
            est.advice.append(tip)
        else:
            est.advice.append(f"the streamed slots ({_fmt(slot_bytes)}) and the resident embedding / LM head "
                              f"({_fmt(resident_bytes)}) alone are too large for {est.device_name}: a smaller model"
                              + (" or num_slots=2" if num_slots > 2 else ""))
    return est


def _all_frozen(units):
    import copy

    out = []
    for u in units:
        v = copy.copy(u)
        v.entries = [copy.copy(e) for e in u.entries]
        for e in v.entries:
            e.frozen = True
        out.append(v)
    return out

