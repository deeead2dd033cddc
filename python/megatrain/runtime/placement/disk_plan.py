"""The disk tier in the engine: which layers keep their fp32 state on local disk, and access to it.

``wrap(model, offload_dir=PATH, host_memory_limit=BYTES)``: the decoder layers whose fp32 state
(master, ``exp_avg``, ``exp_avg_sq`` and, with accumulation, the gradient accumulator) does not fit
in host memory keep it in :class:`megatrain._C.DiskTier` files under ``offload_dir``
(``csrc/megatrain/disk_tier/``, docs/disk_tier.md); their bf16 compute copy stays in the pinned
host store, since it is what streams to the GPU.

* :func:`plan_offload` chooses them before anything is allocated: the deepest layers first (their
  updates are needed last by the next forward), as few as make the host part fit
  ``host_memory_limit`` and the host budget check (the disk tier's RAM buffers counted), and
  checks the disk's free space.
* :class:`DiskOffload` (``Engine.disk``, :mod:`.disk_tier`) owns the tiers: ``tier`` (the state; tier unit ``k`` is
  engine unit ``Unit.disk == k``) and ``accum`` (the accumulators, ``offload_dir/grad_accum``,
  made when the accumulator is enabled). The worker's update, accumulate and move tasks acquire a
  unit's buffer when they run (``_C.Worker.submit_*`` with ``state_tier`` / ``accum_tier``);
  the main thread reads and writes state through :meth:`DiskOffload.window` (fill, checkpoints,
  ``state_dict``, ``optimizer.state``) after the worker is idle. Reads are issued ahead
  (:meth:`DiskOffload.prefetch`) in the order the updates will run; writes go behind.
"""

from __future__ import annotations

import errno
import os
from typing import List, Optional

import torch

from ...byte_units import format_bytes, parse_bytes
from ..._loader import load_extension
from ...state.atomic import write_probe_error
from .device_state_plan import capacity_words
from .device_tier import scratch_bytes
from .disk_tier import ACCUM_DIR, STATE_SECTIONS, DiskOffload  # noqa: F401 - DiskOffload: public here
from .host_memory import host_budget_shortfall
from .master_streamed import capacity_beside_held, held_free, streamed_choice
from .offload_plan import OffloadPlan

_C = load_extension()
_gib = format_bytes  # as the estimate's table prints bytes


def check_offload_args(offload_dir, host_memory_limit, where: str = "megatrain.wrap") -> Optional[str]:
    """Check ``offload_dir`` then ``host_memory_limit`` as ``wrap`` takes them; returns the absolute directory.

    Nothing is kept: ``offload_dir`` may be missing (it is made, with its files, when the engine is built) but its
    parent must exist and be writable (a probe file could be created and removed there), as must an existing one.

    Raises:
        ValueError: one line naming what is wrong.
    """
    path = _check_offload_dir(offload_dir, where)
    check_host_memory_limit(host_memory_limit, where)
    return path


def check_host_memory_limit(host_memory_limit, where: str = "megatrain.wrap") -> Optional[int]:
    """``host_memory_limit`` in bytes: None, or a number of bytes as :func:`~megatrain.byte_units.parse_bytes`
    reads it (an int > 0, or a string such as ``"100GiB"`` / ``"1.5TB"``; KiB..TiB powers of 1024, KB..TB of 1000).
    A count above ``MAX_BYTES`` (2**63 - 1; ``1e30``, ``float("inf")``) is no limit beyond the machine's: it reads
    as ``MAX_BYTES`` (the budget check's own limits still apply).

    Raises:
        ValueError: one line naming the value (a bool, a number <= 0, a string that is not a size).
    """
    if host_memory_limit is None:
        return None
    try:
        return parse_bytes(host_memory_limit, saturate=True)
    except ValueError:
        raise ValueError(f"{where}: host_memory_limit must be a number of bytes > 0 (an int, or a string such as "
                         f"'100GiB' or '1.5TB'), float('inf') / 'inf' for no limit, or None, got {host_memory_limit!r}") from None


def check_offload_dir_value(offload_dir, where: str = "megatrain.wrap") -> None:
    """``offload_dir`` is None or a non-empty path (``str`` / ``os.PathLike``); the filesystem is not looked at.

    Raises:
        ValueError: one line naming the value.
    """
    if offload_dir is not None and (not isinstance(offload_dir, (str, os.PathLike)) or not os.fspath(offload_dir)):
        raise ValueError(f"{where}: offload_dir must be a directory path, got {offload_dir!r}")


def _check_offload_dir(offload_dir, where: str) -> Optional[str]:
    check_offload_dir_value(offload_dir, where)
    if offload_dir is None:
        return None
    path = os.path.abspath(os.fspath(offload_dir))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{where}: offload_dir={path} exists and is not a directory; pass a directory on a local disk")
        if write_probe_error(path) is not None:
            raise ValueError(f"{where}: offload_dir={path} is not writable by this process; pass a directory it can "
                             "write (a local disk with room for the layers' fp32 state)")
        return path
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"{where}: the parent of offload_dir={path} does not exist ({parent}); create it or pass "
                         "another directory")
    if write_probe_error(parent) is not None:
        raise ValueError(f"{where}: offload_dir={path} cannot be created: {parent} is not writable by this process")
    return path


def state_layout(state_numel: int) -> List[int]:
    """Section byte sizes of one unit's file in the state tier: master, exp_avg, exp_avg_sq (fp32)."""
    return [4 * int(state_numel)] * len(STATE_SECTIONS)


def accum_layout(state_numel: int) -> List[int]:
    """Section byte sizes of one unit's file in the accumulator tier: grad_accum (fp32)."""
    return [4 * int(state_numel)]


def stale_tier_bytes(directory: str) -> int:
    """Disk bytes held by tier files of an earlier run in ``directory`` (removed when a tier opens there)."""
    total = 0
    for d in (directory, os.path.join(directory, ACCUM_DIR)):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for n in names:
            if n.startswith("megatrain_unit_") and n.endswith(".tier"):
                try:
                    total += os.stat(os.path.join(d, n)).st_blocks * 512
                except OSError:
                    pass
    return total


def free_bytes(directory: str) -> int:
    """Bytes the disk tier may use under ``directory``: the filesystem's free bytes (``_C.DiskTier.free_bytes``:
    statvfs, a missing directory is its nearest existing ancestor) plus the stale tier files it removes first."""
    return int(_C.DiskTier.free_bytes(directory)) + stale_tier_bytes(directory)


def _host_need(units, compute_dtype, accumulator_mode, staging_buffers, on_disk, num_buffers, cuda,
               with_accumulator, exclusive=(), streamed=()) -> dict:
    """Host bytes with the fp32 sections of the units flagged ``on_disk`` in the disk tier, the units ``exclusive``
    (indices) on the device only (one window's scratch buffer counted; no compute section unless a frozen entry
    keeps it), and the units ``streamed`` (neither on disk nor exclusive) master-streamed: no compute section."""
    from ..engine.units import plan_host_memory

    offloaded = list(on_disk)
    for k in exclusive:
        offloaded[k] = True
    absent = [False] * len(offloaded)
    for k in streamed:
        absent[k] = not offloaded[k]
    for k in exclusive:  # a frozen entry's only copy is its compute section: kept
        absent[k] = not any(e.frozen for e in units[k].entries)
    hp = plan_host_memory(units, compute_dtype, accumulator_mode, staging_buffers, offloaded, absent)
    numel = hp["layout"]["unit_state_numel"]
    disk = [k for k, o in enumerate(on_disk) if o]
    layouts = [state_layout(numel[k]) for k in disk]
    alayouts = [accum_layout(numel[k]) for k in disk]
    nb = min(num_buffers, len(disk))
    pool = _C.DiskTier.pool_bytes(layouts, nb) if disk else 0
    apool = _C.DiskTier.pool_bytes(alayouts, nb) if disk else 0
    scratch = max((scratch_bytes(numel[k]) for k in exclusive), default=0)
    host = hp["store_bytes"] + hp["staging_bytes"] + pool + scratch
    if with_accumulator:
        host += apool + (hp["accumulator_bytes"] if accumulator_mode is None else 0)
    return dict(host_plan=hp, disk=disk, layouts=layouts, alayouts=alayouts, pool=pool, apool=apool, host=host,
                pinned=hp["store_bytes"] + hp["staging_bytes"] if cuda else 0, nb=nb, exclusive=list(exclusive),
                offloaded=offloaded, scratch=scratch, absent=absent)


def _configs(layers, n_exclusive: int, n_cands: int) -> list:
    """``(exclusive unit indices, disk candidates taken)`` to try, in order of preference: everything in the
    host store; then the fp32 state of layer 0, of layers 0..1, ... (at most ``n_exclusive``) on the device
    only; then, with every one of those exclusive, the deepest layers on disk, one more each."""
    out = [([], 0)] + [(layers[:k], 0) for k in range(1, n_exclusive + 1)]
    return out + [(layers[:n_exclusive], n) for n in range(1, n_cands + 1)]


def plan_offload(units, compute_dtype: torch.dtype, accumulator_mode: Optional[bool], staging_buffers: int, *,
                 offload_dir: Optional[str], host_memory_limit: Optional[int], reclaimable_bytes: int = 0,
                 cuda: bool = False, keep_layers: int = 0, num_buffers: int = 2, with_accumulator: bool = False,
                 check: bool = True, where: str = "megatrain.wrap", limits: Optional[dict] = None,
                 exclusive_ok: bool = False, device_free: Optional[int] = None, num_slots: int = 2,
                 activation_reserve: Optional[int] = None, compute_copy="auto",
                 streamable: Optional[List[int]] = None, auto_placement: bool = True) -> OffloadPlan:
    """Choose the layers whose fp32 state goes to disk or stays on the device only, before anything is
    allocated or written.

    Order of preference: everything in the host store; the fewest of the layers on the device anyway (an explicit
    ``keep_layers`` K, or the ``"auto"`` share under ``device_free``) exclusive when that suffices; then
    (``compute_copy="auto"``) the fewest deepest ``streamable`` layers *master-streamed* (no compute section in the
    host store: the slot is filled from the fp32 master); then *exclusive* device-state layers (whole state on the
    device alone: the host store keeps only a frozen entry's compute copy; :mod:`.device_tier`), the fewest leading
    layers that make the host part fit: under ``device_free``, of those the ``"auto"`` share holds, and when that
    is too few, of those the *capacity share* holds (:func:`~.master_streamed.capacity_beside_held`: the free
    device bytes less the streamed schedule's minimum, an activation reserve and the held gradients of the layers
    still master-streamed; ``plan.exclusive_share`` says which); then, with ``offload_dir`` and every layer the
    device budget allows exclusive, the deepest layers' fp32 state on disk, as few as make it fit (never the
    resident unit, never layers ``0 .. keep_layers-1`` or an exclusive one). Other device-state layers keep their
    host sections (the planner may move them).

    Fitting: ``store + staging + the tiers' RAM pools + one exclusive unit's scratch [+ accumulators]``
    within ``host_memory_limit`` (if given) and the host budget check's limits (MemAvailable, cgroup,
    RLIMIT_MEMLOCK; the same rules as ``check_host_budget``, with ``reclaimable_bytes`` of credit).

    Args:
        units: the engine's units (:func:`~megatrain.runtime.model.decoder_layers.model_units`).
        accumulator_mode: the engine's (True: store section; None: auto; False: none).
        with_accumulator: count the gradient accumulator (always with ``accumulator_mode=True``).
        keep_layers: an explicit ``device_state_layers=K``: layers ``0 .. K-1`` never go to disk and, with
            ``exclusive_ok`` and no ``device_free``, may be exclusive.
        num_buffers: RAM buffers per tier (``Options.disk_buffers``).
        check: raise when it does not fit (False: return the plan of "every candidate exclusive / on disk",
            ``host_bytes`` / ``free_bytes`` / ``exclusive_needed`` for :func:`megatrain.estimate`).
        limits: the host limits to fit in (:func:`~.host_memory.host_memory_limits`' dict), judged even with
            ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1`` (``megatrain.estimate(host_memory=)``). None: this machine's.
        exclusive_ok: device-state layers may hold their fp32 state on the device only (not under data parallel).
        device_free: ``device_state_layers="auto"`` / ``"boundary"``: the free device bytes (capped by
            ``gpu_memory_limit``) in which the ``"auto"`` rule (:func:`~.device_state_plan.exclusive_room`)
            sizes how many leading layers may be exclusive, and in which the capacity share is taken when
            that is too few. None: ``keep_layers`` of them may.
        num_slots: the engine's device slots per layer shape (the streamed schedule's minimum).
        activation_reserve: device bytes the capacity share keeps for activations and logits (the estimate's,
            when the batch is known); None: ``CAPACITY_ACTIVATION_RESERVE_FRACTION`` of ``device_free``.
        compute_copy: ``wrap``'s ``host_compute_copy`` (``"auto"``, True, False; see :func:`~.master_streamed.streamed_choice`).
        streamable: the units that may be master-streamed (:func:`~.master_streamed.master_streamable`); None: none.
            A disk unit keeps its compute section; an exclusive one has none unless it has a frozen entry.
        auto_placement: ``device_free`` is ``device_state_layers="auto"``'s: its share's layers are on the device
            anyway (False, ``"boundary"``: they are not, and are not tried before master-streaming).

    Raises:
        HostMemoryError: the host part does not fit even with every candidate layer exclusive / on disk, or
            ``host_memory_limit`` is exceeded without ``offload_dir`` (one line, bytes needed vs limit, and
            how many layers would have to be exclusive).
        DiskSpaceError: ``offload_dir``'s filesystem has less free space than the files need.
    """
    with_accumulator = with_accumulator or accumulator_mode is True
    n_units = len(units)
    layers = [u.index for u in units if u.kind == "layer"]
    given_limits = limits is not None

    def fits(need) -> bool:
        nonlocal limits
        if host_memory_limit is not None and need["host"] > host_memory_limit:
            return False
        if limits is None:
            from .host_memory import host_memory_limits
            limits = host_memory_limits()
        return host_budget_shortfall(need["host"], need["pinned"], reclaimable_bytes, limits,
                                     honour_skip=not given_limits) is None

    def need_of(excl, n, cands=(), streamed=None):
        off = [False] * n_units
        for k in cands[:n]:
            off[k] = True
        return _host_need(units, compute_dtype, accumulator_mode, staging_buffers, off, num_buffers, cuda,
                          with_accumulator, excl, chosen_streamed if streamed is None else streamed)

    grad = True if with_accumulator else None  # summed gradients: each exclusive layer's fp32 accumulator too
    on_device = keep_layers if device_free is None or not exclusive_ok else 0 if not auto_placement else _exclusive_max(
        units, need_of([], 0, streamed=[]), compute_dtype, keep_layers, device_free, grad)[0]  # the speed placement's
    if compute_copy == "auto" and exclusive_ok and any(
            fits(need_of(layers[:j], 0, streamed=[])) for j in range(1, min(on_device, len(layers)) + 1)):
        compute_copy = True  # layers on the device anyway (K, or the auto share): exclusive costs no device memory
    chosen_streamed: List[int] = streamed_choice(compute_copy, streamable or [], fits, need_of)
    need = need_of([], 0)
    held = [] if with_accumulator else chosen_streamed  # summed gradients go to the host accumulator: none held
    dev_free = held_free(device_free, need["host_plan"]["layout"], held, compute_dtype)
    n_excl, budget = (0, None) if fits(need) or not exclusive_ok else _exclusive_max(
        units, need, compute_dtype, keep_layers, dev_free, grad)
    n_auto, capacity = n_excl, None
    if exclusive_ok and dev_free is not None and n_excl < len(layers) and not fits(need_of(layers[:n_excl], 0)):
        capacity = capacity_beside_held(units, need["host_plan"]["layout"], compute_dtype, device_free,
                                        held, layers, num_slots, activation_reserve, grad)
        n_excl = max(n_excl, capacity["layers"])
    cands = list(reversed(layers[max(keep_layers, n_excl):])) if offload_dir is not None else []  # deepest first
    chosen = need if fits(need) else None
    for excl, n in ([] if chosen is not None else _configs(layers, n_excl, len(cands))[1:]):
        need = need_of(excl, n, cands)
        if fits(need):
            chosen = need
            break
    plan = _plan_of(chosen if chosen is not None else need, offload_dir, host_memory_limit, with_accumulator)
    plan.exclusive_max, plan.device_budget_bytes, plan.capacity = n_auto, budget, capacity
    k = len(plan.exclusive_units)
    plan.exclusive_share = None if not k else "explicit" if device_free is None else "auto" if k <= n_auto else "capacity"
    if offload_dir is not None:
        plan.free_bytes = free_bytes(offload_dir)
    if chosen is None and offload_dir is None and exclusive_ok:  # how many exclusive layers would fit
        plan.exclusive_needed = next((k for k in range(n_excl + 1, len(layers) + 1) if fits(need_of(layers[:k], 0))),
                                     None)
        if plan.exclusive_needed is None and len(layers) > n_excl:
            plan.all_exclusive_bytes = need_of(layers, 0)["host"]
    if chosen is None and offload_dir is None:  # would the disk tier help: every candidate layer's fp32 state there
        rest = list(reversed(layers[max(keep_layers, n_excl):]))
        plan.disk_would_fit = fits(need_of(layers[:n_excl], len(rest), rest))
    if not check:
        return plan
    if chosen is None:
        _raise_host(plan, host_memory_limit, offload_dir, len(cands), reclaimable_bytes, where, keep_layers,
                    device_free is not None)
    if plan.disk_units and plan.disk_total_bytes > plan.free_bytes:
        _raise_disk_space(plan, offload_dir, where)
    return plan


def _exclusive_max(units, need: dict, compute_dtype, keep_layers: int, device_free: Optional[int], grad=None) -> tuple:
    """``(how many leading layers may be exclusive, the device bytes that rule allows or None)``."""
    if device_free is None:
        return keep_layers, None
    from .device_state_plan import exclusive_room

    return exclusive_room(units, need["host_plan"]["layout"], compute_dtype, device_free, with_grad=grad)


def _plan_of(need: dict, offload_dir, host_memory_limit, with_accumulator: bool) -> OffloadPlan:
    """The :class:`OffloadPlan` of one :func:`_host_need` answer."""
    disk = need["disk"]
    return OffloadPlan(offload_dir=offload_dir, host_memory_limit=host_memory_limit, num_buffers=need["nb"],
                       disk_units=disk, offloaded=need["offloaded"], host_plan=need["host_plan"],
                       compute_absent=need["absent"],
                       master_streamed=[k for k, a in enumerate(need["absent"]) if a and k not in need["exclusive"]],
                       exclusive_units=need["exclusive"], scratch_bytes=need["scratch"],
                       state_layouts=need["layouts"], accum_layouts=need["alayouts"],
                       disk_bytes=_C.DiskTier.bytes_required(need["layouts"]) if disk else 0,
                       accum_disk_bytes=_C.DiskTier.bytes_required(need["alayouts"]) if disk else 0,
                       pool_bytes=need["pool"], accum_pool_bytes=need["apool"] if with_accumulator else 0,
                       host_bytes=need["host"], pinned_bytes=need["pinned"], with_accumulator=with_accumulator)


def _no_dir_message(plan: OffloadPlan, need: int, avail, name: str, where: str, auto: bool) -> str:
    """The one-line refusal without ``offload_dir``: the host need, how many layers would have to keep their
    fp32 state on the device only, what the device budget holds, and which option to change."""
    k, fewest = len(plan.exclusive_units), plan.exclusive_needed
    setting = "device_state_layers='auto'" if auto else f"device_state_layers={k}"
    held = (f" with the fp32 state of layers 0..{k - 1} on the device only ({setting})" if k else "")
    msg = f"{where}: the host store and its staging buffers need {need} bytes ({_gib(need)}){held} but the {name} allows {avail} bytes ({_gib(avail)}); "
    if auto:
        budget = plan.device_budget_bytes or 0
        msg += (f"the device budget ({_gib(budget)}: device_state_layers='auto''s share of the free device memory, "
                "capped by gpu_memory_limit) holds "
                f"the whole state of {plan.exclusive_max} decoder layers, " + capacity_words(plan.capacity))
        msg += (f"but the fp32 state of {fewest} layers (0..{fewest - 1}) would have to live on the device only; "
                "raise gpu_memory_limit or free device memory, " if fewest else
                f"and even with every decoder layer's fp32 state on the device only the host needs "
                f"{plan.all_exclusive_bytes} bytes ({_gib(plan.all_exclusive_bytes)}); " if plan.all_exclusive_bytes
                else "")
    else:
        msg += (f"wrap with device_state_layers={fewest} (the fp32 state of layers 0..{fewest - 1} then lives on "
                "the device only), " if fewest else "")
        msg += (f"even with every decoder layer's fp32 state on the device only it needs {plan.all_exclusive_bytes} "
                f"bytes ({_gib(plan.all_exclusive_bytes)}); " if plan.all_exclusive_bytes else "")
    if plan.disk_would_fit is False:
        return msg + ("raise host_memory_limit (offload_dir cannot help: with every layer's fp32 state on disk, the "
                      "compute copies, the resident unit's state and the gradient staging still exceed it). Nothing "
                      "was allocated.")
    return msg + ("pass offload_dir=<a directory on a local disk> to keep the fp32 state of the layers that do not "
                  "fit there, or raise host_memory_limit. Nothing was allocated.")


def _raise_disk_space(plan: OffloadPlan, offload_dir: str, where: str) -> None:
    """Raise ``DiskSpaceError`` (errno ENOSPC, ``needed_bytes`` / ``free_bytes``): the disk tier's files do not fit."""
    need_b = plan.disk_total_bytes
    msg = (f"{where}: the fp32 state of {len(plan.disk_units)} decoder layers on disk needs {need_b} bytes "
           f"({_gib(need_b)}) under offload_dir={offload_dir}, but its filesystem has {plan.free_bytes} bytes "
           f"({_gib(plan.free_bytes)}) free; free space there, point offload_dir at a larger disk, or raise "
           "host_memory_limit. Nothing was written.")
    err = _C.DiskSpaceError(msg)
    err.errno = errno.ENOSPC
    err.needed_bytes = int(need_b)
    err.free_bytes = int(plan.free_bytes)
    raise err


def _raise_host(plan: OffloadPlan, limit, offload_dir, n_cands: int, credit: int, where: str, keep_layers: int = 0,
                auto: bool = False):
    need = plan.host_bytes
    if limit is not None and need > limit:
        avail, name = limit, "host_memory_limit"
    else:
        short = host_budget_shortfall(need, plan.pinned_bytes, credit)
        avail, name = (short["available_bytes"] + short.get("credit_bytes", 0), short["limit"]) if short else (limit, "?")
    if offload_dir is None:
        msg = _no_dir_message(plan, need, avail, name, where, auto)
    else:
        hp = plan.host_plan
        k = len(plan.exclusive_units)
        msg = (f"{where}: even with the fp32 state of {n_cands} decoder layers on disk"
               + (f" and of layers 0..{k - 1} on the device only (device_state_layers={k})" if k else "")
               + f", the host part needs {need} "
               f"bytes ({_gib(need)}: store {_gib(hp['store_bytes'])} with every compute copy and the resident "
               f"unit's state, disk buffers {_gib(plan.pool_bytes + plan.accum_pool_bytes)}, gradient staging "
               f"{_gib(hp['staging_bytes'])}) but the {name} allows {avail} bytes ({_gib(avail)}); raise "
               "host_memory_limit, free host memory, or train a smaller model"
               + (f" (layers 0..{keep_layers - 1} never go to disk: device_state_layers={keep_layers}; lower it)"
                  if keep_layers and not plan.exclusive_units else "") + ". Nothing was allocated.")
    e = _C.HostMemoryError(msg)
    e.needed_bytes, e.available_bytes, e.limit = int(need), int(avail or 0), name
    raise e
