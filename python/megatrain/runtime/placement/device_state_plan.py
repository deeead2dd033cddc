"""Placement of the device-state layers (:mod:`.device_state`): the ``device_state_layers`` argument
(its default, its check) and how many layers fit on the device.

:func:`resolve_device_state_layers` and :func:`check_device_state_layers` give ``megatrain.wrap``'s
``device_state_layers`` its default and refuse bad values; :func:`unit_device_bytes` is the exact
device size of one unit's state; :func:`plan_device_state_layers` counts the layers (from layer 0)
whose state fits in ``AUTO_DEVICE_STATE_FRACTION`` of the free device memory (``"auto"`` at wrap;
the placement planner, :mod:`.replan`, places once more after the first step);
:func:`plan_boundary_units` chooses the units of ``"boundary"`` (the default of the streamed
policies on CUDA); :func:`exclusive_room` / :func:`capacity_room` size the exclusive device-state layers (the
``"auto"`` share, and the capacity share beyond it when the host store would not fit otherwise).
:func:`check_gpu_memory_limit` / :func:`resolve_gpu_memory_limit` /
:func:`capped_free_bytes`: ``megatrain.wrap``'s ``gpu_memory_limit``, the cap on the device memory
every placement decision counts as free.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...byte_units import format_bytes
from ..activations.activation_policy import ActivationPolicy

# device_state_layers="auto": as many layers (from layer 0) as fit in this fraction of the device
# memory free when the model is wrapped; the rest is left for activations (activation_policy
# "auto" measures what is left), logits and fragmentation.
AUTO_DEVICE_STATE_FRACTION = 0.5

# device_state_layers="boundary" (the default on CUDA under every activation policy but "auto"): the
# resident unit, then layer 0, keep their whole training state on the device when together they fit
# in this fraction of the device memory free at wrap time. Their gradients are the last of a
# backward and their weights the first need of the next forward: on the host, their H2D copies,
# gradient D2H and CPU AdamW sit between two steps with the GPU idle (20-30 ms per step at 3.37B).
BOUNDARY_DEVICE_STATE_FRACTION = 0.125


def resolve_device_state_layers(value, activation_policy, device: torch.device):
    """``device_state_layers`` as given, or its default (``None``): on CUDA ``"auto"`` under
    ``activation_policy="auto"`` (the placement planner) and ``"boundary"`` under the other policies;
    on the CPU backend 0 (every layer's state in the host store, which already is the compute
    device's memory). ``activation_policy``: an :class:`~..activations.activation_policy.ActivationPolicy`
    or its string."""
    if value is None:
        if device.type != "cuda":
            return 0
        return "auto" if ActivationPolicy.parse(activation_policy).is_auto else "boundary"
    return value


def check_device_state_layers(value, what: str = "megatrain.wrap: device_state_layers") -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 0, ``"auto"``, ``"boundary"`` or ``None`` (the default)."""
    if value is None or (isinstance(value, str) and value in ("auto", "boundary")):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an int >= 0 (layers 0..K-1 keep their whole training state on the device), "
                         f"'auto' or 'boundary', got {value!r}")


def unit_device_bytes(unit, compute_dtype: torch.dtype, with_compute: bool = True,
                      with_grad: Optional[bool] = None) -> int:
    """Device bytes :class:`~.device_state.DeviceState` allocates for ``unit``: the compute copy (unless
    ``with_compute`` is False: the resident unit's is its existing device buffer), fp32 master /
    exp_avg / exp_avg_sq (12 B per element) and the fp32 gradient accumulator (4 B) when ``with_grad``.

    ``with_grad`` None: the resident unit (``with_compute`` False) has its accumulator from the start, a
    decoder layer only once gradients are summed (its direct gradient is written into its compute copy).
    ``unit.numel`` / ``unit.state_numel`` are the padded lengths of the unit's compute and fp32
    host-store sections (the device buffers use the same layout).
    """
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    grad = (not with_compute) if with_grad is None else with_grad
    return (int(unit.numel) * elem if with_compute else 0) + (16 if grad else 12) * int(unit.state_numel)


def plan_device_state_layers(layers, compute_dtype: torch.dtype, free_bytes: int,
                             fraction: Optional[float] = None, with_grad: Optional[bool] = None) -> int:
    """Number of layers (from layer 0) whose device state fits in ``fraction * free_bytes``
    (``fraction`` None: ``AUTO_DEVICE_STATE_FRACTION``; ``with_grad``: as :func:`unit_device_bytes`, True when
    gradients are summed: the fp32 accumulator, 4 B/param more)."""
    budget = (AUTO_DEVICE_STATE_FRACTION if fraction is None else fraction) * max(0, int(free_bytes))
    k, used = 0, 0
    for u in layers:
        used += unit_device_bytes(u, compute_dtype, with_grad=with_grad)
        if used > budget:
            break
        k += 1
    return k


def plan_auto_units(resident, layers, compute_dtype: torch.dtype, free_bytes: int,
                    with_grad: Optional[bool] = None) -> tuple:
    """The units of ``device_state_layers="auto"``: ``(resident_units, K)``.

    The resident unit (``resident``, None when it cannot be placed) first, when its fp32 state fits in
    ``AUTO_DEVICE_STATE_FRACTION`` of ``free_bytes``, then as many of ``layers`` (from the first) as fit
    in what is left (:func:`plan_device_state_layers`). Units need ``numel`` / ``state_numel`` (padded
    lengths of their compute copy and fp32 sections). The same rule sizes the exclusive device-state
    layers at wrap (:func:`~.disk_plan.plan_offload`) and in ``megatrain.estimate``.
    """
    placed, free = [], max(0, int(free_bytes))
    if resident is not None:  # what the next forward needs first; its compute copy is already on the device
        need = unit_device_bytes(resident, compute_dtype, with_compute=False)
        if need <= AUTO_DEVICE_STATE_FRACTION * free:
            placed, free = [resident], free - need / AUTO_DEVICE_STATE_FRACTION
    return placed, plan_device_state_layers(layers, compute_dtype, free, with_grad=with_grad)


def exclusive_room(units, layout: dict, compute_dtype: torch.dtype, free_bytes: int,
                   with_grad: Optional[bool] = None) -> tuple:
    """``(K, budget bytes)``: how many leading decoder layers of ``units`` the ``"auto"`` rule
    (:func:`plan_auto_units`) places on the device in ``free_bytes``, from the store's ``layout``
    (``HostStore.layout_required``: ``unit_numel`` / ``unit_state_numel``) before the store exists, and
    the device bytes that rule lets the layers use (``AUTO_DEVICE_STATE_FRACTION`` of ``free_bytes``
    less the resident unit's share). A resident unit with no trainable entry is not placed."""
    from types import SimpleNamespace

    view = [SimpleNamespace(kind=u.kind, numel=int(layout["unit_numel"][k]), state_numel=int(layout["unit_state_numel"][k]))
            for k, u in enumerate(units)]
    resident = next((v for v in view if v.kind != "layer" and v.state_numel), None)
    placed, k = plan_auto_units(resident, [v for v in view if v.kind == "layer"], compute_dtype, free_bytes,
                                with_grad=with_grad)
    budget = AUTO_DEVICE_STATE_FRACTION * max(0, int(free_bytes))
    if placed:
        budget -= unit_device_bytes(placed[0], compute_dtype, with_compute=False)
    return k, int(budget)


# The capacity share: when the exclusive device-state layers the "auto" share holds do not make the host
# store fit, the planner may make more leading layers exclusive, in the free device memory (capped by
# gpu_memory_limit) less the streamed schedule's minimum (streamed_minimum.streamed_device_bytes) less an
# activation reserve. A capacity choice, taken only when the host would otherwise not hold the model: the
# kept graphs of activation_policy="auto" then get what the reserve leaves. With a batch known
# (megatrain.estimate) the reserve is the estimate's own activation + logits bytes; without one (wrap) it
# is this fraction of the free device memory: a guess, to be measured on the H200 (the estimate gives
# ~16 GiB, 11% of 141 GiB, for a 14B Llama at 4 x 4096 tokens under recompute).
CAPACITY_ACTIVATION_RESERVE_FRACTION = 0.2


def capacity_room(units, layout: dict, compute_dtype: torch.dtype, free_bytes: int, num_slots: int,
                  reserve_bytes: Optional[int] = None, with_grad: Optional[bool] = None) -> dict:
    """The capacity share of the device for exclusive device-state layers (see
    ``CAPACITY_ACTIVATION_RESERVE_FRACTION``): how many leading decoder layers of ``units`` have their whole
    device state (compute copy + 3 fp32 sections, :func:`unit_device_bytes`) in it.

    Args:
        units: the engine's units (``kind``, ``template``, ``entries``), in forward order.
        layout: the store's layout (``HostStore.layout_required``: ``unit_numel`` / ``unit_state_numel``).
        free_bytes: free device bytes (capped by ``gpu_memory_limit``).
        num_slots: the streamed schedule's device slots per layer shape.
        reserve_bytes: device bytes kept for activations and logits (None: the fraction of ``free_bytes``).
        with_grad: True when gradients are summed (each layer's fp32 accumulator counted: 18 B/param in bf16).

    Returns:
        dict: ``layers`` (K), ``budget_bytes`` (``free_bytes - streamed_bytes - reserve_bytes``, >= 0),
        ``free_bytes``, ``streamed_bytes`` (layer slots + resident unit with its gradients),
        ``reserve_bytes`` and ``reserve`` (``"batch"``: given; ``"fraction"``: the default share).
    """
    from types import SimpleNamespace

    from .streamed_minimum import streamed_device_bytes

    free = max(0, int(free_bytes))
    slots, resident = streamed_device_bytes(units, layout["unit_numel"], compute_dtype, num_slots)
    source = "fraction" if reserve_bytes is None else "batch"
    reserve = int(CAPACITY_ACTIVATION_RESERVE_FRACTION * free) if reserve_bytes is None else int(reserve_bytes)
    budget = max(0, free - slots - resident - reserve)
    view = [SimpleNamespace(numel=int(layout["unit_numel"][k]), state_numel=int(layout["unit_state_numel"][k]))
            for k, u in enumerate(units) if u.kind == "layer"]
    k = plan_device_state_layers(view, compute_dtype, budget, fraction=1.0, with_grad=with_grad)
    return dict(layers=k, budget_bytes=budget, free_bytes=free, streamed_bytes=slots + resident,
                reserve_bytes=reserve, reserve=source)


def plan_boundary_units(resident, first_layer, compute_dtype: torch.dtype, free_bytes: int,
                        fraction: Optional[float] = None) -> tuple:
    """The units of ``device_state_layers="boundary"``: ``(resident_units, layers)``.

    The resident unit (``resident``, None when it cannot be placed) first, then ``first_layer``
    (layer 0, None when it cannot), each only while their device state together fits in
    ``fraction`` (default ``BOUNDARY_DEVICE_STATE_FRACTION``) of ``free_bytes``. Returns the list of
    resident units placed (``[]`` or ``[resident]``) and the number of decoder layers placed (0 or 1).
    """
    budget = (BOUNDARY_DEVICE_STATE_FRACTION if fraction is None else fraction) * max(0, int(free_bytes))
    used, placed = 0, []
    if resident is not None:
        need = unit_device_bytes(resident, compute_dtype, with_compute=False)
        if need <= budget:
            used, placed = need, [resident]
    layers = 0
    if first_layer is not None and used + unit_device_bytes(first_layer, compute_dtype) <= budget:
        layers = 1
    return placed, layers


# gpu_memory_limit: an int below this is refused (it would be bytes; 1 most likely meant "all of it", 1.0).
MIN_GPU_MEMORY_LIMIT_BYTES = 1 << 20


def check_gpu_memory_limit(value, what: str = "megatrain.wrap: gpu_memory_limit"):
    """``value`` checked and normalised: None, an int of bytes >= 1 MiB (a string such as ``"40GiB"`` is read
    by :func:`~megatrain.byte_units.parse_bytes`, as ``host_memory_limit``'s is), or a float in (0, 1] (a
    fraction of the device's memory). Returns None, the int of bytes, or the float.

    Raises:
        ValueError: one line naming the value.
    """
    if value is None:
        return None
    given = value
    if isinstance(value, str):
        from ...byte_units import parse_bytes
        try:
            value = parse_bytes(value)
        except ValueError:
            pass  # refused below, with the value as given
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= MIN_GPU_MEMORY_LIMIT_BYTES:
        return value
    hint = " (an int is bytes: for a share of the device write a float, e.g. 1.0)" if (
        isinstance(value, int) and not isinstance(value, bool) and 0 < value < MIN_GPU_MEMORY_LIMIT_BYTES) else ""
    raise ValueError(f"{what} must be a number of bytes (an int >= {MIN_GPU_MEMORY_LIMIT_BYTES}, or a string such as "
                     f"'40GiB') or a fraction of the device's memory (a float in (0, 1], e.g. 0.5), got {given!r}{hint}")


def resolve_gpu_memory_limit(value, device: torch.device, total_bytes: Optional[int] = None) -> Optional[int]:
    """``gpu_memory_limit`` in bytes (checked by :func:`check_gpu_memory_limit`), or None (no cap).

    Args:
        value: None, an int (bytes), a size string (``"40GiB"``) or a float in (0, 1] (a fraction of the
            device's memory).
        device: the compute device. On the CPU backend the cap does not apply (None): the "device"
            memory there is host memory, bounded by ``host_memory_limit`` instead.
        total_bytes: the device's memory; default ``torch.cuda.get_device_properties(device).total_memory``.
    """
    value = check_gpu_memory_limit(value)
    if value is None or torch.device(device).type != "cuda":
        return None
    if isinstance(value, float):
        if total_bytes is None:
            total_bytes = torch.cuda.get_device_properties(device).total_memory
        return int(value * int(total_bytes))
    return int(value)


def capped_free_bytes(free_bytes: int, allocated_bytes: int, limit_bytes: Optional[int]) -> int:
    """Device bytes the planner may place in: ``free_bytes`` (what the device has free for new tensors),
    at most ``limit_bytes - allocated_bytes`` (the cap less what this process's tensors on the device
    already hold: ``torch.cuda.memory_allocated``), never below 0. ``limit_bytes`` None: no cap."""
    free = max(0, int(free_bytes))
    if limit_bytes is None:
        return free
    return max(0, min(free, int(limit_bytes) - int(allocated_bytes)))


def capacity_words(capacity: Optional[dict]) -> str:
    """The capacity share's numbers for a message (``''`` when it was not sized): its budget, how it is made
    and how many decoder layers' whole state it holds."""
    if not capacity:
        return ""
    why = "the batch's activation estimate" if capacity["reserve"] == "batch" else (
        f"{CAPACITY_ACTIVATION_RESERVE_FRACTION:.0%} of the free memory, no batch known")
    b = {k: format_bytes(capacity[k]) for k in ("budget_bytes", "free_bytes", "streamed_bytes", "reserve_bytes")}
    return (f"its capacity share ({b['budget_bytes']}: {b['free_bytes']} free less {b['streamed_bytes']} for the "
            f"streamed schedule and a {b['reserve_bytes']} activation reserve, {why}) the whole state of "
            f"{capacity['layers']} decoder layers, ")
