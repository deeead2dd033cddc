"""``megatrain.estimate``: the memory a wrapped model will take, said before anything is allocated.

The host numbers come from the code that allocates: the model's units are built the way
``wrap`` builds them (:func:`megatrain.runtime.model.wrap.model_units`, on a meta model when given a
config or a directory) and sized by :func:`megatrain.runtime.engine.units.plan_host_memory`, whose
store part is the C++ ``HostStore.layout_required`` (the planning the store's constructor runs).
Whether they fit is decided by the rules of the engine's budget check
(:func:`megatrain.runtime.placement.host_memory.host_budget_shortfall`). The steps:
:mod:`.model_shape` reads the model, :mod:`.estimate_bytes` does the byte arithmetic, and
:func:`estimate_with` puts the result and its reasons together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import torch

from ...byte_units import format_bytes
from .assumed_machine import AssumedMachine
from .estimate_bytes import (DevicePart, HostPart, activation_bytes, activation_floor_bytes, activation_reserve,
                             all_frozen, device_part, gpu_free, host_part, logits_bytes, long_context_rows,
                             offload_would_fit)
from .memory_estimate import MemoryEstimate, _count, _fmt  # noqa: F401 - _count: public here too
from .model_shape import WEIGHT_FILES, ModelShape, has_weight_files, model_to_plan  # noqa: F401 - WEIGHT_FILES: public here
from .streamed_minimum import check_streamed_minimum
from ..wrap_options import WrapOptions

# Host memory ``megatrain train`` keeps free beyond everything the estimate counts (the Python
# process and its libraries, allocator slack, the rough activation estimate on the CPU device):
# a run that would leave less is refused before it starts, by --dry-run and the real run alike.
RUN_HOST_MARGIN_BYTES = 1 << 30


def device_name(device: torch.device) -> str:
    """How messages name the device a run was checked against: "this CPU", "cuda:0 (NVIDIA H200)"."""
    if device.type == "cpu":
        return "this CPU"
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


@dataclass(frozen=True)
class EstimateRun:
    """What ``megatrain.estimate`` takes beside the :class:`~megatrain.runtime.wrap_options.WrapOptions`:
    the optimizer's settings, the batch, and how the model is built (see :func:`estimate`)."""

    gradient_accumulation_steps: int = 1
    max_grad_norm: Optional[float] = None
    trainable: Optional[Callable[[str], bool]] = None
    transform: Optional[Callable] = None
    micro_batch_size: int = 1
    seq_len: Optional[int] = None
    staging_buffers: int = 4
    host_margin_bytes: int = 0
    model_kwargs: dict = field(default_factory=dict)
    machine: AssumedMachine = AssumedMachine()  # the machine the fit is judged on (default: this one)

    def check(self, grad_accumulator: Optional[bool]) -> None:
        """Refuse a bad value (one line, ``megatrain.estimate: ...``); ``grad_accumulator``: the option's value."""
        gas = self.gradient_accumulation_steps
        if not isinstance(gas, int) or gas < 1:
            raise ValueError(f"megatrain.estimate: gradient_accumulation_steps must be an int >= 1, got {gas!r}")
        mbs, seq_len = self.micro_batch_size, self.seq_len
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"megatrain.estimate: micro_batch_size must be an int >= 1 (sequences per micro-batch), "
                             f"got {mbs!r}")
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
            raise ValueError(f"megatrain.estimate: seq_len must be an int >= 1 (tokens per sequence) or None, got {seq_len!r}")
        if gas > 1 and grad_accumulator is False:
            raise ValueError("megatrain.estimate: gradient_accumulation_steps > 1 needs the fp32 accumulator; "
                             "grad_accumulator=False forbids it (use None or True)")
        clip = self.max_grad_norm  # as CPUAdamW refuses it
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise ValueError(f"megatrain.estimate: max_grad_norm must be a number > 0 or None, got {clip!r}")
        margin = self.host_margin_bytes
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"megatrain.estimate: host_margin_bytes must be an int >= 0, got {margin!r}")

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch (0 without ``seq_len``: no activation estimate)."""
        return self.micro_batch_size * self.seq_len if self.seq_len else 0


def estimate(model, *, device=None, compute_dtype: Optional[torch.dtype] = None, activation_policy: Optional[str] = None,
             num_slots: int = 2, grad_accumulator: Optional[bool] = None, gradient_accumulation_steps: int = 1,
             max_grad_norm: Optional[float] = None, trainable: Optional[Callable[[str], bool]] = None,
             transform=None, micro_batch_size: int = 1, seq_len: Optional[int] = None,
             staging_buffers: int = 4, chunked_loss="auto", tile_mlp="auto", device_state_layers=None, offload_dir=None,
             host_memory_limit: Optional[Union[int, str]] = None, host_margin_bytes: int = 0, gpu_memory_limit=None,
             host_memory=None, gpu_memory=None, host_compute_copy="auto", **model_kwargs) -> MemoryEstimate:
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
        host_compute_copy: as :func:`megatrain.wrap`: master-streamed layers count 12 B/param in the store
            (``master_streamed_layers`` of the result; the tiers line names them).
        gpu_memory_limit: as :func:`megatrain.wrap`: the free device memory the estimate checks
            against is capped the same way.
        device_state_layers: as :func:`megatrain.wrap` (same default): which leading layers keep their whole
            state on the device (counted in ``gpu_bytes``) and, when the host store does not fit, how many of
            them may be exclusive (an int K: at most K, as wrap plans them).
        gradient_accumulation_steps, max_grad_norm: as ``CPUAdamW`` will get them. With the default
            ``grad_accumulator=None``, ``gradient_accumulation_steps > 1`` allocates the fp32
            accumulator (4 B per trainable parameter), and the exclusive layers are planned at 18 B/param on the
            device with no held gradient; ``max_grad_norm`` adds, on a GPU at one backward per
            step, the master-streamed layers' gradients held there until the global norm (``held_grad_bytes``).
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
        host_memory, gpu_memory: judge the fit against another machine (None: this one's). Bytes
            (int) or a string such as ``"1.5TiB"`` / ``"141GB"`` (KB/MB/GB/TB: powers of 1000,
            KiB/MiB/GiB/TiB: of 1024). ``host_memory``: the host memory available there, judged as
            MemAvailable, with no cgroup or locked-memory limit (even when
            ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1``); ``float("inf")`` / ``"inf"`` (or above 2**63 - 1): a host
            with no limit at all. ``gpu_memory``: the GPU memory free there; the
            device is then CUDA even on a machine without one (``device=None`` means ``"cuda"``), so
            the CUDA defaults apply (bf16 compute, ``auto`` policy, pinned staging), and
            ``gpu_memory_limit`` caps it (a float: a fraction of it). The table and ``to_dict()``
            (``assumed_machine``) say which machine was judged. ``offload_dir``'s free space is
            still this machine's.
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
        ValueError / TypeError: a bad option or input; ``host_memory`` / ``gpu_memory`` not a size > 0
            (one line naming the argument, before anything is computed), ``gpu_memory`` with ``device="cpu"``.
        GpuMemoryLimitError: a ``ValueError``, one line: ``gpu_memory_limit`` (in bytes; a fraction where the
            GPU's size is known) is below the streamed schedule's minimum (layer slots, resident unit and,
            with ``seq_len``, the activations' floor), as ``wrap`` refuses it.
    """
    machine = AssumedMachine.parse(host_memory, gpu_memory, device)
    device = machine.default_device(device)
    options = WrapOptions(device=device, compute_dtype=compute_dtype, activation_policy=activation_policy,
                          num_slots=num_slots, grad_accumulator=grad_accumulator, chunked_loss=chunked_loss,
                          tile_mlp=tile_mlp, device_state_layers=device_state_layers, offload_dir=offload_dir,
                          host_memory_limit=host_memory_limit, gpu_memory_limit=gpu_memory_limit,
                          host_compute_copy=host_compute_copy, where="megatrain.estimate")
    run = EstimateRun(gradient_accumulation_steps=gradient_accumulation_steps, max_grad_norm=max_grad_norm,
                      trainable=trainable, transform=transform, micro_batch_size=micro_batch_size, seq_len=seq_len,
                      staging_buffers=staging_buffers, host_margin_bytes=host_margin_bytes, model_kwargs=model_kwargs,
                      machine=machine)
    return estimate_with(model, options, run)


def estimate_with(model, options: WrapOptions, run: EstimateRun) -> MemoryEstimate:
    """:func:`estimate` of ``model`` under ``options`` (only the fields :data:`~..wrap_options.ESTIMATE_OPTIONS`
    names change a byte) for ``run``; the same result, reasons and errors."""
    from ..activations import long_context as lc
    from ..model.wrap import UnsupportedModelError, find_decoder_layers, model_units
    from ..options import options as run_options

    opts = options.with_defaults("megatrain.estimate", need_device=False)
    run.check(opts.grad_accumulator)
    module, config, in_memory = model_to_plan(model, run.model_kwargs, run.transform)
    layers_name, layers = find_decoder_layers(module)
    try:
        lc.check(module, layers, opts.chunked_loss, opts.tile_mlp)
    except ValueError as exc:  # True / rows asked for a model that cannot have it
        raise UnsupportedModelError(str(exc).replace("megatrain.wrap:", "megatrain.estimate:")) from None
    units = model_units(module, layers_name, layers)
    if isinstance(opts.device_state_layers, int) and opts.device_state_layers > len(layers):  # as wrap refuses it
        raise ValueError(f"megatrain.estimate: device_state_layers={opts.device_state_layers}, but the model has "
                         f"{len(layers)} decoder layers; use at most {len(layers)} (or 'auto')")
    if run.trainable is not None:
        for u in units:
            for e in u.entries:
                e.frozen = not run.trainable(e.name)
    cuda = opts.device.type == "cuda"
    margin = run.host_margin_bytes
    tokens = run.tokens
    shape = ModelShape.of(config)
    reserve = activation_reserve(module, shape, layers, tokens, opts, gpu_free(opts, run.machine)[0])  # capacity share's
    hp = host_part(units, opts, in_memory, run.staging_buffers, run.gradient_accumulation_steps, margin, run.machine,
                   reserve)
    dev = device_part(units, hp, opts, margin)
    # a cap that cannot hold even the streamed schedule is refused, as wrap refuses it
    check_streamed_minimum(options.gpu_memory_limit, dev.limit_bytes, dev.slot_bytes, dev.resident_bytes,
                           opts.num_slots, activation_floor_bytes(shape, tokens, dev.elem), "megatrain.estimate")
    # On the CPU device a host store that does not fit leaves no memory to plan the batch against:
    # the rows and the policy are then those of ample memory, and the device part is not checked.
    host_short_cpu = not cuda and hp.short is not None
    rows_free = None if host_short_cpu else dev.free
    if cuda and rows_free is not None:  # the exclusive layers' state is on the device before any activation
        rows_free = max(0, rows_free - hp.exclusive_device_bytes)
    rows = long_context_rows(module, shape, layers, tokens, dev.elem, rows_free, opts.chunked_loss, opts.tile_mlp)
    act, chosen = activation_bytes(shape, len(layers), tokens, dev.elem, opts.activation_policy, rows_free, rows[1])
    logits = logits_bytes(shape, tokens, dev.elem, rows[0])
    # with clipping at one backward per step, the master-streamed layers' gradients wait on the device for the norm
    held = sum(dev.elem * int(hp.layout["unit_numel"][k]) for k in hp.oplan.master_streamed) \
        if cuda and run.max_grad_norm is not None and run.gradient_accumulation_steps == 1 else 0
    gpu = dev.slot_bytes + dev.resident_bytes + dev.boundary_bytes + hp.exclusive_device_bytes + held + act + logits
    # CPU device: checked for a training run (seq_len given), against what the host store leaves
    judged = run.machine.host_bytes is not None or not run_options().skip_host_memory_check
    checked = cuda or (tokens > 0 and judged and not host_short_cpu)
    gpu_fits = (gpu <= dev.free) if dev.free is not None and checked else None
    est = _result(module, layers, opts, run, hp, dev, rows, act, chosen, logits, gpu, gpu_fits)
    est.held_grad_bytes = held
    if isinstance(model, (str, os.PathLike)) and not has_weight_files(os.fspath(model)):
        est.notes.append(f"{os.fspath(model)} holds no weights: estimated from its config.json alone")
    if host_short_cpu and tokens:
        est.notes.append(f"this CPU's layer slots and activations (~{_fmt(gpu)}) need host memory too, beside the "
                         "host store: not checked while the store alone does not fit")
    mpe = getattr(config, "max_position_embeddings", None)
    if run.seq_len and isinstance(mpe, int) and run.seq_len > mpe:  # the CLI refuses it for a model it builds
        est.notes.append(f"seq_len {run.seq_len} is above the model's max_position_embeddings ({mpe}): estimated as "
                         "given, but the model's position embeddings were not made for it")
    if cuda and not torch.cuda.is_available() and run.machine.gpu_bytes is None:
        est.notes.append("CUDA is not available here: GPU memory not checked")
    _host_reasons(est, units, opts, run, hp, gpu if host_short_cpu else 0, dev.elem)
    if gpu_fits is False:
        _device_reasons(est, opts, hp, dev, chosen)
    return est


def _result(module, layers, opts, run: EstimateRun, hp: HostPart, dev: DevicePart, rows, act, chosen, logits, gpu,
            gpu_fits) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of the parts (its reasons, advice and notes empty)."""
    policy = opts.activation_policy
    total = int(hp.layout["total_numel"])
    frozen = int(hp.layout["frozen_numel"])
    oplan = hp.oplan
    cuda = opts.device.type == "cuda"
    return MemoryEstimate(
        model_class=type(module).__name__, device=str(opts.device),
        compute_dtype=str(opts.compute_dtype).replace("torch.", ""),
        activation_policy=str(policy) if chosen == policy else f"{policy} ({chosen})",
        num_slots=opts.num_slots, micro_batch_size=run.micro_batch_size, seq_len=run.seq_len,
        gradient_accumulation_steps=run.gradient_accumulation_steps, num_params=total, trainable_params=total - frozen,
        frozen_params=frozen, num_layers=len(layers), host_sections=dict(hp.layout["section_bytes"]),
        store_bytes=hp.store, accumulator_bytes=hp.accum, staging_bytes=hp.staging, host_bytes=hp.host,
        pinned_bytes=hp.pinned, reclaimable_bytes=hp.reclaim, host_available_bytes=hp.available,
        host_limit=hp.limit_name, host_fits=hp.short is None and not hp.over_limit,
        host_available_fits=hp.short is None, host_memory_limit=opts.host_memory_limit, offload_dir=opts.offload_dir,
        host_margin_bytes=run.host_margin_bytes, disk_layers=len(oplan.disk_units), disk_bytes=oplan.disk_total_bytes,
        disk_pool_bytes=hp.pools, disk_free_bytes=oplan.free_bytes,
        disk_fits=None if opts.offload_dir is None else oplan.disk_total_bytes <= (oplan.free_bytes or 0),
        slot_bytes=dev.slot_bytes, resident_bytes=dev.resident_bytes, device_state_bytes=dev.boundary_bytes,
        activation_bytes=act, logits_bytes=logits,
        gpu_bytes=gpu, gpu_free_bytes=dev.free if gpu_fits is not None else None, gpu_fits=gpu_fits,
        chunked_loss=str(opts.chunked_loss).lower(), tile_mlp=str(opts.tile_mlp).lower(), loss_rows=rows[0],
        mlp_rows=rows[1], norm_rows=rows[2],
        device_name=run.machine.gpu_name if cuda and run.machine.gpu_bytes is not None else device_name(opts.device),
        host_memory_given=run.machine.host_bytes, gpu_memory_given=run.machine.gpu_bytes,
        exclusive_layers=len(oplan.exclusive_units), exclusive_bytes=hp.exclusive_bytes,
        master_streamed_layers=len(oplan.master_streamed),
        exclusive_max=oplan.exclusive_max, exclusive_needed=oplan.exclusive_needed,
        exclusive_device_bytes=hp.exclusive_device_bytes, exclusive_share=oplan.exclusive_share,
        capacity_max=oplan.capacity["layers"] if oplan.capacity else None,
        capacity_budget_bytes=oplan.capacity["budget_bytes"] if oplan.capacity else None,
        activation_reserve_bytes=oplan.capacity["reserve_bytes"] if oplan.capacity else None)


def _host_reasons(est: MemoryEstimate, units, opts, run: EstimateRun, hp: HostPart, cpu_device_bytes: int,
                  elem: int) -> None:
    """Why the host part does not fit (``host_memory_limit``, the disk, the budget) and what to change.
    ``cpu_device_bytes``: the CPU device's slots and activations when the store alone does not fit (else 0)."""
    oplan, host, offload_dir, limit = hp.oplan, hp.host, opts.offload_dir, opts.host_memory_limit
    if hp.over_limit:
        what = f" with the fp32 state of {len(oplan.disk_units)} layers on disk" if oplan.disk_units else ""
        est.reasons.append(f"needs {_fmt(host)} ({host} bytes) of host memory{what} but host_memory_limit is "
                           f"{_fmt(limit)} ({limit} bytes)")
        if offload_dir is not None:
            est.advice.append("raise host_memory_limit")
        elif offload_would_fit(units, opts, hp, run.staging_buffers, 0) is not None:
            est.advice.append("pass offload_dir=<a local disk> to keep the fp32 state of the layers that do not fit "
                              "there")
        else:
            est.advice.append("raise host_memory_limit (what stays in host memory with every layer's fp32 state on disk, "
                              "the compute copies, the resident unit's state and the gradient staging, exceeds it: "
                              "offload_dir cannot help)")
    if est.disk_fits is False:
        est.reasons.append(f"the disk tier needs {_fmt(oplan.disk_total_bytes)} under {offload_dir} but its filesystem has "
                           f"{_fmt(oplan.free_bytes)} free")
        est.advice.append("free space there, point offload_dir at a larger disk, or raise host_memory_limit")
    _exclusive_reasons(est, oplan)
    short = hp.short
    if short is None:
        return
    if short["kind"] == "memlock":
        est.reasons.append(f"{_fmt(hp.pinned)} must be page-locked but the {short['limit']} allows "
                           f"{_fmt(short['available_bytes'])}")
        est.advice.append(short["advice"].rstrip("."))
        return
    have = short["available_bytes"] + short["credit_bytes"]
    margin = run.host_margin_bytes
    plus = f" + {_fmt(margin)} margin" if margin else ""
    est.reasons.append(f"needs {_fmt(host)}{plus} of host memory but only {_fmt(short['available_bytes'])} are "
                       f"available under the {short['limit']}")
    est.advice.append(f"needs {format_bytes(host + margin - have)} more host RAM")
    if offload_dir is None:
        cuda = opts.device.type == "cuda"
        disk = offload_would_fit(units, opts, hp, run.staging_buffers, 0 if cuda or not run.tokens else est.gpu_bytes)
        if disk is not None:  # never when the compute copies alone do not fit: it cannot help then
            cap = f" and host_memory_limit={disk[2]} (room for this CPU's batch)" if disk[2] else ""
            est.advice.append(f"or offload_dir=<a local disk>{cap}: the fp32 state of {disk[0]} of "
                              f"{est.num_layers} decoder layers goes there ({_fmt(disk[1])} on disk; "
                              "megatrain.wrap(..., offload_dir=...))")
    _smaller_store_advice(est, units, opts, run, hp, have, cpu_device_bytes, elem)


def _exclusive_reasons(est: MemoryEstimate, oplan) -> None:
    """When even the exclusive device-state layers the device budget holds do not make the host part fit: how
    many would have to be exclusive (the same planning as wrap's, :func:`~.disk_plan.plan_offload`)."""
    if oplan.exclusive_needed is None or est.host_fits:
        return
    cap = (f" ('auto' share) and its capacity share {oplan.capacity['layers']} ({_fmt(oplan.capacity['budget_bytes'])} "
           f"with a {_fmt(oplan.capacity['reserve_bytes'])} activation reserve)" if oplan.capacity else "")
    where = "GPU" if est.device.startswith("cuda") else "device"
    est.reasons.append(f"the fp32 state of {oplan.exclusive_needed} decoder layers would have to live on the {where} only "
                       f"for the host part to fit, but the device budget holds {oplan.exclusive_max}{cap}")
    k = oplan.exclusive_needed  # an explicit device_state_layers=K sized the budget (no device budget was read)
    more = (f"device_state_layers={k} (the fp32 state of layers 0..{k - 1} then lives on the {where} only)"
            if oplan.device_budget_bytes is None else "raise gpu_memory_limit (or use a GPU with more memory)")
    disk = ", or pass offload_dir=<a local disk>" if oplan.disk_would_fit is not False else ""  # only where it helps
    est.advice.append(f"{more}, raise host_memory_limit / host memory{disk}")


def _smaller_store_advice(est: MemoryEstimate, units, opts, run: EstimateRun, hp: HostPart, have: int,
                          cpu_device_bytes: int, elem: int) -> None:
    """Advice for a host store over the budget: no accumulator, a frozen base, or a smaller model."""
    from ..engine.units import plan_host_memory

    host, accum, sections = hp.host, hp.accum, hp.layout["section_bytes"]
    if accum and host - accum <= have:
        est.advice.append(f"gradient_accumulation_steps={run.gradient_accumulation_steps} allocates the fp32 "
                          f"accumulator, 4 B/param more ({_fmt(accum)}): use 1 with a larger micro-batch")
    elif hp.accum_mode is True and host - sections.get('grad_accum', 0) <= have:
        est.advice.append(f"grad_accumulator=True puts 4 B/param in the store ({_fmt(sections.get('grad_accum', 0))}): "
                          "use the default grad_accumulator=None")
    frozen_all = plan_host_memory(all_frozen(units), opts.compute_dtype, None, run.staging_buffers)
    if est.trainable_params and frozen_all["store_bytes"] + frozen_all["staging_bytes"] <= have:
        est.advice.append(f"freeze the base / use LoRA (a frozen parameter costs {elem} B; all frozen: "
                          f"{_fmt(frozen_all['store_bytes'])})")
    if host and have > 0:  # on the CPU device its slots and activations share the same memory
        need = host + cpu_device_bytes
        est.advice.append(f"or a smaller model (about {_count(int(est.num_params * have / need))} parameters fit)")


def _device_reasons(est: MemoryEstimate, opts, hp: HostPart, dev: DevicePart, chosen) -> None:
    """Why the device part does not fit, and what to change."""
    gpu, free, margin = est.gpu_bytes, dev.free, est.host_margin_bytes
    est.reasons.append(f"needs ~{_fmt(gpu)} of GPU memory on {est.device_name} but {_fmt(free)} are free"
                       if opts.device.type == "cuda" else
                       f"needs ~{_fmt(gpu)} of host memory for the CPU device's slots and activations, but "
                       f"{_fmt(free)} are left beside the {_fmt(hp.host)} of the host store"
                       + (f" and the {_fmt(margin)} margin" if margin else ""))
    if dev.slot_bytes + dev.resident_bytes + dev.boundary_bytes < free:  # a smaller batch can fit
        tip = "lower micro_batch_size or seq_len"
        if chosen.stores or chosen.is_block:
            tip += ", or activation_policy='recompute'"
        est.advice.append(tip)
    else:
        est.advice.append(f"the streamed slots ({_fmt(dev.slot_bytes)}) and the resident embedding / LM head "
                          f"({_fmt(dev.resident_bytes)}) alone are too large for {est.device_name}: a smaller model"
                          + (" or num_slots=2" if opts.num_slots > 2 else ""))
