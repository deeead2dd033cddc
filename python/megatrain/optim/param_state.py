"""``optimizer.state[p]`` of :class:`~megatrain.optim.CPUAdamW`: store views that wait for the update in flight."""

from __future__ import annotations


class TierValue:
    """``exp_avg`` / ``exp_avg_sq`` of a parameter whose fp32 state is in the disk tier
    (``wrap(offload_dir=...)``): :class:`ParamState` reads it (a CPU copy) when it is accessed, and tells ``tracker``
    of the copies it hands out, so that an in-place write into one (which cannot reach the tier) is refused at the
    next ``step()`` instead of being lost.

    Args:
        read: called with no argument, returns the value (a fresh fp32 CPU tensor).
        name, key: the parameter's name and ``"exp_avg"`` / ``"exp_avg_sq"`` (for the refusal).
        tracker: the optimizer's :class:`TierCopies`, or None (nothing tracked).
    """

    __slots__ = ("read", "name", "key", "tracker")

    def __init__(self, read, name: str = "", key: str = "", tracker=None):
        self.read, self.name, self.key, self.tracker = read, name, key, tracker

    def read_tracked(self):
        """A fresh copy (:attr:`read`), handed to :attr:`tracker`."""
        v = self.read()
        if self.tracker is not None:
            self.tracker.hand_out(self.name, self.key, v)
        return v


class TierCopies:
    """The disk-tier moment copies handed out since the last ``step()``: each is watched (a weak reference and its
    version counter) while it lives, and the latest are kept alive up to ``cap_bytes`` so that a write into a copy
    nobody holds (``optimizer.state[p]["exp_avg"].fill_(0)``) is seen too."""

    def __init__(self, cap_bytes: int = 256 << 20):
        self.cap_bytes = cap_bytes
        self._seen: list = []  # (name, key, weakref to the copy, its version counter then)
        self._held: list = []
        self._bytes = 0

    def hand_out(self, name: str, key: str, t) -> None:
        import weakref

        self._seen = [s for s in self._seen if s[2]() is not None] + [(name, key, weakref.ref(t), t._version)]
        self._held.append(t)
        self._bytes += t.numel() * t.element_size()
        while self._held and self._bytes > self.cap_bytes:
            old = self._held.pop(0)
            self._bytes -= old.numel() * old.element_size()

    def take_written(self):
        """``(name, key)`` of a copy handed out since the last call and written in place since, or None; forgets
        every copy."""
        hit = next(((n, k) for n, k, r, ver in self._seen if r() is not None and r()._version != ver), None)
        self._seen, self._held, self._bytes = [], [], 0
        return hit


def value_of(v, track: bool = False):
    """``v`` itself, or what a :class:`TierValue` reads now (``track``: a copy handed to the user)."""
    if isinstance(v, TierValue):
        return v.read_tracked() if track else v.read()
    return v


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
        return value_of(super().__getitem__(k), track=True)

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
        return value_of(super().get(k, default), track=True)

    def items(self):
        self._wait()
        return [(k, value_of(v, track=True)) for k, v in super().items()]

    def values(self):
        self._wait()
        return [value_of(v, track=True) for v in super().values()]

    def __reduce__(self):
        return (dict, (dict(self.items()),))
