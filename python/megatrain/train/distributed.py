"""``megatrain train`` under torchrun: data parallel over the ranks torchrun starts.

``torchrun --nproc-per-node N -m megatrain train ...`` runs N ranks (one GPU each: ``cuda:LOCAL_RANK``;
on the CPU N processes with gloo) of one run:

* every rank checks the input (:func:`megatrain.train.run_plan.prepare`) and the ranks agree before
  anything is written (:meth:`Ranks.agree`: one rank's error is every rank's);
* the model is megatrain data parallel (one shared host store per node, docs/data_parallel.md);
* every global micro-batch has ``N x train.micro_batch_size`` rows of the run's one data order and
  rank ``r`` trains on rows ``r, r + N, r + 2N, ...`` of it (``DistributedSampler``'s split): a
  step trains on exactly the rows of a 1-process run with ``micro_batch_size x N``, and the
  gradient is their mean, as in that run;
* the logged loss, the held-out loss and a stop signal are combined over the ranks every step;
* global rank 0 writes the output directory (config, metrics, summary, the final model);
  checkpoints go through the collective ``megatrain.save_checkpoint`` (rank 0 writes).
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional

from megatrain.runtime.data_parallel.errors import attempt
from megatrain.train.config import UsageError


class Ranks:
    """This process's place in a ``megatrain train`` run (one process: ``world == 1``, every method a no-op).

    Attributes:
        rank, world, local_rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (torchrun's).
        device: this rank's compute device once :meth:`init` ran (reductions run on it: NCCL needs CUDA).
    """

    def __init__(self, rank: int = 0, world: int = 1, local_rank: int = 0):
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self.device = None
        self._owned = False  # this object initialised the process group (and destroys it in close)

    @classmethod
    def from_env(cls, environ=None) -> "Ranks":
        """The ranks torchrun set in the environment (``WORLD_SIZE`` > 1), else a single process."""
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1") or 1)
        if world <= 1:
            return cls()
        return cls(int(env.get("RANK", "0")), world, int(env.get("LOCAL_RANK", "0")))

    @property
    def main(self) -> bool:
        """Global rank 0: the one that writes the output directory and prints."""
        return self.rank == 0

    def device_for(self, device):
        """This rank's device for ``runtime.device``'s ``device``: CUDA becomes ``cuda:LOCAL_RANK``.

        Raises:
            UsageError: an explicit ``cuda:N`` that is not this rank's GPU.
        """
        import torch

        if self.world == 1 or device.type != "cuda":
            return device
        if device.index is not None and device.index != self.local_rank:
            raise UsageError(f"runtime.device is {device} but under torchrun every rank trains on its own GPU, "
                             f"cuda:LOCAL_RANK; use runtime.device=auto or cuda")
        return torch.device("cuda", self.local_rank)

    def init(self, device) -> None:
        """Join the process group (NCCL for CUDA, gloo for the CPU) unless it is initialised already.

        Raises:
            UsageError: ``MEGATRAIN_DATA_PARALLEL=0`` (each rank would train its own model into one directory).
        """
        if self.world == 1:
            return
        import torch
        import torch.distributed as dist

        from megatrain.runtime.options import ENV, options

        if not options().data_parallel:
            raise UsageError(f"{ENV['data_parallel']}=0 under torchrun: every rank would train its own model into "
                             "the same output directory; unset it, or run megatrain train without torchrun")
        self.device = device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            self._owned = True

    def close(self) -> None:
        """Leave the process group if :meth:`init` created it."""
        if self._owned:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owned = False

    # ------------------------------------------------------------------ agreeing
    def _outcomes(self, err: Optional[BaseException]) -> list:
        import torch.distributed as dist

        msg = None if err is None else (isinstance(err, UsageError), str(err))
        out = [None] * self.world
        dist.all_gather_object(out, msg)
        return out

    def _raise_first(self, err: Optional[BaseException], outcomes: list) -> None:
        if err is not None:
            raise err
        for r, m in enumerate(outcomes):
            if m is not None:
                usage, text = m
                raise (UsageError(text) if usage else RuntimeError(f"megatrain train: rank {r} failed: {text}"))

    def agree(self, fn: Callable):
        """``fn()`` on every rank; the first rank's error (a UsageError stays one) is raised on every rank."""
        if self.world == 1:
            return fn()
        out, err = attempt(fn)
        self._raise_first(err, self._outcomes(err))
        return out

    def on_main(self, fn: Callable, others=None):
        """``fn()`` on rank 0 while the others wait (returning ``others``); its error is raised on every rank."""
        if self.world == 1:
            return fn()
        out, err = attempt(fn, self.main, others)
        self._raise_first(err, self._outcomes(err))
        return out

    # ------------------------------------------------------------------ data and numbers
    def shard(self, rows):
        """This rank's rows of a global micro-batch (``rows[rank::world]``, ``DistributedSampler``'s split)."""
        return rows if self.world == 1 else rows[self.rank::self.world]

    def sum(self, values: List[float]) -> List[float]:
        """``values`` summed over the ranks (float64)."""
        if self.world == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()
