"""Run-time switches of megatrain: the one reader of the ``MEGATRAIN_*`` environment variables.

:func:`options` returns the :class:`Options` in force: those given to :func:`set_options` (a
benchmark's "before" configuration), else the environment read at the call. An
:class:`~megatrain.runtime.engine.core.Engine` reads them once, when ``wrap`` builds it, and keeps them
as ``engine.options``. The C++ core reads its own switches (``MEGATRAIN_HUGEPAGES``,
``MEGATRAIN_CPU_ISA``, ...; see ``csrc/megatrain/common/tuning.h``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

# Environment variable of each field read from the environment (the benchmark switches have none).
ENV = {
    "pin_after_fill": "MEGATRAIN_PIN_AFTER_FILL",
    "debug_races": "MEGATRAIN_DEBUG_RACES",
    "adam_threads": "MEGATRAIN_ADAM_THREADS",
    "device_adam": "MEGATRAIN_DEVICE_ADAM",
    "skip_host_memory_check": "MEGATRAIN_SKIP_HOST_MEMORY_CHECK",
    "data_parallel": "MEGATRAIN_DATA_PARALLEL",
    "dp_timeout_s": "MEGATRAIN_DP_TIMEOUT",
    "disk_buffers": "MEGATRAIN_DISK_BUFFERS",
    "disk_io_threads": "MEGATRAIN_DISK_IO_THREADS",
    "worker_timeline": "MEGATRAIN_WORKER_TIMELINE",
}


@dataclass(frozen=True)
class Options:
    """The switches an engine runs with (defaults: the production configuration).

    Attributes:
        pin_after_fill: ``MEGATRAIN_PIN_AFTER_FILL`` (default 1). True: the host store is
            page-locked after it is filled (the model's own weights, freed meanwhile, count as
            available to the budget check); ``0``: when it is mapped (every page faulted in before
            the fill; ``benchmarks/bench_load.py`` measures both).
        debug_races: ``MEGATRAIN_DEBUG_RACES=1``: sleep ~1 ms on the copy streams before each
            copy and fill released device slots with NaN (race hunting; parity must still hold).
        adam_threads: ``MEGATRAIN_ADAM_THREADS=N``: intra-op threads of the CPU worker's kernels
            (None: torch's default), e.g. cores - 1 so the thread launching GPU work is never starved.
        device_adam: ``MEGATRAIN_DEVICE_ADAM``: the AdamW of device-state layers, ``"fused"``
            (``torch._fused_adamw_``), ``"foreach"``, or ``""`` (fused on CUDA, foreach elsewhere).
        skip_host_memory_check: ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1``: no host budget check
            (VMs that grow their RAM lazily report too little MemAvailable).
        data_parallel: ``MEGATRAIN_DATA_PARALLEL=0``: a wrap inside an initialised process group of
            more than one rank stays single-process (default 1: data parallel; docs/data_parallel.md).
        dp_timeout_s: ``MEGATRAIN_DP_TIMEOUT`` (seconds, default 50, so that a stuck job ends within a
            minute): how long a data-parallel rank waits for a live peer, for its update of a unit or
            for it to make the same collective call (``save_checkpoint``, ``load_state_dict``, ...),
            before it gives up with an error (a dead or diverged peer is seen at once).
        overlap: benchmark "before" switch (no environment variable). False: updates run in
            submission order and ``step()`` waits for all of them, so no update overlaps the next forward.
        d2h_overlap: benchmark "before" switch. False: the compute stream waits for each unit's
            gradient D2H before the next layer's backward, so copies never run under compute.
        eager_updates: benchmark "before" switch. False: no update starts during backward; all
            are queued by ``step()`` (as with clipping), so CPU Adam overlaps only the next forward.
        fused_grad_norms: benchmark "before" switch. True: the squared norms of a layer's gradients
            on a CUDA device are one ``torch._foreach_norm`` launch; False: one
            ``torch.linalg.vector_norm`` launch per tensor. The CPU path is per tensor either way.
        cpp_slots: benchmark "before" switch. True: the slot pool, its H2D copies and events, and
            the gradient D2H copies are the C++ scheduler's (``megatrain._C.SlotPool``,
            ``_C.copy_to_host``); False: the same in Python on torch streams and events.
        replan: benchmark "before" switch (no environment variable). False: the placement planner
            does not place again after the first step (``megatrain.runtime.placement.replan``).
        disk_buffers: ``MEGATRAIN_DISK_BUFFERS`` (default 2, at least 2): RAM buffers of the disk
            tier's pool (``wrap(offload_dir=...)``), each the fp32 state of the largest layer on disk:
            one is updated while the next is read ahead or the last is written behind.
        disk_io_threads: ``MEGATRAIN_DISK_IO_THREADS`` (default 4): pread / pwrite threads of the disk tier.
        worker_timeline: ``MEGATRAIN_WORKER_TIMELINE=1`` (default off): record a per-step timeline of the
            CPU worker's update / gradient tasks and of the main thread's waits for them
            (``model.megatrain.worker_timeline()``, :mod:`megatrain.runtime.engine.timeline`); a few clock
            reads and list appends per task. ``set_worker_timeline`` switches it on a built engine.
        disk_fault: tests only (no environment variable): ``(op, unit, errno, after)`` injected
            into the disk tier's I/O (``_C.DiskTier(_fault=...)``): every ``op`` ("read" / "write")
            chunk of tier unit ``unit`` (-1: any) after the first ``after`` fails with ``errno``.
    """

    pin_after_fill: bool = True
    debug_races: bool = False
    adam_threads: Optional[int] = None
    device_adam: str = ""
    skip_host_memory_check: bool = False
    data_parallel: bool = True
    dp_timeout_s: float = 50.0
    overlap: bool = True
    d2h_overlap: bool = True
    eager_updates: bool = True
    fused_grad_norms: bool = True
    cpp_slots: bool = True
    replan: bool = True
    disk_buffers: int = 2
    disk_io_threads: int = 4
    worker_timeline: bool = False
    disk_fault: Optional[tuple] = None

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Options":
        """The options the environment sets (``os.environ`` when ``environ`` is None); unset: the defaults.

        Raises:
            ValueError: ``MEGATRAIN_ADAM_THREADS``, ``MEGATRAIN_DISK_BUFFERS`` or ``MEGATRAIN_DISK_IO_THREADS``
                is not an integer or ``MEGATRAIN_DP_TIMEOUT`` not a number.
        """
        env = os.environ if environ is None else environ
        threads = env.get(ENV["adam_threads"], "")
        disk_buffers = env.get(ENV["disk_buffers"], "").strip()
        disk_threads = env.get(ENV["disk_io_threads"], "").strip()
        return cls(
            pin_after_fill=env.get(ENV["pin_after_fill"], "1") != "0",
            debug_races=env.get(ENV["debug_races"], "0") not in ("", "0"),
            adam_threads=max(1, int(threads)) if threads.strip() else None,
            device_adam=env.get(ENV["device_adam"], ""),
            skip_host_memory_check=env.get(ENV["skip_host_memory_check"]) == "1",
            data_parallel=env.get(ENV["data_parallel"], "1") != "0",
            dp_timeout_s=float(env.get(ENV["dp_timeout_s"], "") or 50.0),
            disk_buffers=max(2, int(disk_buffers)) if disk_buffers else 2,
            disk_io_threads=max(1, int(disk_threads)) if disk_threads else 4,
            worker_timeline=env.get(ENV["worker_timeline"], "0") not in ("", "0"),
        )


_set: Optional[Options] = None


def options() -> Options:
    """The options in force now: :func:`set_options`'s, else :meth:`Options.from_env`."""
    return _set if _set is not None else Options.from_env()


def set_options(opts: Optional[Options] = None, **changes) -> Options:
    """Fix the options of the engines built from now on (benchmarks, tests); returns them.

    ``opts`` (default: the environment's) with the fields in ``changes`` replaced.
    ``set_options(None)`` with no ``changes`` is not a reset: use :func:`reset_options`.

    Raises:
        TypeError: a name in ``changes`` is not a field of :class:`Options`.
    """
    global _set
    _set = dataclasses.replace(opts if opts is not None else Options.from_env(), **changes)
    return _set


def reset_options() -> None:
    """Read the options from the environment again (undo :func:`set_options`)."""
    global _set
    _set = None


@contextlib.contextmanager
def options_set(**changes) -> Iterator[Options]:
    """``with options_set(overlap=False): ...``: :func:`set_options` inside the block only."""
    global _set
    old = _set
    try:
        yield set_options(old, **changes)
    finally:
        _set = old
