"""The least GPU memory the streamed schedule needs, and the refusal of a ``gpu_memory_limit`` below it.

Every placement ``megatrain.wrap`` can choose keeps at least this on the device: the resident unit
(embeddings, final norm, LM head) as its compute copy plus the gradients of its trainable entries,
and ``num_slots`` slots per layer shape, each the compute copy of that shape's largest layer
(:func:`streamed_device_bytes`, the figure ``megatrain.estimate`` prints as "layer slots" and
"resident unit + grads"). With a batch known (``estimate``, ``megatrain train``) the activations'
floor is added: a layer's input and the gradient flowing back
(:func:`~.estimate_bytes.activation_floor_bytes`). A ``gpu_memory_limit`` below the sum is refused
(:class:`GpuMemoryLimitError`, one line) before the host store or any device buffer is allocated.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...byte_units import format_bytes


class GpuMemoryLimitError(ValueError):
    """``gpu_memory_limit`` is below the streamed schedule's minimum device footprint.

    Attributes (bytes): ``limit_bytes`` (the cap given, resolved), ``slot_bytes``, ``resident_bytes``,
    ``activation_bytes`` (the activations' floor; 0 when no batch is known) and ``need_bytes`` (their
    sum); ``given``: the value as the user wrote it (an int of bytes or a fraction).
    """

    def __init__(self, given, limit_bytes: int, slot_bytes: int, resident_bytes: int, num_slots: int,
                 activation_bytes: int = 0, where: str = "megatrain.wrap", name: str = "gpu_memory_limit"):
        self.given, self.limit_bytes, self.num_slots = given, int(limit_bytes), int(num_slots)
        self.slot_bytes, self.resident_bytes, self.activation_bytes = int(slot_bytes), int(resident_bytes), \
            int(activation_bytes)
        self.need_bytes = self.slot_bytes + self.resident_bytes + self.activation_bytes
        super().__init__(self.message(where, name))

    def message(self, where: str, name: str) -> str:
        """The one line, starting ``where`` and naming the option ``name`` (``runtime.gpu_memory_limit`` in the CLI)."""
        acts = (f" and the activations' floor for one micro-batch ({format_bytes(self.activation_bytes)})"
                if self.activation_bytes else " before any activation")
        return (f"{where}: {name}={self.given!r} ({format_bytes(self.limit_bytes)}) cannot hold even the streamed "
                f"schedule, which needs {format_bytes(self.need_bytes)} of GPU memory: the layer slots ({self.num_slots} per "
                f"layer shape, {format_bytes(self.slot_bytes)}) and the resident embedding / final norm / LM head with its "
                f"gradients ({format_bytes(self.resident_bytes)}){acts}; raise {name} to at least "
                f"{self.need_bytes} bytes ({format_bytes(self.need_bytes)}), or drop it")


def streamed_device_bytes(units, unit_numel, compute_dtype: torch.dtype, num_slots: int) -> tuple:
    """``(slot_bytes, resident_bytes)``: the device bytes of the streamed schedule, exact.

    Args:
        units: the model's units in forward order (``kind`` "layer" / "resident", ``template``, ``entries``).
        unit_numel: per unit, its padded compute length (``HostStore.layout_required``'s ``unit_numel``).
        compute_dtype: the dtype of the compute copy (bf16: 2 B, fp32: 4 B per element).
        num_slots: device slots per layer shape.

    Returns:
        ``slot_bytes``: ``num_slots`` x the compute copy of each layer shape (template); ``resident_bytes``:
        the resident unit's compute copy plus its trainable entries' gradients, in the compute dtype.
    """
    elem = torch.tensor([], dtype=compute_dtype).element_size()
    per_template = {}
    for u, n in zip(units, unit_numel):
        if u.kind == "layer":
            per_template[u.template] = max(int(n), per_template.get(u.template, 0))
    slot_bytes = num_slots * elem * sum(per_template.values())
    resident_bytes = sum(elem * int(n) + elem * sum(e.numel for e in u.entries if not e.frozen)
                         for u, n in zip(units, unit_numel) if u.kind != "layer")
    return slot_bytes, resident_bytes


def check_streamed_minimum(given, limit_bytes: Optional[int], slot_bytes: int, resident_bytes: int, num_slots: int,
                           activation_bytes: int = 0, where: str = "megatrain.wrap") -> None:
    """Refuse a cap below the streamed schedule's minimum (``limit_bytes`` None: no cap, nothing checked).

    Raises:
        GpuMemoryLimitError: a ``ValueError``, one line: what the schedule needs, the cap, what to do.
    """
    if limit_bytes is not None and int(limit_bytes) < slot_bytes + resident_bytes + activation_bytes:
        raise GpuMemoryLimitError(given, limit_bytes, slot_bytes, resident_bytes, num_slots, activation_bytes, where)


def check_wrap_gpu_memory_limit(units, opts, given, where: str = "megatrain.wrap") -> None:
    """``wrap``'s check of its cap against ``units`` (no batch known: the activations are not counted).

    Args:
        units: :func:`~..model.decoder_layers.model_units` of the model (not changed).
        opts: the resolved :class:`~..wrap_options.WrapOptions` (``gpu_memory_limit`` in bytes, None off CUDA
            or without a cap; ``compute_dtype``, ``num_slots``, ``grad_accumulator``).
        given: the ``gpu_memory_limit`` the user passed (for the message).

    Raises:
        GpuMemoryLimitError: as :func:`check_streamed_minimum`; nothing is allocated (the store's layout is
            planned by ``HostStore.layout_required``, which allocates nothing).
    """
    if opts.gpu_memory_limit is None:
        return
    from ..engine.units import plan_host_memory

    layout = plan_host_memory(units, opts.compute_dtype, opts.grad_accumulator)["layout"]
    slots, resident = streamed_device_bytes(units, layout["unit_numel"], opts.compute_dtype, opts.num_slots)
    check_streamed_minimum(given, opts.gpu_memory_limit, slots, resident, opts.num_slots, where=where)
