"""Master-streamed layers: host-stored decoder layers without a compute copy in the host store.

A master-streamed layer keeps only its fp32 master, ``exp_avg`` and ``exp_avg_sq`` in the host store
(12 B/param at one backward per step, against 14 with the bf16 compute copy; 16 with accumulation,
the fp32 accumulator being allocated from the first micro-batch). Its device slot is filled from the
fp32 master (H2D, then cast on the device: the same bits as the compute copy the CPU AdamW would have
written), and its bf16 gradients wait on the device until its update may run (after the global norm with
``max_grad_norm``), then go D2H into the bounded pinned staging pool that the CPU AdamW reads.

``wrap(host_compute_copy=...)``: ``True`` keeps the compute copy for every host-stored layer; ``False`` streams every
eligible layer from its master; ``"auto"`` (the default) keeps it unless the host store does not fit, and
then (unless the layers on the device anyway suffice, made exclusive) streams the fewest, deepest eligible
layers, before more layers' state is made device-exclusive or goes to disk (:func:`~.disk_plan.plan_offload`).
Eligible (:func:`master_streamable`): decoder layers without a frozen entry (a frozen entry's only copy is
its compute copy), not under data parallel; a disk-tier layer keeps its compute section (it streams from
it), a device-exclusive one has no host section at all.
"""

from __future__ import annotations

from typing import List, Optional


def master_streamable(units, data_parallel: bool = False) -> List[int]:
    """The engine unit indices that may be master-streamed (no compute section in the host store): decoder
    layers without a frozen entry, and none under data parallel (ascending)."""
    if data_parallel:
        return []
    return [u.index for u in units if u.kind == "layer" and not any(e.frozen for e in u.entries)]


def check_host_compute_copy(value, where: str = "megatrain.wrap"):
    """``host_compute_copy`` as ``wrap`` takes it: ``"auto"``, ``True`` or ``False``.

    Raises:
        ValueError: one line naming the value.
    """
    if value is True or value is False or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError(f"{where}: host_compute_copy must be 'auto' (each layer's compute copy in host memory unless the "
                     "store does not fit), True (always) or False (stream every eligible layer from its fp32 master: "
                     f"12 B/param at one backward per step), got {value!r}")


def streamed_choice(compute_copy, streamable: List[int], fits, need_of) -> List[int]:
    """The master-streamed layers: ``host_compute_copy=False``: every streamable one; True: none; ``"auto"``:
    none when the store fits, else the fewest deepest ones that make it fit (all when none does)."""
    if compute_copy is False:
        return list(streamable)
    if compute_copy is True or not streamable or fits(need_of([], 0, streamed=[])):
        return []
    deepest = list(reversed(streamable))
    for k in range(1, len(deepest) + 1):
        if fits(need_of([], 0, streamed=deepest[:k])):
            return sorted(deepest[:k])
    return list(streamable)


def held_free(device_free, layout: dict, streamed: List[int], compute_dtype) -> object:
    """``device_free`` (bytes, or None) less the GPU memory the ``streamed`` (master-streamed) layers' gradients
    take while they wait for the global norm (compute-dtype bytes of each one's compute layout: ``max_grad_norm``
    at one backward per step, the Hugging Face Trainer's default; reserved whether or not the run clips), so that
    the exclusive device-state layers are planned in what is left."""
    if device_free is None or not streamed:
        return device_free
    import torch
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    return max(0, int(device_free) - sum(elem * int(layout["unit_numel"][k]) for k in streamed))


def capacity_beside_held(units, layout: dict, compute_dtype, device_free: int, streamed: List[int], layers: List[int],
                         num_slots: int, reserve: Optional[int], with_grad: Optional[bool] = None) -> dict:
    """The capacity share (:func:`~.device_state_plan.capacity_room`, the auto share holding too few) in the device
    memory the master-streamed layers' held gradients leave, counting only the layers that stay master-streamed: a
    leading layer made exclusive holds its state on the device instead of a gradient waiting there, so the share is
    sized again until it holds no more layers (each pass frees held bytes; it stops within ``len(layers)``)."""
    from .device_state_plan import capacity_room

    n = 0
    while True:
        free = held_free(device_free, layout, [k for k in streamed if k not in layers[:n]], compute_dtype)
        capacity = capacity_room(units, layout, compute_dtype, free, num_slots, reserve, with_grad=with_grad)
        if capacity["layers"] <= n:
            return capacity
        n = capacity["layers"]
