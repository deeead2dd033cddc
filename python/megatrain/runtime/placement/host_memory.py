"""The host-memory budget check, as the engine runs it: the C++ rules (``host_memory.cpp``) on the
limits of this process, with the credit of memory freed while the store is filled.

The limits are read by the C++ side (``_C.memory_available``) and the rules are the C++
``host_budget_shortfall``; the C++ allocations (``HostStore``, ``pinned_empty``) run the same
check themselves unless told that the caller already did (``check_budget=False``): the engine
checks the store and its staging pool once, here, with a credit they do not know of (the model's
own weights, freed layer by layer during the fill), and constructs them with ``check_budget=False``.
"""

from __future__ import annotations

import weakref
from typing import Optional

from ..._loader import load_extension
from ..options import options


# wrapped models' engines with a host store (weak): a refusal names what the others still hold
LIVE_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def _others_hint() -> str:
    """What other wrapped models of this process still hold ('' when none): ``wrap`` has run the cyclic
    collector by then, so each is still referenced (a notebook cell run again: the old ``model`` is bound
    while the new one is wrapped)."""
    held = [int(e.store.total_bytes) for e in list(LIVE_ENGINES) if getattr(e, "store", None) is not None]
    if not held:
        return ""
    return (f" {len(held)} other wrapped model(s) of this process still hold {sum(held) / 2**30:.2f} GiB of host "
            "store (a notebook cell run again keeps the old model while the new one is wrapped): del model, opt and "
            "gc.collect() first.")


def host_memory_limits() -> dict:
    """Limits that bound a new host allocation, in bytes (None: no limit found), read by the C++ side.

    Returns:
        ``mem_available_bytes`` (/proc/meminfo MemAvailable), ``cgroup_limit_bytes`` and
        ``cgroup_usage_bytes`` (tightest cgroup v2 ``memory.max`` on the way to the root, or the
        v1 ``memory.limit_in_bytes``), ``cgroup_path`` (the file it was read from),
        ``memlock_bytes`` (RLIMIT_MEMLOCK soft limit).
    """
    m = load_extension().memory_available()
    return dict(mem_available_bytes=m["mem_available_bytes"] if m["mem_available_bytes"] >= 0 else None,
                cgroup_limit_bytes=m["cgroup_limit_bytes"], cgroup_usage_bytes=m["cgroup_usage_bytes"],
                memlock_bytes=m["memlock_bytes"], cgroup_path=m["cgroup_path"])


def host_budget_shortfall(needed_bytes: int, pinned_bytes: int, reclaimable_bytes: int = 0,
                          limits: Optional[dict] = None, honour_skip: bool = True) -> Optional[dict]:
    """The first host limit ``needed_bytes`` (of which ``pinned_bytes`` page-locked) would exceed, or None.

    The rules of :func:`check_host_budget` (which raises on the result), without raising:
    MemAvailable, then the cgroup limit minus its usage (both plus ``reclaimable_bytes``), then
    RLIMIT_MEMLOCK for ``pinned_bytes`` (the C++ ``host_budget_shortfall``). None also when
    ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1``.

    Args:
        limits: :func:`host_memory_limits` (read now when None).
        honour_skip: False: judge ``limits`` even with ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1`` (limits
            given for another machine, not read from this one).

    Returns:
        None, or a dict: ``available_bytes`` (under that limit, without the credit), ``limit``
        (its name), ``kind`` ("memory" or "memlock"), ``advice`` (what to change), ``credit_bytes``.
    """
    if honour_skip and options().skip_host_memory_check:
        return None
    lim = host_memory_limits() if limits is None else limits
    return load_extension().host_budget_shortfall(int(needed_bytes), int(pinned_bytes), int(reclaimable_bytes), lim)


def check_host_budget(needed_bytes: int, pinned_bytes: int, what: str, reclaimable_bytes: int = 0,
                      new_store: bool = False) -> None:
    """Raise ``HostMemoryError`` if ``needed_bytes`` (of which ``pinned_bytes`` page-locked) cannot fit.

    ``reclaimable_bytes``: memory the caller frees while the new allocation is filled (a model's
    own parameters, released layer by layer as they are copied into the store); it counts as
    available for the MemAvailable and cgroup limits, not for the locked-memory limit.
    ``new_store``: the check of a new model's store (at wrap): a refusal also names what the other
    wrapped models of the process still hold.

    Skipped when ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1`` (VMs that grow their RAM lazily report
    too little MemAvailable). The rules are :func:`host_budget_shortfall`'s.

    Raises:
        megatrain._C.HostMemoryError: names bytes needed vs available, the limit, and what to change
            (attributes ``needed_bytes``, ``available_bytes``, ``limit``).
    """
    if options().skip_host_memory_check:
        return
    ext = load_extension()
    try:
        ext.check_host_budget(int(needed_bytes), int(pinned_bytes), what, int(reclaimable_bytes), host_memory_limits())
    except ext.HostMemoryError as exc:
        hint = _others_hint() if new_store else ""
        if not hint:
            raise
        new = ext.HostMemoryError(str(exc) + hint)
        for name in ("needed_bytes", "available_bytes", "limit"):
            setattr(new, name, getattr(exc, name, None))
        raise new from None

