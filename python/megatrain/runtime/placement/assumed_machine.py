"""The machine ``megatrain.estimate`` judges the fit against: this one, or one described by its sizes.

``estimate(..., host_memory=, gpu_memory=)`` asks whether a model fits a machine that is not this
one (the paper's setting: one H200 and 1.5 TiB of host memory, from a laptop). :class:`AssumedMachine`
holds those sizes, refuses bad ones, and gives the host limits the budget check's rules
(:func:`~.host_memory.host_budget_shortfall`) run on in place of this machine's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...byte_units import MAX_BYTES, format_bytes, parse_bytes


def _size(name: str, value, saturate: bool = False) -> Optional[int]:
    """``value`` (None, bytes, or a string such as "1.5TiB" / "141GB") in bytes; one line naming ``name`` if bad.
    ``saturate``: a count above ``MAX_BYTES`` (``1e30``, ``float("inf")``, ``"inf"``) reads as ``MAX_BYTES``."""
    if value is None:
        return None
    try:
        return parse_bytes(value, saturate=saturate)
    except ValueError:
        unlimited = ", float('inf') or 'inf' for no host limit," if saturate else ""
        raise ValueError(f"megatrain.estimate: {name} must be a number of bytes > 0 (an int, or a string such as "
                         f"'1.5TiB' or '141GB'){unlimited} or None for this machine's, got {value!r}") from None


@dataclass(frozen=True)
class AssumedMachine:
    """The sizes of the machine an estimate is for (None: this machine's own).

    Attributes:
        host_bytes: the host memory available to the run, in bytes: judged as MemAvailable, with no
            cgroup or locked-memory limit (and judged even when ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1``).
            ``MAX_BYTES`` (given as ``float("inf")``, ``"inf"``, ``1e30``: the spellings of wrap's
            ``host_memory_limit`` for no limit): no host limit at all (:attr:`host_unlimited`).
        gpu_bytes: the GPU memory free to the run, in bytes: the device is CUDA (bf16 compute,
            ``auto`` policy, pinned staging, as on a GPU) and this is its free memory, capped by
            ``gpu_memory_limit`` (a fraction of it when a float).
    """

    host_bytes: Optional[int] = None
    gpu_bytes: Optional[int] = None

    @classmethod
    def parse(cls, host_memory=None, gpu_memory=None, device=None) -> "AssumedMachine":
        """The machine of ``estimate``'s ``host_memory`` / ``gpu_memory``.

        Raises:
            ValueError: one line naming the argument: not a size, zero, negative, a bool, a ``gpu_memory``
                above ``MAX_BYTES``; or ``gpu_memory`` with a CPU ``device``.
        """
        host, gpu = _size("host_memory", host_memory, saturate=True), _size("gpu_memory", gpu_memory)
        if gpu is not None and device is not None and str(device).split(":")[0] == "cpu":
            raise ValueError(f"megatrain.estimate: gpu_memory describes a CUDA device, but device={str(device)!r}: "
                             "leave device unset (or 'cuda') to estimate for that GPU, or drop gpu_memory")
        return cls(host_bytes=host, gpu_bytes=gpu)

    @property
    def given(self) -> bool:
        """Whether any size was given (else: this machine, as ``estimate`` always did)."""
        return self.host_bytes is not None or self.gpu_bytes is not None

    def default_device(self, device):
        """The device to plan for: CUDA when ``gpu_memory`` is given and no device is, else ``device``."""
        return "cuda" if device is None and self.gpu_bytes is not None else device

    @property
    def host_unlimited(self) -> bool:
        """Whether the given host has no memory limit (``host_memory=float("inf")``): the host part always fits."""
        return self.host_bytes == MAX_BYTES

    @property
    def host_limit_name(self) -> str:
        """How messages name the given host memory: "host_memory given (1.50 TiB)"."""
        size = "no limit" if self.host_unlimited else format_bytes(self.host_bytes, largest='TiB')
        return f"host_memory given ({size})"

    @property
    def gpu_name(self) -> str:
        """How messages name the given GPU: "the given GPU (gpu_memory 131.32 GiB)"."""
        return f"the given GPU (gpu_memory {format_bytes(self.gpu_bytes, largest='TiB')})"

    def host_limits(self) -> dict:
        """The host limits the fit is judged on, as :func:`~.host_memory.host_memory_limits` gives them:
        the given host memory as MemAvailable with no cgroup or locked-memory limit, else this
        machine's (read now); none at all (every value None) for an unlimited host."""
        if self.host_bytes is None:
            from .host_memory import host_memory_limits

            return host_memory_limits()
        return dict(mem_available_bytes=None if self.host_unlimited else self.host_bytes, cgroup_limit_bytes=None, cgroup_usage_bytes=None,
                    memlock_bytes=None, cgroup_path=None)

    def shortfall(self, needed_bytes: int, pinned_bytes: int, reclaimable_bytes: int,
                  limits: Optional[dict] = None) -> Optional[dict]:
        """:func:`~.host_memory.host_budget_shortfall` on ``limits`` (default :meth:`host_limits`); a given
        host is judged even with ``MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1`` and its limit named as given."""
        from .host_memory import host_budget_shortfall

        given = self.host_bytes is not None
        lim = self.host_limits() if limits is None else limits
        short = host_budget_shortfall(needed_bytes, pinned_bytes, reclaimable_bytes, lim, honour_skip=not given)
        if short is not None and given:
            short = dict(short, limit=self.host_limit_name)
        return short
