"""``MemoryEstimate``: what :func:`megatrain.estimate` returns, and its table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ...byte_units import MAX_BYTES, format_bytes


_SECTION_LABELS = [("compute", "compute copy"), ("master", "master (fp32)"), ("exp_avg", "exp_avg (fp32)"),
                   ("exp_avg_sq", "exp_avg_sq (fp32)"), ("grad_accum", "grad accumulator (fp32)")]


_fmt = format_bytes  # "1.50 GiB": two decimals, up to GiB, "n/a" for None


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


@dataclass
class MemoryEstimate:
    """What :func:`estimate` found. All sizes in bytes.

    Exact (the numbers the allocation uses): ``host_sections``, ``store_bytes``,
    ``accumulator_bytes``, ``staging_bytes``, ``host_bytes``, ``pinned_bytes``, the parameter
    counts, ``slot_bytes`` and ``resident_bytes``. Estimated: ``activation_bytes`` and
    ``logits_bytes`` (rough, +-50%); not counted: the CUDA context and allocator slack (~0.5-1 GiB
    of GPU memory), the Python process itself (~0.5-1 GiB of host memory), transient buffers (one
    tensor while loading a non-fp32 checkpoint): ``host_margin_bytes`` (``megatrain train``: 1 GiB)
    is kept free for them beyond the counted bytes when ``host_fits`` / ``gpu_fits`` are decided.
    """

    model_class: str
    device: str
    compute_dtype: str
    activation_policy: str
    num_slots: int
    micro_batch_size: int
    seq_len: Optional[int]
    gradient_accumulation_steps: int
    num_params: int
    trainable_params: int
    frozen_params: int
    num_layers: int
    host_sections: dict  # store section -> bytes (as HostStore.section_bytes)
    store_bytes: int  # the arena: sections + their 4 KiB padding + skew gaps
    accumulator_bytes: int  # fp32 accumulator CPUAdamW allocates outside the store (auto mode), 0 if none
    staging_bytes: int  # gradient staging buffers (pinned on CUDA)
    host_bytes: int  # store + accumulator + staging + the disk tier's RAM buffers
    pinned_bytes: int  # page-locked part of host_bytes (CUDA only)
    reclaimable_bytes: int  # the in-memory model's own weights, freed while the store is filled
    host_available_bytes: Optional[int]
    host_limit: Optional[str]
    host_fits: bool
    slot_bytes: int  # num_slots x largest layer (per layer shape) in compute dtype
    resident_bytes: int  # the resident unit (embedding, norm, LM head) and its gradients on the device
    device_state_bytes: int  # the step boundary's units' fp32 state on the device (wrap's default on CUDA)
    activation_bytes: int
    logits_bytes: int
    gpu_bytes: int  # slot + resident + device state + activation + logits (device memory; host memory on cpu)
    gpu_free_bytes: Optional[int]
    gpu_fits: Optional[bool]  # None: not checked (no CUDA here, or the host check is skipped)
    chunked_loss: str = "auto"  # the modes asked for (as megatrain.wrap) and what they give at this batch:
    tile_mlp: str = "auto"
    loss_rows: Optional[int] = None  # rows per chunk of the chunked loss (None: full logits)
    mlp_rows: Optional[int] = None  # rows per MLP tile (None: untiled)
    norm_rows: Optional[int] = None  # rows per tile of the layers' norms (None: untiled)
    device_name: str = ""  # the device checked, for messages: "this CPU", "cuda:0 (NVIDIA H200)"
    host_memory_limit: Optional[int] = None  # as wrap's (None, or MAX_BYTES for inf: the budget check's limits alone)
    offload_dir: Optional[str] = None  # the disk tier's directory (None: no disk tier)
    disk_layers: int = 0  # decoder layers whose fp32 state goes to disk
    disk_bytes: int = 0  # the tier's files (state, and the accumulators when counted)
    disk_pool_bytes: int = 0  # the tier's RAM buffers (counted in host_bytes)
    disk_free_bytes: Optional[int] = None  # free bytes of offload_dir's filesystem
    disk_fits: Optional[bool] = None  # None: no disk tier
    host_available_fits: Optional[bool] = None  # host_bytes against the available memory alone (None: host_fits)
    host_margin_bytes: int = 0  # host memory kept free beyond everything counted (megatrain train: 1 GiB)
    host_memory_given: Optional[int] = None  # estimate(host_memory=): the host judged (None: this machine's; MAX_BYTES: no limit)
    gpu_memory_given: Optional[int] = None  # estimate(gpu_memory=): the GPU's free bytes judged (None: this machine's)
    master_streamed_layers: int = 0  # decoder layers without a compute copy in the host store (12 B/param)
    exclusive_layers: int = 0  # leading decoder layers whose fp32 state lives on the device only (exclusive)
    exclusive_bytes: int = 0  # their host sections (14 B/param in bf16, 18 with the accumulator): out of host_bytes
    exclusive_max: int = 0  # how many the device budget holds (device_state_layers' "auto" rule, or K)
    held_grad_bytes: int = 0  # master-streamed layers' compute-dtype gradients held on the GPU until the norm: in gpu_bytes
    exclusive_device_bytes: int = 0  # their whole device state (compute copy + 3 fp32 sections, + the accumulator when summing): in gpu_bytes
    exclusive_share: Optional[str] = None  # "auto" / "capacity" / "explicit" (placement()'s), None: none
    capacity_max: Optional[int] = None  # how many the capacity share holds (sized when the "auto" share is too few)
    capacity_budget_bytes: Optional[int] = None  # its device bytes: free - streamed schedule - activation reserve
    activation_reserve_bytes: Optional[int] = None  # the reserve it kept (this batch's estimate, or a default share)
    exclusive_needed: Optional[int] = None  # when that is too few: how many would make the host part fit
    reasons: List[str] = field(default_factory=list)  # why it does not fit (one line each)
    advice: List[str] = field(default_factory=list)  # what to change
    notes: List[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Whether it fits the machine judged (this one, or the ``host_memory`` / ``gpu_memory`` given): host
        budget; GPU memory when the device is CUDA; the disk's free space."""
        return self.host_fits and self.gpu_fits is not False and self.disk_fits is not False

    @property
    def bytes_per_param(self) -> float:
        return self.host_bytes / self.num_params if self.num_params else 0.0

    def reason(self) -> str:
        """One line: why it does not fit and what to change ('' when it fits)."""
        if self.fits:
            return ""
        return "; ".join(self.reasons) + (". " + "; ".join(self.advice) if self.advice else "")

    @property
    def machine_given(self) -> bool:
        """Whether the fit was judged against a machine described by its sizes rather than this one."""
        return self.host_memory_given is not None or self.gpu_memory_given is not None

    def assumed_machine(self) -> dict:
        """Which machine was judged, part by part: ``{"host": "1.50 TiB (given)" | "this machine", "gpu": ...}``."""
        def one(n):
            if n is None:
                return "this machine"
            return "no limit (given)" if n == MAX_BYTES else f"{format_bytes(n, largest='TiB')} (given)"
        gpu = "none (CPU device)" if self.device == "cpu" else one(self.gpu_memory_given)
        return {"host": one(self.host_memory_given), "gpu": gpu}

    def to_dict(self) -> dict:
        """The fields, plus ``fits`` and ``assumed_machine`` (:meth:`assumed_machine`)."""
        import dataclasses

        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        d["assumed_machine"] = self.assumed_machine()
        return d

    def _tiers_line(self) -> str:
        """One line: where the fp32 state lives (host store, exclusive device-state layers, disk) and the verdict."""
        k = self.exclusive_layers
        host = self.num_layers - k - self.disk_layers
        share = " beyond the 'auto' share: the capacity share" if self.exclusive_share == "capacity" else ""
        excl = (f"{k} (layers 0..{k - 1}, {_fmt(self.exclusive_device_bytes)} on the device{share})" if k else "none")
        cap = (f" ('auto' share), {self.capacity_max} (capacity share: {_fmt(self.capacity_budget_bytes)} with a "
               f"{_fmt(self.activation_reserve_bytes)} activation reserve)" if self.capacity_max is not None else "")
        need = (f"; {self.exclusive_needed} would have to be, the device budget holds {self.exclusive_max}{cap}"
                if self.exclusive_needed else "")
        ms = f" ({self.master_streamed_layers} master-streamed: no compute copy)" if self.master_streamed_layers else ""
        return (f"tiers: host store {host} layers' fp32 state{ms}; device-state exclusive layers {excl}{need}; disk "
                f"{self.disk_layers} layers: host + device " + ("hold it" if self.fits else "DO NOT hold it"))

    def __str__(self) -> str:
        L = []
        L.append(f"megatrain estimate: {self.model_class}, {_count(self.num_params)} parameters "
                 f"({_count(self.trainable_params)} trainable, {_count(self.frozen_params)} frozen), "
                 f"{self.num_layers} streamed layers, {self.compute_dtype} compute on {self.device_name or self.device}")
        if self.machine_given:
            m = self.assumed_machine()
            L.append(f"assumed machine: host {m['host']}, GPU {m['gpu']}")
        L.append("host memory (exact):")
        for key, label in _SECTION_LABELS:
            if key in self.host_sections:
                L.append(f"  {label:<28}{_fmt(self.host_sections[key]):>12}")
            elif key == "grad_accum":
                if self.accumulator_bytes:
                    L.append(f"  {label:<28}{_fmt(self.accumulator_bytes):>12}  (outside the store, allocated when "
                             f"CPUAdamW has gradient_accumulation_steps={self.gradient_accumulation_steps})")
                else:
                    L.append(f"  {label:<28}{'none':>12}  (one backward per step)")
        pad = self.store_bytes - sum(self.host_sections.values())
        L.append(f"  {'store total':<28}{_fmt(self.store_bytes):>12}" + (f"  (incl. {_fmt(pad)} alignment)" if pad else ""))
        L.append(f"  {'gradient staging':<28}{_fmt(self.staging_bytes):>12}")
        if self.offload_dir is not None:
            L.append(f"  {'disk tier buffers':<28}{_fmt(self.disk_pool_bytes):>12}  (RAM)")
        pinned = f"pinned {_fmt(self.pinned_bytes)}" if self.pinned_bytes else \
            "nothing pinned" + (" (CPU device: no DMA)" if self.device == "cpu" else "")
        L.append(f"  {'host total':<28}{_fmt(self.host_bytes):>12}  = {self.bytes_per_param:.2f} B/param; {pinned}")
        if self.host_memory_given == MAX_BYTES:
            L.append("  host check: none (host_memory given as unlimited: no host limit)")
        elif self.host_available_bytes is None:
            L.append("  host check: skipped (MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1 or no limit found)")
        else:
            credit = f" + {_fmt(self.reclaimable_bytes)} freed from the model" if self.reclaimable_bytes else ""
            avail = self.host_fits if self.host_available_fits is None else self.host_available_fits
            margin = f" (with a {_fmt(self.host_margin_bytes)} margin kept free)" if self.host_margin_bytes else ""
            L.append(f"  host check: {_fmt(self.host_available_bytes)}{credit} available under the {self.host_limit}"
                     f"{margin}: " + ("fits" if avail else "DOES NOT FIT"))
        if self.host_memory_limit == MAX_BYTES:
            L.append("  host_memory_limit: none (no limit beyond the machine's)")
        elif self.host_memory_limit is not None:
            L.append(f"  host_memory_limit: {_fmt(self.host_memory_limit)}: "
                     + ("fits" if self.host_bytes <= self.host_memory_limit else "DOES NOT FIT"))
        if self.exclusive_layers or self.exclusive_needed or self.master_streamed_layers:
            L.append(self._tiers_line())
        if self.offload_dir is not None:
            L.append(f"disk tier ({self.offload_dir}): fp32 state of {self.disk_layers} of {self.num_layers} decoder "
                     f"layers, {_fmt(self.disk_bytes)}; {_fmt(self.disk_free_bytes)} free: "
                     + ("fits" if self.disk_fits else "DOES NOT FIT"))
        where = "GPU" if self.device.startswith("cuda") else "device (cpu: host memory beside the store)"
        tokens = f"{self.micro_batch_size} x {self.seq_len} tokens" if self.seq_len else "no sequence length given"
        L.append(f"{where} memory (slots and resident exact; activations and logits rough, {self.activation_policy}, "
                 f"{tokens}):")
        L.append(f"  {'layer slots':<28}{_fmt(self.slot_bytes):>12}  ({self.num_slots} per layer shape)")
        L.append(f"  {'resident unit + grads':<28}{_fmt(self.resident_bytes):>12}")
        if self.held_grad_bytes:
            L.append(f"  {'held gradients':<28}{_fmt(self.held_grad_bytes):>12}  (master-streamed layers', until the "
                     "global norm: max_grad_norm)")
        if self.device_state_bytes:
            L.append(f"  {'boundary units fp32 state':<28}{_fmt(self.device_state_bytes):>12}  (resident unit, layer 0: "
                     "device_state_layers='boundary')")
        for label, n in (("activations", self.activation_bytes), ("logits + loss", self.logits_bytes)):
            L.append(f"  {label:<28}{'~' + _fmt(n):>12}" if self.seq_len else
                     f"  {label:<28}{'not counted':>12}  (pass seq_len= and micro_batch_size=)")
        if self.seq_len:
            loss = (f"loss over chunks of {self.loss_rows:,} rows, no full logits" if self.loss_rows
                    else "full logits")
            mlp = f"MLP over tiles of {self.mlp_rows:,} rows" if self.mlp_rows else "MLP untiled"
            if self.norm_rows:
                mlp += f", norms over tiles of {self.norm_rows:,} rows"
            L.append(f"  long context: {loss} (chunked_loss={self.chunked_loss}); {mlp} (tile_mlp={self.tile_mlp})")
        free = f"; {_fmt(self.gpu_free_bytes)} free: " + ("fits" if self.gpu_fits else "DOES NOT FIT") \
            if self.gpu_free_bytes is not None and self.gpu_fits is not None else ""
        L.append(f"  {'total':<28}{'~' + _fmt(self.gpu_bytes):>12}{free}")
        for n in self.notes:
            L.append(f"note: {n}")
        where = "the assumed machine" if self.machine_given else "this machine"
        L.append(f"fits {where}" if self.fits else f"does not fit: {self.reason()}")
        return "\n".join(L)

