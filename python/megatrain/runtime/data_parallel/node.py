"""The node's shared memory: the host store's arena, the control block, and the wait for the peers' updates.

Local rank 0 creates each shared object as a ``memfd`` (anonymous shared memory, freed when the
last process unmaps it) and the node's other ranks open it through ``/proc/<pid>/fd/<n>``. The
control block holds, per local rank, its pid and one update counter per unit; a load of a unit
waits until every local rank's counter reached the number of update tasks this rank queued.
"""

from __future__ import annotations

import mmap
import os
import time

import torch

from ..._loader import load_extension
from .calls import MSG_BYTES
from .errors import ENV_TIMEOUT, DataParallelError, _alive

_C = load_extension()


class SharedNode:
    """Mixed into :class:`~.group.DataParallel`: the node's shared store, control block and update counters."""

    def _share(self, nbytes: int, name: str) -> int:
        """A file descriptor of one ``nbytes`` memfd shared by the node's ranks (local rank 0 creates it)."""
        fd = -1
        err = None
        if self.local_rank == 0:
            try:
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                os.ftruncate(fd, nbytes)
            except OSError as e:
                err = f"local rank 0 could not create {nbytes} bytes of shared memory: {e}"
        where = self.all_gather_object((os.getpid(), fd, err), f"sharing the {name}")
        node0 = self.node * self.local_world
        pid, fd0, err0 = where[node0]
        if err0:
            raise DataParallelError(f"megatrain data parallel: {err0}")
        if self.local_rank != 0:
            try:
                fd = os.open(f"/proc/{pid}/fd/{fd0}", os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                err = (f"rank {self.rank} could not open local rank 0's shared {name} (/proc/{pid}/fd/{fd0}: {e}); "
                       "every rank of a node must run as the same user in the same container")
        errs = [e for _, _, e in self.all_gather_object((os.getpid(), fd, err), f"attaching the {name}") if e]
        if errs:
            if fd >= 0:
                os.close(fd)
            raise DataParallelError("megatrain data parallel: " + errs[0])
        return fd

    def create_store(self, tables, compute_dtype, with_grad_accum: bool, pin: bool, frozen, total_bytes: int):
        """The node's shared ``HostStore`` (every local rank maps the same pages); collective."""
        page = mmap.PAGESIZE
        fd = self._share(max(page, -(-int(total_bytes) // page) * page), "megatrain host store")
        try:
            # the engine checked the budget (with its credit) before any rank got here
            store = _C.HostStore(tables, compute_dtype, with_grad_accum, pin, frozen=frozen, shared_fd=fd,
                                 check_budget=False)
        finally:
            os.close(fd)
        self.barrier("mapping the shared host store")  # local rank 0's descriptor was open until every rank mapped
        return store

    def init_control(self, n_units: int) -> None:
        """The shared control block; collective.

        Per local rank one row of int64: its pid, its state word (:mod:`.calls`), one update
        counter per unit, and room for the fatal error message it posts (``MSG_BYTES``).
        """
        width = 2 + n_units + MSG_BYTES // 8
        n = self.local_world * width
        fd = self._share(8 * n, "megatrain control block")
        try:
            self._ctl_map = mmap.mmap(fd, 8 * n)
        finally:
            os.close(fd)
        ctl = torch.frombuffer(self._ctl_map, dtype=torch.int64).view(self.local_world, width)
        self.pids = ctl[:, 0]
        self.states = ctl[:, 1]
        self.counters = ctl[:, 2:2 + n_units]
        self.messages = ctl[:, 2 + n_units:]
        self.pids[self.local_rank] = os.getpid()
        self.gen = [0] * n_units
        self._ctl = ctl
        self.barrier("starting data parallel")

    def bump(self, unit_index: int) -> None:
        """Worker: one more update task of ``unit_index`` ran on this rank."""
        self.counters[self.local_rank, unit_index] += 1

    def wait_peers(self, unit_index: int) -> None:
        """Block until every local rank ran as many update tasks of ``unit_index`` as this rank queued.

        Raises:
            DataParallelError: a peer's process is gone, or ``MEGATRAIN_DP_TIMEOUT`` seconds passed.
        """
        want = self.gen[unit_index]
        col = self.counters[:, unit_index]
        others = [r for r in range(self.local_world) if r != self.local_rank]
        if all(int(col[r]) >= want for r in others):
            return
        t0 = time.monotonic()
        last_check = t0
        delay = 1e-5
        while True:
            late = [r for r in others if int(col[r]) < want]
            if not late:
                return
            now = time.monotonic()
            if now - last_check > 0.5:
                last_check = now
                dead = [r for r in late if not _alive(int(self.pids[r]))]
                if dead:
                    raise DataParallelError(
                        f"megatrain data parallel (rank {self.rank}): local rank {dead[0]} (pid {int(self.pids[dead[0]])}) "
                        f"exited before finishing its update of unit {unit_index}; the job cannot continue: restart "
                        "it from the last checkpoint")
                if now - t0 > self.timeout_s:
                    raise DataParallelError(
                        f"megatrain data parallel (rank {self.rank}): local rank {late[0]} did not finish its update "
                        f"of unit {unit_index} within {ENV_TIMEOUT}={self.timeout_s:g} s; the job cannot continue")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

