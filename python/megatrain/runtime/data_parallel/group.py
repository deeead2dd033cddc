"""``DataParallel``: the ranks of a data parallel engine, their pieces of each entry, and the collectives between them."""

from __future__ import annotations

import os
from typing import List, Optional

import torch

from ..options import options
from .buffers import PieceBuffers
from .calls import CollectiveCalls
from .errors import DataParallelError, _dist, attempt
from .node import SharedNode


class DataParallel(CollectiveCalls, SharedNode, PieceBuffers):
    """Ranks, pieces, collectives and the shared control block of a data parallel engine.

    Args:
        device: the engine's compute device (collectives run on it: NCCL needs CUDA tensors).

    Raises:
        ValueError: the ranks are not laid out node by node (``RANK // LOCAL_WORLD_SIZE`` is the
            node), or the backend does not fit the device (CUDA needs NCCL, CPU needs gloo).
    """

    def __init__(self, device: torch.device):
        dist = _dist()
        self.device = device
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank % self.local_world))
        if self.local_world < 1 or self.world % self.local_world or self.rank % self.local_world != self.local_rank:
            raise ValueError(f"megatrain data parallel: RANK={self.rank}, WORLD_SIZE={self.world}, LOCAL_RANK="
                             f"{self.local_rank}, LOCAL_WORLD_SIZE={self.local_world}: expected the same number of "
                             "ranks on every node, numbered node by node (as torchrun does)")
        self.node = self.rank // self.local_world
        self.nodes = self.world // self.local_world
        backend = str(dist.get_backend()).lower()
        if device.type == "cuda" and "nccl" not in backend:
            raise ValueError(f"megatrain data parallel: the process group's backend is {backend!r} but the model "
                             "trains on CUDA; init_process_group('nccl')")
        if device.type == "cpu" and "gloo" not in backend:
            raise ValueError(f"megatrain data parallel: the process group's backend is {backend!r} but the model "
                             "trains on the CPU; init_process_group('gloo')")
        self.timeout_s = options().dp_timeout_s
        self.node_group = None  # None: the default group (one node)
        self.cross_group = None
        if self.nodes > 1:  # every rank creates every group, in the same order
            for n in range(self.nodes):
                g = dist.new_group(list(range(n * self.local_world, (n + 1) * self.local_world)))
                if n == self.node:
                    self.node_group = g
            for l in range(self.local_world):
                g = dist.new_group(list(range(l, self.world, self.local_world)))
                if l == self.local_rank:
                    self.cross_group = g
        self.gen: List[int] = []  # update tasks this rank queued, per unit
        self.dirty = False  # a gradient was handed over since the last norm all-reduce
        self._ctl = None
        self._init_buffers()
        self._init_calls()

    # ------------------------------------------------------------------ pieces
    def piece(self, numel: int):
        """``(lo, n)``: this rank's elements ``[lo, lo + n)`` of an entry of ``numel`` elements."""
        c = -(-numel // self.local_world)
        lo = min(self.local_rank * c, numel)
        return lo, min(lo + c, numel) - lo

    @property
    def fills_store(self) -> bool:
        """Local rank 0 writes the store's initial contents (the others map the same pages)."""
        return self.local_rank == 0

    # ------------------------------------------------------------------ collectives
    def barrier(self, what: str = "barrier") -> None:
        dist = _dist()
        try:
            if self.device.type == "cuda":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()
        except Exception as e:  # noqa: BLE001 - any backend error means the job is broken
            raise self._fail(what, e) from e

    def all_gather_object(self, obj, what: str):
        dist = _dist()
        out = [None] * self.world
        try:
            dist.all_gather_object(out, obj)
        except Exception as e:  # noqa: BLE001
            raise self._fail(what, e) from e
        return out

    def reduce_pieces(self, mat: torch.Tensor) -> torch.Tensor:
        """Sum row ``local_rank`` of ``mat`` (``(LOCAL_WORLD_SIZE, C)``, on the device) over every rank.

        Returns the ``(C,)`` sum (a reduce-scatter within the node, then an all-reduce across nodes).
        """
        dist = _dist()
        out = torch.empty(mat.shape[1], dtype=mat.dtype, device=mat.device)
        with self.gradient_collective("the gradient reduce-scatter"):
            dist.reduce_scatter(out, list(mat.unbind(0)), group=self.node_group)
            if self.cross_group is not None:
                dist.all_reduce(out, group=self.cross_group)
        return out

    def all_reduce_node(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``t`` over the ranks of this node (in place; moved to the device for NCCL)."""
        dist = _dist()
        dev = t.to(self.device)
        with self.gradient_collective(what):
            dist.all_reduce(dev, group=self.node_group)
        return dev.cpu()

    # ------------------------------------------------------------------ one rank acts, all agree
    def _agree(self, err: Optional[BaseException], what: str, result=None):
        """Every rank's outcome of one step of a collective call: raise the first error on every rank, else
        return the results (a list, one per rank)."""
        msg = None if err is None else f"{type(err).__name__}: {err}"
        outcomes = self.all_gather_object((msg, result), what)
        if err is not None:
            raise err
        for r, (m, _) in enumerate(outcomes):
            if m is not None:
                raise DataParallelError(f"megatrain data parallel: {what} failed on rank {r}: {m}")
        return [res for _, res in outcomes]

    def on_rank0(self, fn, what: str, others_result=None):
        """Run ``fn`` on global rank 0 while the others wait; its error is raised on every rank; collective."""
        out, err = attempt(fn, self.rank == 0, others_result)
        self._agree(err, f"megatrain.{what}")
        return out

    def on_local0(self, fn, what: str):
        """Run ``fn`` on each node's local rank 0 (it writes the node's shared store); collective.

        Returns ``fn``'s result on every rank of the node (it must pickle). Its error is raised on every rank.
        """
        out, err = attempt(fn, self.fills_store)
        results = self._agree(err, f"megatrain.{what}", out)
        return results[self.node * self.local_world]

    # ------------------------------------------------------------------ wrap
    def check_same_weights(self, units) -> None:
        """Raise on every rank if the ranks' models differ (per-entry float64 sums compared); collective."""
        sums = []
        with torch.no_grad():
            for u in units:
                for e in u.entries:
                    p = e.param
                    sums.append(None if p.device.type == "meta" else float(p.detach().double().sum()))
        allsums = self.all_gather_object(sums, "comparing the ranks' models")
        for r, s in enumerate(allsums):
            if s != allsums[0]:
                raise ValueError(f"megatrain data parallel: rank {r}'s model weights differ from rank 0's; build the "
                                 "model the same way on every rank (torch.manual_seed before constructing it, or "
                                 "megatrain.from_pretrained)")

