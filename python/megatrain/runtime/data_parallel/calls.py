"""Collective calls: the API calls every data parallel rank must make at the same point, and the guard on them.

``megatrain.save_checkpoint``, ``megatrain.load_checkpoint``, ``model.load_state_dict`` and
``optimizer.load_state_dict`` act on the node's one shared store: a rank that makes such a call
while another trains on (a rank that stopped early; a call under ``if rank == 0``) would write
the store under its peers' feet or wait forever in a collective that never comes. Each of them is
therefore a *collective call* (:meth:`CollectiveCalls.collective`): it starts only once every
rank has begun the same call after the same number of gradient collectives, and raises one clear
error on every rank otherwise, within seconds (a peer that trained on or failed) or
``MEGATRAIN_DP_TIMEOUT`` seconds (a live peer that never makes the call).

How the ranks see each other, without a ``torch.distributed`` collective (which a peer in a
different collective would never join):

* **State word** (one int64 per local rank in the node's control block): the number of gradient
  collectives the rank entered (``seq``: every gradient reduce-scatter and norm all-reduce), the
  number of collective calls it began (``calls``), and what it is doing (idle, in a gradient
  collective, in a collective call, failed). A rank publishes it before it enters a gradient
  collective and checks its local peers: one waiting in a call this rank has not made means the
  ranks diverged. A rank in a call polls its peers' words: one that entered a gradient collective
  past this rank's means the same.
* **The process group's store** (``torch.distributed``'s key-value store; every node reaches it):
  each rank's description of its call (name, arguments' fingerprint, ``seq``, optimizer steps),
  compared once all are there; and the first fatal error, which a rank whose collective failed
  reads to say why (also posted in the control block, readable while the store's host is gone).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
from typing import Callable, List, Optional

import torch

from .errors import ENV_TIMEOUT, DataParallelError, _alive, _dist

IDLE, COLLECTIVE, CALL, FAILED = 0, 1, 2, 3
_CALLS_BITS = 22  # state word: seq << 24 | calls << 2 | kind
MSG_BYTES = 1024  # a posted error message per local rank (utf-8, length first)
ERROR_KEY = "megatrain/dp/error"
_instances = itertools.count()  # engines are built in the same order on every rank: their store prefix


def fingerprint(obj) -> str:
    """A digest of a state dict (nested dicts / lists of tensors and plain values) that is equal on every rank
    exactly when the values are bit for bit equal (tensors: dtype, shape and an exact integer checksum of the
    bytes, independent of threads and summation order)."""
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            t = o.detach()
            h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
            if t.numel():
                flat = t.reshape(-1)
                flat = flat if flat.is_contiguous() else flat.contiguous()
                ints = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(flat.element_size(), torch.uint8)
                words = flat.view(torch.uint8).view(ints) if ints is not torch.uint8 else flat.view(torch.uint8)
                total = 0
                for lo in range(0, words.numel(), 1 << 24):  # bounded temporaries
                    chunk = words[lo:lo + (1 << 24)]
                    total += int(chunk.sum(dtype=torch.int64))
                h.update(str(total).encode())
        elif isinstance(o, dict):
            h.update(b"{")
            for k in sorted(o, key=repr):
                h.update(repr(k).encode())
                walk(o[k])
            h.update(b"}")
        elif isinstance(o, (list, tuple)):
            h.update(b"[")
            for v in o:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(o).encode())

    walk(obj)
    return h.hexdigest()[:16]


class CollectiveCalls:
    """Mixed into :class:`~.group.DataParallel`: the state words, collective calls and posted errors."""

    def _init_calls(self) -> None:
        self.seq = 0  # gradient collectives entered
        self.calls = 0  # collective calls begun
        self.failed: Optional[str] = None  # the fatal error this rank raised or heard of
        self.steps: Callable[[], Optional[int]] = lambda: None  # the engine's optimizer steps (attach)
        self._prefix = f"megatrain/dp{next(_instances)}"
        self._kv = None

    # ------------------------------------------------------------------ state words
    def _publish(self, kind: int) -> None:
        if self._ctl is not None:
            self.states[self.local_rank] = (self.seq << 24) | (self.calls << 2) | kind

    def _peer(self, r: int):
        """``(kind, calls, seq)`` of local rank ``r``."""
        w = int(self.states[r])
        return w & 3, (w >> 2) & ((1 << _CALLS_BITS) - 1), w >> 24

    def _peers(self) -> List[int]:
        return [r for r in range(self.local_world) if r != self.local_rank] if self._ctl is not None else []

    def _global(self, r: int) -> int:
        return self.node * self.local_world + r

    # ------------------------------------------------------------------ the store
    def _store(self):
        if self._kv is None:
            self._kv = _dist().distributed_c10d._get_default_store()
        return self._kv

    def _key(self, n: int, rank: int) -> str:
        return f"{self._prefix}/call{n}/{rank}"

    def _call_of(self, n: int, rank: int) -> dict:
        """Rank ``rank``'s description of its call ``n`` (it exists: the rank set it before publishing CALL)."""
        try:
            return json.loads(self._store().get(self._key(n, rank)))
        except Exception:  # noqa: BLE001 - the store's host is gone: describe what we know
            return {"name": "a collective call", "steps": None, "seq": None}

    # ------------------------------------------------------------------ errors
    def _stop(self, msg: str) -> DataParallelError:
        """A fatal error of this rank: posted for its peers (control block, store), returned to raise."""
        if self.failed is None:
            self.failed = msg
            if self._ctl is not None:
                data = msg.encode()[:MSG_BYTES - 8]
                row = self.messages[self.local_rank]
                row.view(torch.uint8)[8:8 + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                row[0] = len(data)
                self._publish(FAILED)
            try:
                store = self._store()
                if not store.check([ERROR_KEY]):
                    store.set(ERROR_KEY, msg)
            except Exception:  # noqa: BLE001 - best effort: the store's host may be the rank that died
                pass
        return DataParallelError(msg)

    def _posted(self, store: bool = True) -> Optional[str]:
        """A peer's posted fatal error (control block first, then the store), or None."""
        for r in self._peers():
            if self._peer(r)[0] == FAILED:
                row = self.messages[r]
                n = int(row[0])
                return bytes(row.view(torch.uint8)[8:8 + n].tolist()).decode(errors="replace")
        if store:
            try:
                kv = self._store()
                if kv.check([ERROR_KEY]):
                    return kv.get(ERROR_KEY).decode(errors="replace")
            except Exception:  # noqa: BLE001
                pass
        return None

    def _heard(self, cause: str) -> DataParallelError:
        """A peer's posted fatal error ``cause``: this rank's too (returned to raise)."""
        self.failed = cause
        return DataParallelError(f"megatrain data parallel (rank {self.rank} of {self.world}): {cause}")

    def _check_failed(self) -> None:
        if self.failed is not None:
            raise DataParallelError(self.failed)

    def _fail(self, what: str, err: BaseException) -> DataParallelError:
        """The error for a collective ``what`` that raised ``err``: the peers' posted cause when there is one."""
        cause = self._posted()
        if cause is not None:
            self.failed = self.failed or cause
            return DataParallelError(f"megatrain data parallel (rank {self.rank} of {self.world}): {what} failed: "
                                     f"{cause}")
        dead = [r for r in self._peers() if not _alive(int(self.pids[r]))]
        why = (f"local rank {dead[0]} (pid {int(self.pids[dead[0]])}) exited" if dead else
               "another rank probably died, timed out or left the job")
        return self._stop(
            f"megatrain data parallel (rank {self.rank} of {self.world}): {what} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); {why}. The job cannot continue: restart it from the "
            "last checkpoint")

    def _diverged(self, caller: int, call: dict, other: int, what: str) -> DataParallelError:
        steps = call.get("steps")
        when = f" after {steps} optimizer steps" if steps is not None else ""
        return self._stop(
            f"megatrain data parallel: rank {caller} called {call['name']}{when}, but rank {other} {what}: every rank "
            "must make this call at the same point of the training loop (a rank that stopped early, or a call made "
            "on one rank only?). The job cannot continue: restart it from the last checkpoint")

    # ------------------------------------------------------------------ gradient collectives
    @contextlib.contextmanager
    def gradient_collective(self, what: str):
        """Around one gradient collective (``what``, for errors): publish it, refuse it if a peer waits in a call."""
        self._check_failed()
        self.seq += 1
        self._publish(COLLECTIVE)
        for r in self._peers():
            kind, calls, _ = self._peer(r)
            if kind == FAILED:
                raise self._heard(self._posted(store=False))
            if kind == CALL and calls == self.calls:  # waiting in a call this rank has not made
                steps = self.steps()
                mine = f" (step {steps + 1})" if steps is not None else ""
                raise self._diverged(self._global(r), self._call_of(calls, self._global(r)), self.rank,
                                     f"went on training{mine}")
        try:
            yield
        except DataParallelError:
            raise
        except Exception as e:  # noqa: BLE001 - any backend error means the job is broken
            raise self._fail(what, e) from e
        self._publish(IDLE)

    # ------------------------------------------------------------------ collective calls
    @contextlib.contextmanager
    def collective(self, name: str, detail: str = ""):
        """Run the block as collective call ``name`` (e.g. ``"megatrain.save_checkpoint"``) of every rank.

        Enters once every rank began call ``name`` with the same ``detail`` (the arguments'
        fingerprint) after the same number of gradient collectives. Inside, the ranks may use
        ``torch.distributed`` collectives (``on_rank0`` / ``on_local0``): all are in the same call.

        Raises:
            DataParallelError: on every rank, when a rank made another call, trained on, failed or
                died, or did not make the call within ``MEGATRAIN_DP_TIMEOUT`` seconds (fatal:
                the job cannot continue). Nothing was written by the call.
            ValueError: on every rank, when the ranks made the call with different arguments
                (nothing written; the ranks stay in step).
        """
        self._check_failed()
        n = self.calls
        me = {"name": name, "detail": detail, "seq": self.seq, "steps": self.steps()}
        store = self._store()
        try:
            store.set(self._key(n, self.rank), json.dumps(me))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"{name} (the rendezvous store)", e) from e
        self._publish(CALL)
        try:
            calls = self._await(n, me)
            if n > 0:
                store.delete_key(self._key(n - 1, self.rank))  # every rank read it: they all got to call n
        except DataParallelError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"{name} (the rendezvous store)", e) from e
        first = calls[0]
        for r, c in enumerate(calls):
            if (c["name"], c["seq"]) != (first["name"], first["seq"]):
                other = (f"called {c['name']} after {c['steps']} optimizer steps" if c["name"] != first["name"] or
                         c["steps"] != first["steps"] else
                         f"made it after {c['seq']} gradient collectives, rank 0 after {first['seq']}")
                raise self._diverged(0, first, r, other)
        try:
            bad = next((r for r, c in enumerate(calls) if c["detail"] != first["detail"]), None)
            if bad is not None:
                raise ValueError(f"{name}: rank {bad} called it with other arguments than rank 0 ({calls[bad]['detail']} "
                                 f"vs {first['detail']}); under data parallel every rank passes the same (nothing "
                                 "was changed)")
            yield
        finally:
            self.calls = n + 1
            self._publish(IDLE)

    def _await(self, n: int, me: dict) -> List[dict]:
        """Every rank's description of call ``n`` once all are in the store (see :meth:`collective`)."""
        store = self._store()
        keys = [self._key(n, r) for r in range(self.world)]
        t0 = last_alive = time.monotonic()
        delay = 1e-3
        while True:
            for r in self._peers():
                kind, _, seq = self._peer(r)
                if kind == FAILED:
                    raise self._heard(self._posted(store=False))
                if seq > me["seq"]:
                    raise self._diverged(self.rank, me, self._global(r), "went on training")
            if store.check(keys):
                return [json.loads(store.get(k)) for k in keys]
            cause = self._posted()
            if cause is not None:
                raise self._heard(cause)
            now = time.monotonic()
            if now - last_alive > 0.5:
                last_alive = now
                dead = [r for r in self._peers() if not _alive(int(self.pids[r]))]
                if dead:
                    raise self._diverged(self.rank, me, self._global(dead[0]),
                                         f"exited (pid {int(self.pids[dead[0]])}) without making it")
                if now - t0 > self.timeout_s:
                    missing = [r for r, k in enumerate(keys) if not store.check([k])]
                    raise self._diverged(self.rank, me, missing[0],
                                         f"did not make it within {ENV_TIMEOUT}={self.timeout_s:g} s (raise it if "
                                         "a rank legitimately gets there later)")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

