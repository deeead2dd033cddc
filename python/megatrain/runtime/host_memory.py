"""Host-memory budget check done in Python before the C++ store allocates.

The C++ store runs the same check (``HostStore``, ``pinned_empty``), but on the H200 test machine
(torch 2.11, g++ 13 build) its limit query crashed the process (issue note, 2026-11-29). Until that
is understood, the engine checks here first, with the same rules, and asks the C++ side to skip.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Optional

from .._loader import load_extension
from .options import ENV, options

_ENV = ENV["skip_host_memory_check"]


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.readline().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def host_memory_limits() -> dict:
    """Limits that bound a new host allocation, in bytes (None: no limit found).

    Returns:
        ``mem_available_bytes`` (/proc/meminfo MemAvailable), ``cgroup_limit_bytes`` and
        ``cgroup_usage_bytes`` (tightest cgroup v2 ``memory.max`` on the way to the root, or the
        v1 ``memory.limit_in_bytes``), ``memlock_bytes`` (RLIMIT_MEMLOCK soft limit).
    """
    out = dict(mem_available_bytes=None, cgroup_limit_bytes=None, cgroup_usage_bytes=None, memlock_bytes=None,
               cgroup_path=None)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out["mem_available_bytes"] = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    rel = "/"
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        for line in lines:
            if line.startswith("0::"):
                rel = line[3:] or "/"
        best = None
        while True:
            d = "/sys/fs/cgroup" + ("" if rel == "/" else rel)
            limit = _read_int(d + "/memory.max")
            if limit is not None:
                usage = _read_int(d + "/memory.current") or 0
                if best is None or limit - usage < best[0] - best[1]:
                    best = (limit, usage, d + "/memory.max")
            if rel in ("/", ""):
                break
            rel = os.path.dirname(rel.rstrip("/")) or "/"
        if best is not None:
            out.update(cgroup_limit_bytes=best[0], cgroup_usage_bytes=best[1], cgroup_path=best[2])
    else:
        limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")
        if limit is not None and limit < (1 << 60):
            out.update(cgroup_limit_bytes=limit,
                       cgroup_usage_bytes=_read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0,
                       cgroup_path="/sys/fs/cgroup/memory/memory.limit_in_bytes")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY:
        out["memlock_bytes"] = int(soft)
    return out


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def host_budget_shortfall(needed_bytes: int, pinned_bytes: int, reclaimable_bytes: int = 0,
                          limits: Optional[dict] = None) -> Optional[dict]:
    """The first host limit ``needed_bytes`` (of which ``pinned_bytes`` page-locked) would exceed, or None.

    The rules of :func:`check_host_budget` (which raises on the result), without raising:
    MemAvailable, then the cgroup limit minus its usage (both plus ``reclaimable_bytes``), then
    RLIMIT_MEMLOCK for ``pinned_bytes``. None also when ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1``.

    Args:
        limits: :func:`host_memory_limits` (read now when None).

    Returns:
        None, or a dict: ``available_bytes`` (under that limit, without the credit), ``limit``
        (its name), ``kind`` ("memory" or "memlock"), ``advice`` (what to change), ``credit_bytes``.
    """
    if options().skip_host_memory_check:
        return None
    lim = host_memory_limits() if limits is None else limits
    credit = max(0, int(reclaimable_bytes))
    freed = (f" (plus {credit} bytes ({_gib(credit)}) of the model's own weights, freed while the store is filled)"
             if credit else "")
    if lim["mem_available_bytes"] is not None and needed_bytes > lim["mem_available_bytes"] + credit:
        return dict(available_bytes=lim["mem_available_bytes"], limit="MemAvailable limit (/proc/meminfo)" + freed,
                    kind="memory", credit_bytes=credit,
                    advice="Free host memory or train a smaller model; if this VM grows its RAM lazily, set "
                           f"{_ENV}=1.")
    if lim["cgroup_limit_bytes"] is not None:
        remaining = lim["cgroup_limit_bytes"] - (lim["cgroup_usage_bytes"] or 0)
        if needed_bytes > remaining + credit:
            return dict(available_bytes=remaining, kind="memory", credit_bytes=credit,
                        limit=f"cgroup memory limit ({lim['cgroup_path']}, minus current usage)" + freed,
                        advice="Raise the container's memory limit or train a smaller model.")
    if pinned_bytes and lim["memlock_bytes"] is not None and pinned_bytes > lim["memlock_bytes"]:
        return dict(available_bytes=lim["memlock_bytes"], limit="locked-memory limit (RLIMIT_MEMLOCK, ulimit -l)",
                    kind="memlock", credit_bytes=0, advice="Raise it (ulimit -l unlimited, docker --ulimit memlock=-1).")
    return None


def check_host_budget(needed_bytes: int, pinned_bytes: int, what: str, reclaimable_bytes: int = 0) -> None:
    """Raise ``HostMemoryError`` if ``needed_bytes`` (of which ``pinned_bytes`` page-locked) cannot fit.

    ``reclaimable_bytes``: memory the caller frees while the new allocation is filled (a model's
    own parameters, released layer by layer as they are copied into the store); it counts as
    available for the MemAvailable and cgroup limits, not for the locked-memory limit.

    Skipped when ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1`` (VMs that grow their RAM lazily report
    too little MemAvailable). The rules are :func:`host_budget_shortfall`'s.

    Raises:
        megatrain._C.HostMemoryError: names bytes needed vs available, the limit, and what to change.
    """
    short = host_budget_shortfall(needed_bytes, pinned_bytes, reclaimable_bytes)
    if short is None:
        return
    available, limit = short["available_bytes"], short["limit"]
    err = load_extension().HostMemoryError(
        f"megatrain {what}: needs {needed_bytes} bytes ({_gib(needed_bytes)}) of host memory but only "
        f"{available} bytes ({_gib(available)}) are available under the {limit}. {short['advice']} Nothing was "
        "allocated.")
    err.needed_bytes, err.available_bytes, err.limit = needed_bytes, available, limit
    raise err


@contextlib.contextmanager
def checked_in_python():
    """Within this block the C++ allocations skip their own (already done) budget check."""
    old = os.environ.get(_ENV)
    os.environ[_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = old
