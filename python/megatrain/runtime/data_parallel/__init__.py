"""Data parallel training over ``torch.distributed``: one shared host store per node, sharded updates.

Launch N ranks (``torchrun --nproc-per-node N``, one GPU each; on CPU N processes with the gloo
backend) and initialise the default process group before ``megatrain.wrap`` / ``from_pretrained``
/ ``from_config``: the engine then becomes data parallel (``MEGATRAIN_DATA_PARALLEL=0`` opts out).

* **One host store per node.** Local rank 0 creates the arena as a ``memfd`` (anonymous shared
  memory, freed when the last process unmaps it: a dead job leaks nothing), the other local ranks
  open it through ``/proc/<pid>/fd/<n>`` and map the same pages (``MAP_SHARED``; on CUDA each rank
  page-locks its mapping). Host memory does not grow with the number of ranks; the compute copy
  one rank's update writes is what every rank streams next (no gather).
* **Sharded gradients and updates.** Each entry (parameter) of a unit is split into
  ``LOCAL_WORLD_SIZE`` contiguous pieces; local rank ``l`` owns piece ``l`` of every entry. After a
  layer's backward its gradients are reduce-scattered (``torch.distributed.reduce_scatter``: NCCL
  on the device, gloo on the CPU; across nodes a reduce-scatter within the node, then an
  all-reduce of the piece between the ranks of the same local index) and averaged over the world
  (the gradient of the mean loss over the global batch, as DDP); each rank copies only its piece
  D2H, accumulates it, and runs the fused CPU AdamW on only its piece of the shared store.
* **Clipping and the non-finite check.** ``wait_grads()`` (``optimizer.step()``,
  ``clip_grad_norm_``) all-reduces each entry's squared norm over the node's pieces, so every rank
  sees the global per-entry norms: the clip coefficient, the skip decision and the step counts are
  the same on every rank.
* **Who waits for what.** Each rank counts the update tasks it queued per unit; its CPU worker
  bumps the rank's counter of the unit in a small shared control block once the task ran. A load
  of a unit waits until every local rank's counter reached its own count (polling, with a
  liveness check of the peers' processes and a timeout, ``MEGATRAIN_DP_TIMEOUT`` seconds, default
  50), so a dead peer never hangs anyone.

Not supported with data parallel (refused): ``device_state_layers`` > 0. Updates never start
during backward (as with clipping): each layer's update is queued by ``step()``.

Modules: :mod:`.group` (:class:`DataParallel`: ranks, pieces, collectives, one rank acting for
all), :mod:`.node` (the node's shared memory: the store's arena, the control block, the wait for
the peers' updates), :mod:`.buffers` (this rank's accumulator pieces and pinned staging),
:mod:`.calls` (the collective calls: ``save_checkpoint``, ``load_checkpoint``, ``load_state_dict``
on every rank at the same point, and the posted errors), :mod:`.strategy` (:class:`DataParallelStrategy`,
the engine's sharding strategy: the hooks its parts call in a data parallel run).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..options import options
from .strategy import DataParallelStrategy
from .errors import ENV_TIMEOUT, DataParallelError
from .group import DataParallel

__all__ = ["DataParallel", "DataParallelError", "DataParallelStrategy", "ENV_TIMEOUT", "active", "detect"]


def active() -> bool:
    """Whether a wrap now would be data parallel (an initialised process group of > 1 ranks, not switched off)."""
    if not options().data_parallel:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def detect(device: torch.device) -> Optional[DataParallel]:
    """A :class:`DataParallel` for the default process group, or None (no group, one rank, or switched off)."""
    return DataParallel(device) if active() else None
