"""``optimizer.state[p]`` of :class:`~megatrain.optim.CPUAdamW`: store views that wait for the update in flight."""

from __future__ import annotations


class TierValue:
    """``exp_avg`` / ``exp_avg_sq`` of a parameter whose fp32 state is in the disk tier
    (``wrap(offload_dir=...)``): :class:`ParamState` reads it (a CPU copy) when it is accessed.

    Args:
        read: called with no argument, returns the value (a fresh fp32 CPU tensor).
    """

    __slots__ = ("read",)

    def __init__(self, read):
        self.read = read


def value_of(v):
    """``v`` itself, or what a :class:`TierValue` reads now."""
    return v.read() if isinstance(v, TierValue) else v


class ParamState(dict):
    """``optimizer.state[p]``: reading a value first waits for the parameter's update in flight, so
    ``exp_avg`` / ``exp_avg_sq`` read right after ``step()`` show the new values (as torch's do).
    For a parameter whose state is on disk they are copies read from the tier at each access.

    Args:
        wait: called with no argument before each read (waits for the unit's update, makes its host
            sections current and hands them out writable).
        *args, **kwargs: the items, as ``dict``'s.

    The optimizer itself reads and writes through ``dict``'s methods (no waiting).
    """

    __slots__ = ("_wait",)

    def __init__(self, wait, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._wait = wait

    def __getitem__(self, k):
        self._wait()
        return value_of(super().__getitem__(k))

    def __setitem__(self, k, v):
        """``optimizer.state[p]["exp_avg"] = t`` (or ``exp_avg_sq``): as in torch, ``t`` is the state from now
        on: its values are copied into the moment the update reads (the store's, or the device's), which
        ``optimizer.state[p][k]`` keeps returning. Other keys (``step``) are set as given.

        Raises:
            RuntimeError: the parameter's state is in the disk tier (use ``optimizer.load_state_dict``).
            ValueError: ``t`` does not have the moment's shape.
        """
        import torch

        cur = super().get(k) if k in ("exp_avg", "exp_avg_sq") else None
        if cur is None:
            return super().__setitem__(k, v)
        if isinstance(cur, TierValue):
            raise RuntimeError(f"megatrain: optimizer.state[p][{k!r}] of a parameter whose state is in the disk tier "
                               "cannot be replaced (its values are read from the tier at each access); set it with "
                               "optimizer.load_state_dict(...)")
        cur = self[k]  # waits for the update in flight; hands the sections out writable
        v = torch.as_tensor(v)
        if tuple(v.shape) != tuple(cur.shape):
            raise ValueError(f"megatrain: optimizer.state[p][{k!r}] must keep its shape {tuple(cur.shape)}, "
                             f"got {tuple(v.shape)}")
        with torch.no_grad():
            cur.copy_(v)

    def get(self, k, default=None):
        self._wait()
        return value_of(super().get(k, default))

    def items(self):
        self._wait()
        return [(k, value_of(v)) for k, v in super().items()]

    def values(self):
        self._wait()
        return [value_of(v) for v in super().values()]

    def __reduce__(self):
        return (dict, (dict(self.items()),))
