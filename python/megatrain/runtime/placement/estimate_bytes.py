"""The byte arithmetic of ``megatrain.estimate``: host part, device part, activations, logits.

The host part is the engine's own planning (:func:`~.disk_plan.plan_offload`, whose store part is
``HostStore.layout_required``) judged by the budget check's rules
(:func:`~.host_memory.host_budget_shortfall`); the device part counts the layer slots and the
resident unit exactly and the activations and logits roughly (+-50%). Every function here takes the
options :meth:`~megatrain.runtime.wrap_options.WrapOptions.with_defaults` resolved.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..activations.activation_policy import ActivationPolicy
from .assumed_machine import AssumedMachine
from .model_dims import ModelShape


def activation_bytes(shape: Optional[ModelShape], num_layers: int, tokens: int, elem: int, policy: ActivationPolicy,
                     free: Optional[int], mlp_rows: Optional[int] = None) -> tuple:
    """``(bytes, chosen)``: rough device bytes of activations for ``tokens`` tokens, and the policy they are
    for (``auto``: what it would pick in ``free`` bytes, by wrap's rule; the others: ``policy``)."""
    if not tokens or shape is None:
        return 0, policy
    q_dim = shape.heads * shape.head_dim
    kv_dim = shape.kv_heads * shape.head_dim
    inter = shape.intermediate
    layer_in = tokens * shape.hidden * elem
    # One layer's saved activations with a fused attention kernel: norms, q/k/v, attention output,
    # o_proj, residuals, and the MLP's gate/up/activation/product.
    per_layer = tokens * elem * (6 * shape.hidden + 2 * q_dim + 2 * kv_dim + 4 * inter)
    if mlp_rows:  # tiled MLP: its input is kept, one tile's intermediates and gradients exist at a time
        per_layer += mlp_rows * inter * elem * 6 - tokens * elem * 4 * inter
    chosen = policy
    if policy.is_auto:
        chosen = _auto_choice(num_layers, per_layer, layer_in, free)
    if chosen.stores:
        act = num_layers * per_layer
    elif chosen.offloads:  # inputs parked in host memory: the one prefetched and the one in use
        act = 2 * layer_in + per_layer
    elif chosen.is_block:
        act = math.ceil(num_layers / chosen.block_k) * layer_in + chosen.block_k * per_layer
    else:
        act = num_layers * layer_in + per_layer
    return act + activation_floor_bytes(shape, tokens, elem), chosen


def activation_floor_bytes(shape: Optional[ModelShape], tokens: int, elem: int) -> int:
    """Device bytes every activation policy holds while a layer runs backward: its input and the gradient
    flowing back, ``2 * tokens * hidden * elem`` (0 without a batch or a shape): the activations' floor."""
    if not tokens or shape is None:
        return 0
    return 2 * tokens * shape.hidden * elem


def _auto_choice(num_layers: int, per_layer: int, layer_in: int, free: Optional[int]) -> ActivationPolicy:
    """What ``auto`` picks for the whole model: ``store`` when every graph fits, ``block:K`` when not even
    every layer input fits (as wrap's auto, :func:`~..activations.long_context.checkpoint_spacing`), else ``recompute``."""
    from ..activations.policies import AUTO_STORE_FRACTION

    if free is not None and per_layer * num_layers <= AUTO_STORE_FRACTION * free:
        return ActivationPolicy("store")
    if free is not None and num_layers * layer_in > AUTO_STORE_FRACTION * free:
        from ..activations.long_context import checkpoint_spacing  # as wrap's auto: not one saved input per layer fits

        block_k = checkpoint_spacing(num_layers, layer_in, AUTO_STORE_FRACTION * free)
        if block_k > 1:
            return ActivationPolicy.block(block_k)
    return ActivationPolicy("recompute")


def logits_bytes(shape: Optional[ModelShape], tokens: int, elem: int, loss_rows: Optional[int]) -> int:
    """Rough device bytes of the logits and the loss for ``tokens`` tokens (one chunk with the chunked loss)."""
    if not tokens or shape is None:
        return 0
    if loss_rows:  # the chunked loss: one chunk of logits at a time (docs/long_context.md)
        return min(tokens, loss_rows) * shape.vocab * (2 * elem + 20)
    return tokens * shape.vocab * (elem + 4 + 4)  # logits, their fp32 upcast, the fp32 gradient


def long_context_rows(module, shape: Optional[ModelShape], layers, tokens: int, elem: int, free: Optional[int],
                      chunked_loss, tile_mlp) -> tuple:
    """``(loss_rows, mlp_rows, norm_rows)`` that ``wrap``'s ``chunked_loss`` / ``tile_mlp`` would use at ``tokens``."""
    from ..activations import long_context as lc
    from ..activations.tiling import mlp_of, norms_of

    if not tokens or shape is None:
        return None, None, None
    room = float("inf") if free is None else free  # unknown (CUDA not here): as if it all fits
    loss_rows = lc.loss_rows_for(chunked_loss, tokens, shape.vocab, elem, room) if lc.loss_supported(module)[0] else None
    has_mlp = any(mlp_of(layer) is not None for layer in layers)
    mlp_rows = lc.mlp_rows_for(tile_mlp, tokens, shape.intermediate, elem, room) if has_mlp else None
    has_norms = any(norms_of(layer) for layer in layers)
    norm_rows = lc.norm_rows_for(tile_mlp, tokens, shape.hidden, room) if has_norms else None
    return loss_rows, mlp_rows, norm_rows


@dataclass
class HostPart:
    """The host bytes (exact) and whether they fit: see :func:`host_part`."""

    oplan: object  # disk_plan.OffloadPlan: the layers on disk and the host plan of the rest
    layout: dict  # the store's layout (HostStore.layout_required)
    accum_mode: Optional[bool]  # wrap's grad_accumulator
    accumulating: bool  # CPUAdamW allocates the accumulator outside the store
    reclaim: int  # the in-memory model's own weights, freed while the store is filled
    accum: int
    store: int
    staging: int
    pools: int  # the disk tier's RAM buffers
    host: int
    pinned: int
    short: Optional[dict]  # host_budget_shortfall's answer (None: fits)
    over_limit: bool  # host > host_memory_limit
    tightest: Optional[tuple]  # (bytes, name) of the tightest memory limit, None when none is known
    available: Optional[int]
    limit_name: Optional[str]
    machine: AssumedMachine = AssumedMachine()  # the machine judged (default: this one)
    exclusive_bytes: int = 0  # the exclusive device-state layers' host sections (fp32 state, compute copy) on the device instead
    exclusive_device_bytes: int = 0  # their whole device state: compute copy + 3 fp32 sections (14 B/param in bf16; 18 accumulating)


def gpu_free(opts, machine: AssumedMachine) -> tuple:
    """``(free bytes, gpu_memory_limit bytes)`` of the CUDA device ``opts`` plans for (the given GPU, or this
    machine's), capped as wrap caps them; ``(None, None)`` off CUDA; the free bytes None without a GPU here."""
    from .device_state_plan import capped_free_bytes, resolve_gpu_memory_limit

    device = opts.device
    if device.type != "cuda":
        return None, None
    if machine.gpu_bytes is not None:  # the assumed GPU: its given free bytes, capped as wrap caps
        limit = resolve_gpu_memory_limit(opts.gpu_memory_limit, device, total_bytes=machine.gpu_bytes)
        return capped_free_bytes(machine.gpu_bytes, 0, limit), limit
    if torch.cuda.is_available():
        limit = resolve_gpu_memory_limit(opts.gpu_memory_limit, device)
        return capped_free_bytes(int(torch.cuda.mem_get_info(device)[0]), torch.cuda.memory_allocated(device),
                                 limit), limit
    if isinstance(opts.gpu_memory_limit, int):  # no GPU here: a cap in bytes is still known
        return None, resolve_gpu_memory_limit(opts.gpu_memory_limit, device)
    return None, None


def activation_reserve(module, shape: Optional[ModelShape], layers, tokens: int, opts,
                       free: Optional[int]) -> Optional[int]:
    """Device bytes the capacity share of exclusive device-state layers keeps for one micro-batch of ``tokens``
    tokens (:func:`~.device_state_plan.capacity_room`): activations and logits under ``opts``' policy, under
    ``auto`` those of ``recompute`` (what it falls back to when the state leaves no room for graphs), the loss
    chunks and MLP tiles chosen in the whole ``free`` device memory (bytes). The one rule of
    ``megatrain.estimate`` (``free``: :func:`gpu_free`'s) and of ``wrap(micro_batch_size=, seq_len=)``
    (``free``: the engine's free device bytes). None (the default fraction is used then): no batch, no model
    shape, or no free device memory known."""
    if not tokens or shape is None or free is None:
        return None
    elem = torch.tensor([], dtype=opts.compute_dtype).element_size()
    rows = long_context_rows(module, shape, layers, tokens, elem, free, opts.chunked_loss, opts.tile_mlp)
    policy = ActivationPolicy("recompute") if opts.activation_policy.is_auto else opts.activation_policy
    act, _ = activation_bytes(shape, len(layers), tokens, elem, policy, free, rows[1])
    return act + logits_bytes(shape, tokens, elem, rows[0])


def batch_reserve(module, layers, opts):
    """``wrap``'s capacity-share reserve for its batch: a function ``free device bytes -> bytes or None``
    (:func:`activation_reserve` for ``opts.micro_batch_size x opts.seq_len`` tokens), or None when the batch is
    not given (both are needed) or the model's shape cannot be read: the default fraction is kept then."""
    shape = ModelShape.of(getattr(module, "config", None)) if opts.batch_tokens else None
    if shape is None:
        return None
    return lambda free: activation_reserve(module, shape, layers, opts.batch_tokens, opts, free)


def layer_device_bytes(layout: dict, k: int, compute_dtype: torch.dtype, summed: bool) -> int:
    """Device bytes of unit ``k``'s whole state as a decoder layer on the device (:func:`~.device_state_plan.
    unit_device_bytes` of the store's ``layout``): compute copy, fp32 master and moments, and the fp32 gradient
    buffer when gradients are ``summed`` (no buffer otherwise: the direct gradient goes into the compute copy)."""
    from types import SimpleNamespace

    from .device_state_plan import unit_device_bytes

    unit = SimpleNamespace(numel=int(layout["unit_numel"][k]), state_numel=int(layout["unit_state_numel"][k]))
    return unit_device_bytes(unit, compute_dtype, with_grad=bool(summed))


def _exclusive_args(opts, machine: AssumedMachine, reserve: Optional[int] = None) -> dict:
    """:func:`~.disk_plan.plan_offload`'s exclusive-layer arguments as ``wrap`` would give them: an explicit
    ``device_state_layers=K``, or (``"auto"`` / ``"boundary"``, the defaults on CUDA) the free GPU bytes (on the
    CPU backend the host's available memory, as ``memory.free_device_bytes`` reads it there), with
    ``num_slots`` and the capacity share's activation ``reserve`` (:func:`activation_reserve`)."""
    from .device_state_plan import resolve_device_state_layers

    layers = resolve_device_state_layers(opts.device_state_layers, opts.activation_policy,
                                         opts.device)
    if isinstance(layers, int):  # on the CPU backend too: wrap makes them exclusive there as well
        return dict(keep_layers=layers, exclusive_ok=layers > 0)
    if opts.device.type != "cuda":  # "auto" / "boundary" on the CPU backend: wrap's free device bytes are the
        free = int(machine.host_limits()["mem_available_bytes"] or 0)  # host's available memory (free_device_bytes)
    else:
        free = gpu_free(opts, machine)[0]
    return dict(exclusive_ok=free is not None, device_free=free, num_slots=opts.num_slots, activation_reserve=reserve,
                auto_placement=layers == "auto")


def host_part(units, opts, in_memory: bool, staging_buffers: int, gradient_accumulation_steps: int,
              margin: int, machine: AssumedMachine = AssumedMachine(), reserve: Optional[int] = None) -> HostPart:
    """The host store, staging, accumulator and disk-tier buffers ``wrap`` would allocate (the engine's
    own planning), and the budget check's verdict with ``margin`` bytes kept free on ``machine``;
    ``reserve``: the capacity share's activation reserve (:func:`activation_reserve`)."""
    from .disk_plan import plan_offload
    from .master_streamed import master_streamable
    from ..options import options

    accum_mode = opts.grad_accumulator
    cuda = opts.device.type == "cuda"
    reclaim = 0
    if in_memory and options().pin_after_fill:
        reclaim = sum(e.numel * e.param.element_size() for u in units for e in u.entries
                      if e.param.device.type == "cpu")
    accumulating = accum_mode is None and gradient_accumulation_steps > 1
    # The layers wrap would put on disk (none without offload_dir), by the engine's own planning.
    kw = dict(offload_dir=opts.offload_dir, host_memory_limit=opts.host_memory_limit, reclaimable_bytes=reclaim,
              cuda=cuda, num_buffers=options().disk_buffers, check=False,
              limits=machine.host_limits() if machine.host_bytes is not None else None,
              **_exclusive_args(opts, machine, reserve))
    # The master-streamed layers as wrap chooses them: it plans before any accumulator is known of.
    streamed = plan_offload(units, opts.compute_dtype, accum_mode, staging_buffers, compute_copy=opts.host_compute_copy,
                            streamable=master_streamable(units), **kw).master_streamed
    oplan = plan_offload(units, opts.compute_dtype, accum_mode, staging_buffers, with_accumulator=accumulating,
                         compute_copy=False, streamable=streamed, **kw)
    plan = oplan.host_plan
    accum = plan["accumulator_bytes"] if accumulating else 0
    store, staging = plan["store_bytes"], plan["staging_bytes"]
    pools = oplan.pool_bytes + oplan.accum_pool_bytes
    per = 16 if oplan.with_accumulator else 12  # fp32 master, exp_avg, exp_avg_sq [, accumulator] per element
    elem = torch.tensor([], dtype=opts.compute_dtype).element_size()  # their device state (DeviceUnit's buffers)
    absent = oplan.compute_absent or [False] * len(units)  # and their compute copy, unless a frozen entry keeps it
    excl = sum(per * int(plan["layout"]["unit_state_numel"][k]) + (elem * int(plan["layout"]["unit_numel"][k])
                                                                   if absent[k] else 0) for k in oplan.exclusive_units)
    excl_dev = sum(layer_device_bytes(plan["layout"], k, opts.compute_dtype, accumulating or accum_mode is True)
                   for k in oplan.exclusive_units)
    host = store + staging + accum + pools + oplan.scratch_bytes  # (a device-tier window's scratch buffer)
    pinned = store + staging if cuda else 0
    limits = machine.host_limits()
    short = machine.shortfall(host + margin, pinned, reclaim, limits)
    given = machine.host_bytes is not None
    cands = []  # the memory limits that apply, the tightest first
    if limits["mem_available_bytes"] is not None:
        cands.append((limits["mem_available_bytes"],
                      machine.host_limit_name if given else "MemAvailable limit (/proc/meminfo)"))
    if limits["cgroup_limit_bytes"] is not None:
        cands.append((limits["cgroup_limit_bytes"] - (limits["cgroup_usage_bytes"] or 0),
                      f"cgroup memory limit ({limits['cgroup_path']}, minus current usage)"))
    cands.sort()
    if options().skip_host_memory_check and not given:
        available, limit_name = None, None
    elif short is not None:
        available, limit_name = short["available_bytes"], short["limit"]
    else:
        available, limit_name = cands[0] if cands else (None, None)
    return HostPart(oplan=oplan, layout=plan["layout"], accum_mode=accum_mode, accumulating=accumulating,
                    reclaim=reclaim, accum=accum, store=store, staging=staging, pools=pools, host=host, pinned=pinned,
                    short=short, over_limit=opts.host_memory_limit is not None and host > opts.host_memory_limit,
                    tightest=cands[0] if cands else None, available=available, limit_name=limit_name,
                    machine=machine, exclusive_bytes=excl, exclusive_device_bytes=excl_dev)


@dataclass
class DevicePart:
    """The device bytes counted exactly (slots, resident unit, boundary state) and the free memory."""

    elem: int  # bytes per element of the compute dtype
    slot_bytes: int  # num_slots x the largest layer per layer shape
    resident_bytes: int  # the resident unit and its gradients
    free: Optional[int]  # free device memory (capped by gpu_memory_limit); the CPU device: host memory left
    boundary_bytes: int  # the step boundary's units' state (wrap's default on CUDA outside auto)
    limit_bytes: Optional[int] = None  # gpu_memory_limit in bytes (None: no cap, off CUDA, or a fraction of no known GPU)


def device_part(units, hp: HostPart, opts, margin: int) -> DevicePart:
    """The device part of ``units`` under ``opts``; the CPU device's free memory is what the host part leaves."""
    from .streamed_minimum import streamed_device_bytes

    cuda = opts.device.type == "cuda"
    elem = torch.tensor([], dtype=opts.compute_dtype).element_size()
    slot_bytes, resident_bytes = streamed_device_bytes(units, hp.layout["unit_numel"], opts.compute_dtype,
                                                       opts.num_slots)
    free, limit = gpu_free(opts, hp.machine)
    if not cuda and hp.tightest is not None:  # the CPU device's memory is the host's: what the host store
        free = max(0, hp.tightest[0] - hp.host - margin)  # and the margin leave under the tightest limit
    # "boundary" (wrap's default on CUDA outside activation_policy="auto"): the step boundary's units (resident, then
    # layer 0) keep their state on the device when it fits in 1/8 of the free memory (device_state_plan); an int K:
    # layers 0..K-1 (those not exclusive: theirs is exclusive_device_bytes)
    from .device_state_plan import resolve_device_state_layers

    layers = resolve_device_state_layers(opts.device_state_layers, opts.activation_policy, opts.device)
    boundary = boundary_state_bytes(units, hp.layout, elem, free) if cuda and layers == "boundary" else 0
    if cuda and isinstance(layers, int):
        excl = set(hp.oplan.exclusive_units)
        first = [k for k, u in enumerate(units) if u.kind == "layer"][:layers]
        summed = hp.accumulating or hp.accum_mode is True
        boundary = sum(layer_device_bytes(hp.layout, k, opts.compute_dtype, summed) for k in first if k not in excl)
    return DevicePart(elem=elem, slot_bytes=slot_bytes, resident_bytes=resident_bytes, free=free,
                      boundary_bytes=boundary, limit_bytes=limit)


def boundary_state_bytes(units, layout: dict, elem: int, free: Optional[int]) -> int:
    """Device bytes of ``device_state_layers="boundary"``: the resident unit's fp32 state, then layer 0's
    compute copy and state, each while the total fits in ``BOUNDARY_DEVICE_STATE_FRACTION`` of ``free``."""
    from .device_state_plan import BOUNDARY_DEVICE_STATE_FRACTION

    unit_numel, state_numel = layout["unit_numel"], layout["unit_state_numel"]
    budget = BOUNDARY_DEVICE_STATE_FRACTION * free if free is not None else float("inf")
    total = 0
    for k, u in enumerate(units):
        if u.kind != "layer" and state_numel[k]:  # the resident unit (its compute copy is counted above)
            if total + 16 * state_numel[k] <= budget:
                total += 16 * state_numel[k]
    first = next((k for k, u in enumerate(units) if u.kind == "layer"), None)
    # layer 0: no fp32 gradient buffer (its direct gradient is written into its compute copy)
    if first is not None and total + elem * unit_numel[first] + 12 * state_numel[first] <= budget:
        total += elem * unit_numel[first] + 12 * state_numel[first]
    return total


def offload_would_fit(units, opts, hp: HostPart, staging_buffers: int, device_need: int) -> Optional[tuple]:
    """``(disk layers, disk bytes, host_memory_limit)`` of the fewest decoder layers whose fp32 state on
    disk makes the host part fit, or None when even every layer on disk does not (the compute copies,
    the resident unit and the staging stay in host memory): then ``offload_dir`` cannot help.

    ``device_need``: bytes the CPU device's slots and activations take beside the store. The disk tier
    plans for the host part alone, so the ``host_memory_limit`` returned (None: none needed) keeps
    that much free."""
    from .disk_plan import plan_offload
    from .master_streamed import master_streamable
    from ..options import options

    cap = opts.host_memory_limit
    available = hp.machine.host_limits()["mem_available_bytes"]
    if device_need and available is not None:  # the CPU device's bytes come out of the same memory
        cap = min(cap if cap is not None else available, available - device_need)
        if cap <= 0:
            return None
    # offload_dir only names a filesystem to plan for: nothing is created there
    plan = plan_offload(units, opts.compute_dtype, hp.accum_mode, staging_buffers, offload_dir=os.sep,
                        host_memory_limit=cap, reclaimable_bytes=hp.reclaim, cuda=opts.device.type == "cuda",
                        num_buffers=options().disk_buffers, with_accumulator=hp.accumulating, check=False,
                        limits=hp.machine.host_limits() if hp.machine.host_bytes is not None else None,
                        compute_copy=opts.host_compute_copy, streamable=master_streamable(units))
    if not plan.disk_units or hp.machine.shortfall(plan.host_bytes, plan.pinned_bytes, hp.reclaim) is not None:
        return None
    if cap is not None and plan.host_bytes > cap:
        return None
    return len(plan.disk_units), plan.disk_total_bytes, cap if cap != opts.host_memory_limit else None


def all_frozen(units) -> list:
    """Copies of ``units`` with every entry frozen (the store of a model trained through LoRA alone)."""
    out = []
    for u in units:
        v = copy.copy(u)
        v.entries = [copy.copy(e) for e in u.entries]
        for e in v.entries:
            e.frozen = True
        out.append(v)
    return out
