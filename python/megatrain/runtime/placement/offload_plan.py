"""What :func:`~megatrain.runtime.placement.disk_plan.plan_offload` chooses: :class:`OffloadPlan`.

A plain record, apart from the planner (:mod:`.disk_plan`) that fills it and the tiers
(:mod:`.disk_tier`) that open what it names, so both can import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class OffloadPlan:
    """What :func:`plan_offload` chose. Sizes in bytes.

    Attributes:
        disk_units: engine unit indices whose fp32 state is on disk (ascending; empty: none).
        exclusive_units: engine unit indices of the device-state layers whose fp32 state is on the device
            only (exclusive; :mod:`.device_tier`), ascending; empty: none.
        offloaded: per engine unit, whether its fp32 state is outside the host store (a disk unit or an
            exclusive one: ``HostStore(offloaded=...)``).
        master_streamed: engine unit indices of the master-streamed layers (no compute section in the host
            store: 12 B/param; ``wrap(host_compute_copy=...)``), ascending; empty: none.
        compute_absent: per engine unit, whether the host store has no compute section for it
            (``HostStore(compute_absent=...)``): a master-streamed layer, or an exclusive one without a frozen entry.
        host_plan: :func:`~megatrain.runtime.engine.units.plan_host_memory` of the store without their fp32 sections.
        state_layouts / accum_layouts: per disk unit, the section bytes of its state / accumulator file.
        disk_bytes: files of the state tier; accum_disk_bytes: of the accumulator tier.
        pool_bytes / accum_pool_bytes: RAM of the tiers' buffer pools.
        scratch_bytes: the host scratch buffer of one exclusive unit's fp32 state (a device-tier window).
        host_bytes: what the engine checks against the host budget (store + staging + pools + scratch
            [+ accumulators]).
        all_exclusive_bytes: (a refused plan only) host bytes with every layer exclusive, when even that
            does not fit; else 0.
        exclusive_max: how many leading decoder layers may be exclusive: an explicit ``device_state_layers=K``,
            or what the ``"auto"`` rule places in the free device memory (``device_budget_bytes``).
        device_budget_bytes: the device bytes that rule lets the layers use (None: an explicit K, not sized).
        capacity: when the ``"auto"`` share holds too few exclusive layers for the host part to fit, the
            capacity share (:func:`~.device_state_plan.capacity_room`'s dict: ``layers``, ``budget_bytes``,
            ``free_bytes``, ``streamed_bytes``, ``reserve_bytes``, ``reserve``); else None.
        exclusive_share: which rule made the exclusive layers: ``"auto"`` (the ``"auto"`` share),
            ``"capacity"`` (more than it: the capacity share), ``"explicit"`` (of ``device_state_layers=K``),
            None (no exclusive layer).
        disk_would_fit: (a refused plan without ``offload_dir`` only) whether the host part would fit with every
            candidate layer's fp32 state on disk (the refusal suggests ``offload_dir`` only then); else None.
        exclusive_needed: (a refused plan only) the fewest leading layers that would have to be exclusive for
            the host part to fit, None when even every layer would not.
        pinned_bytes: the page-locked part (CUDA: store + staging).
        free_bytes: free bytes of ``offload_dir``'s filesystem (plus stale tier files), None without a directory.
        with_accumulator: whether the accumulator was counted (store section, or auto mode with accumulation).
    """

    offload_dir: Optional[str]
    host_memory_limit: Optional[int]
    num_buffers: int
    disk_units: List[int] = field(default_factory=list)
    exclusive_units: List[int] = field(default_factory=list)
    offloaded: List[bool] = field(default_factory=list)
    master_streamed: List[int] = field(default_factory=list)
    compute_absent: List[bool] = field(default_factory=list)
    host_plan: dict = field(default_factory=dict)
    state_layouts: List[List[int]] = field(default_factory=list)
    accum_layouts: List[List[int]] = field(default_factory=list)
    disk_bytes: int = 0
    accum_disk_bytes: int = 0
    pool_bytes: int = 0
    accum_pool_bytes: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    scratch_bytes: int = 0
    all_exclusive_bytes: int = 0
    exclusive_max: int = 0
    device_budget_bytes: Optional[int] = None
    capacity: Optional[dict] = None
    exclusive_share: Optional[str] = None
    exclusive_needed: Optional[int] = None
    disk_would_fit: Optional[bool] = None
    free_bytes: Optional[int] = None
    with_accumulator: bool = False

    @property
    def disk_total_bytes(self) -> int:
        """Disk bytes of both tiers (the accumulator's only when counted)."""
        return self.disk_bytes + (self.accum_disk_bytes if self.with_accumulator else 0)
