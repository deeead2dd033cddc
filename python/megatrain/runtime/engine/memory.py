"""The memory side of an :class:`~megatrain.runtime.engine.core.Engine`: the fp32 gradient accumulator
outside the store, page-locking the filled store, and the device-state layers.

:class:`EngineMemory` is mixed into :class:`~megatrain.runtime.engine.core.Engine`. The accumulator of
auto mode (``grad_accumulator=None``) is allocated when first needed (``enable_accumulator``, after
its host budget check); ``finish_fill`` page-locks the store once it is filled (pin-after-fill);
``init_device_state`` / ``resize_device_state`` keep the whole training state of the first decoder
layers (and the resident unit) on the device (:mod:`..placement.device_state`), sized from
``free_device_bytes`` (:mod:`..placement.device_state_plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from ..._loader import load_extension
from ..placement.host_memory import check_host_budget

if TYPE_CHECKING:
    from .units import Unit

_C = load_extension()


class EngineMemory:
    """Accumulator, pin-after-fill and device-state layers of an :class:`~megatrain.runtime.engine.core.Engine`
    (see module docstring)."""

    # ------------------------------------------------------------------ memory helpers
    @property
    def has_accumulator(self) -> bool:
        """Whether a second gradient before ``step()`` can be summed (accumulator present or allocatable)."""
        return self.accumulator_mode is not False

    @property
    def accumulator_allocated(self) -> bool:
        return self.accumulator_mode is True or self._accum is not None

    def enable_accumulator(self) -> None:
        """Allocate the fp32 gradient accumulator now (auto mode; no-op when present).

        4 bytes per trainable parameter, outside the store (CPU only: it is never DMA'd), zeroed.

        Raises:
            RuntimeError: the model was wrapped with ``grad_accumulator=False``.
            HostMemoryError: it does not fit in host memory (nothing allocated).
        """
        if self.accumulator_allocated:
            return
        if self.accumulator_mode is False:
            raise RuntimeError("megatrain: the model was wrapped with grad_accumulator=False; gradient accumulation "
                               "needs the fp32 accumulator: wrap with grad_accumulator=None (auto) or True")
        need = self.host_plan["accumulator_bytes"]
        check_host_budget(need, 0, "gradient accumulator")
        plan = self.offload_plan
        if plan.host_memory_limit is not None and not plan.with_accumulator:
            total = plan.host_bytes + need + (_C.DiskTier.pool_bytes(plan.accum_layouts, plan.num_buffers)
                                              if plan.disk_units else 0)
            if total > plan.host_memory_limit:
                e = _C.HostMemoryError(
                    f"megatrain: the fp32 gradient accumulator needs {need} more bytes of host memory ({total} in all) "
                    f"but host_memory_limit is {plan.host_memory_limit}: wrap with grad_accumulator=True (then the "
                    "layers put on disk leave room for it), or raise host_memory_limit")
                e.needed_bytes, e.available_bytes, e.limit = total, plan.host_memory_limit, "host_memory_limit"
                raise e
        if self.disk is not None:  # the disk units' accumulators: a tier of their own (offload_dir/grad_accum)
            self.disk.enable_accumulator()
        self._accum = {u.index: torch.zeros(u.state_numel, dtype=torch.float32) for u in self.units if u.disk is None}

    def accumulator_bytes(self) -> int:
        """Host bytes of the fp32 gradient accumulator now allocated (store section or separate)."""
        if self.accumulator_mode is True:
            return int(self.store.section_bytes.get("grad_accum", 0))
        if self._accum is None:
            return 0
        return sum(t.numel() * 4 for t in self._accum.values())

    def finish_fill(self) -> None:
        """The store is filled: page-lock it now (pin-after-fill, the default on CUDA)."""
        if self.cuda and self.pin_after_fill and not self.store.is_pinned:
            self.store.pin()

    def init_device_state(self, layers) -> int:
        """Keep the whole training state of ``layers`` (``int`` K: layers ``0 .. K-1``; ``"auto"``;
        ``"boundary"``) on the device.

        Called once, after the store is filled. ``"auto"``: first the resident unit (embedding, final
        norm, LM head: what the next forward needs first, and the last gradients of a backward) when
        :meth:`device_state_resident` offers it and it fits, then as many layers as fit in
        ``AUTO_DEVICE_STATE_FRACTION`` of the free device memory, from the exact buffer sizes
        (compute copy + fp32 master, exp_avg, exp_avg_sq, grad accumulator: 18 B/param in bf16;
        16 for the resident unit, whose compute copy is its existing device buffer).
        ``"boundary"``: the resident unit, then layer 0, while together they fit in
        ``BOUNDARY_DEVICE_STATE_FRACTION`` of the free device memory
        (:func:`~..placement.device_state_plan.plan_boundary_units`).
        Returns K (decoder layers). See ``megatrain.runtime.placement.device_state``.

        Raises:
            ValueError: ``layers`` is not an int >= 0, ``"auto"`` or ``"boundary"``, or more than the model has.
        """
        from ..placement import device_state as ds
        from ..placement import device_state_plan as dsp

        dsp.check_device_state_layers(layers)
        on_host = self.layers if self.disk is None else self.layers[:min(u.index for u in self.disk.units)]
        resident = []
        if layers == "boundary":  # the step boundary's units: resident, then layer 0, within a small share
            resident, layers = dsp.plan_boundary_units(self.device_state_resident(), on_host[0] if on_host else None,
                                                       self.compute_dtype, self.free_device_bytes())
        elif layers == "auto":  # never a layer whose state is on disk
            free = self.free_device_bytes()
            res = self.device_state_resident()
            if res is not None:  # what the next forward needs first; its compute copy is already on the device
                need = dsp.unit_device_bytes(res, self.compute_dtype, with_compute=False)
                if need <= dsp.AUTO_DEVICE_STATE_FRACTION * free:
                    resident, free = [res], free - need / dsp.AUTO_DEVICE_STATE_FRACTION
            layers = dsp.plan_device_state_layers(on_host, self.compute_dtype, free)
        elif self.disk is not None and layers > len(on_host):
            raise ValueError(f"megatrain.wrap: device_state_layers={layers}, but layers {len(on_host)} and above keep "
                             f"their fp32 state on disk (offload_dir); use at most {len(on_host)}")
        if layers > len(self.layers):
            raise ValueError(f"megatrain.wrap: device_state_layers={layers}, but the model has {len(self.layers)} "
                             f"decoder layers; use at most {len(self.layers)} (or 'auto')")
        if layers == 0 and not resident:
            return 0
        chosen = resident + self.layers[:layers]
        self.device_state = ds.DeviceState(self, chosen)
        self._drop_unused_slots(list(self.slots))
        return layers

    def _drop_unused_slots(self, templates) -> None:
        """Free the slots of those layer ``templates`` no streamed layer uses any more."""
        for template in templates:
            if all(u.device_state is not None for u in self.layers if u.template == template):
                self.drop_slots(template)

    def resize_device_state(self, layers: int) -> None:
        """Keep the training state of decoder layers ``0 .. layers-1`` on the device from now on (the
        placement planner's second decision; see ``megatrain.runtime.placement.replan``).

        Only between optimizer steps, with no gradient accumulated: waits for every queued update,
        copies the state of the layers given back to the host store and frees their device buffers,
        or copies the new layers' state from the host store; the slots of a layer template come back
        when a streamed layer uses it again and go when none does. The resident unit stays as it is.
        """
        from ..placement import device_state as ds

        self.flush()
        have = self.device_state.layers if self.device_state is not None else []
        k = len(have)
        if layers == k:
            return
        if layers < k:
            self.device_state.remove(have[layers:])
            for u in have[layers:]:
                if not self.slots.get(u.template):
                    self.add_slots(u)
            if not self.device_state.units:
                self.device_state = None
        else:
            new = self.layers[k:layers]
            if self.device_state is None:
                self.device_state = ds.DeviceState(self, new)
            else:
                self.device_state.add(new)
            self._drop_unused_slots({u.template for u in new})
        self.invalidate(self.layers[min(k, layers):max(k, layers)])

    def check_resident_params(self, where: str, overwritten=()) -> None:
        """Raise if a parameter outside the store's control was written in place (:class:`~..model.wrapped_engine.WrappedEngine`)."""

    def note_resident_params(self) -> None:
        """Record the state :meth:`check_resident_params` compares against (:class:`~..model.wrapped_engine.WrappedEngine`)."""

    def device_state_resident(self) -> Optional[Unit]:
        """The resident unit ``device_state_layers="auto"`` may keep on the device with the layers
        (its compute copy must already be a device buffer: :class:`~..model.wrapped_engine.WrappedEngine`), or None."""
        return None

    # wrap(gpu_memory_limit=): the cap in bytes (None: the whole device); see free_device_bytes
    gpu_memory_limit_bytes: Optional[int] = None

    def free_device_bytes(self) -> int:
        """Device bytes free for new tensors (CUDA: free + cached by torch, at most ``gpu_memory_limit``
        less what this process's tensors on the device hold; CPU: available host memory).

        Every placement decision reads the free memory here (device-state layers, kept graphs, the
        planner's second decision, chunked loss and tiling), so ``wrap(gpu_memory_limit=)`` caps them all.
        """
        if self.cuda:
            from ..placement.device_state_plan import capped_free_bytes

            free, _ = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            return capped_free_bytes(free + torch.cuda.memory_reserved(self.device) - allocated, allocated,
                                     self.gpu_memory_limit_bytes)
        from ..placement.host_memory import host_memory_limits
        return int(host_memory_limits().get("mem_available_bytes") or 0)
