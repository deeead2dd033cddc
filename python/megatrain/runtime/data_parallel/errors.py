"""The data parallel error and the small helpers every part of :mod:`megatrain.runtime.data_parallel` uses."""

from __future__ import annotations

from ..options import ENV

ENV_TIMEOUT = ENV["dp_timeout_s"]  # named in the timeout's error message


class DataParallelError(RuntimeError):
    """A collective or a wait between data parallel ranks failed (a rank died or timed out)."""


def _dist():
    import torch.distributed as dist

    return dist


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (of this machine) is running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def attempt(fn, runs: bool = True, default=None):
    """``(fn(), None)`` when ``runs``, or ``(default, the exception fn raised)``; ``runs`` False: ``(default, None)``.

    For a step some ranks run while the others wait: each rank then shares its error (all raise).
    """
    if not runs:
        return default, None
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the caller raises it on every rank
        return default, e
