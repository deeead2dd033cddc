"""One wrapped model, one activity at a time: a second thread's forward or backward is refused.

A wrapped model's device weight slots, its streams, the resident device buffer and the per-forward
bookkeeping (the layer calls a backward re-runs, block:K chains, offload) are shared by every call.
Two threads running it at once overwrite each other's slots: one gets an error from a placeholder
("Tensor on device cpu is not on the expected device meta!"), the other silently wrong outputs.

:class:`ModelActivity` tracks what the model is doing, by activity rather than by thread (backward
runs in autograd's engine threads, not the caller's):

* a forward: from the model's forward pre-hook until its forward returns (or raises);
* a direct call of a streamed layer outside the model's forward: that layer call;
* the graph of a forward with autograd on: from the forward until a backward through it has
  finished (autograd's final callback of that graph task) or the graph is freed;
* a backward: while a streamed layer's backward runs.

A thread may start a forward only while no other thread is in a forward or a layer backward and no
graph of another thread's forward is pending; a layer backward may run only while no other thread
is in a forward or a layer backward. Otherwise :func:`ModelActivity` raises one ``RuntimeError``
line in the thread that came second, before anything is touched. Sequential use from several threads
(a forward and backward in one, later in another; a backward of a forward run in another thread)
passes. The engine's own worker threads never enter these paths.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Dict, List, Optional

import torch


class ModelInUseError(RuntimeError):
    """A wrapped model was used from a second thread while a forward or backward runs in another."""


_ADVICE = ("its device weight slots, streams and per-forward state are shared by every call, so two threads cannot "
           "run forward/backward on it at once: give each thread its own wrapped model, or hold one threading.Lock "
           "around each forward, backward and optimizer.step()")


class _Graph:
    """A forward with autograd on whose backward has not finished (``done``) and whose graph is alive."""

    __slots__ = ("owner", "name", "done", "freed")

    def __init__(self, owner: int, name: str):
        self.owner, self.name = owner, name
        self.done = False  # a backward through it finished
        self.freed = False  # its graph (every layer node holding the token) was freed

    def pending(self) -> bool:
        return not (self.done or self.freed)


class _Session:
    """A thread's forward of the model (``model_forward``) or direct streamed-layer call."""

    __slots__ = ("name", "model_forward", "depth", "token")

    def __init__(self, name: str, model_forward: bool):
        self.name, self.model_forward = name, model_forward
        self.depth = 0  # layer calls running
        self.token: Optional["GraphToken"] = None


class GraphToken:
    """Held by every layer node (autograd ctx) of one forward; its collection frees the :class:`_Graph`."""

    __slots__ = ("graph", "__weakref__")

    def __init__(self, graph: _Graph):
        self.graph = graph


def _mark_freed(graph: _Graph) -> None:
    graph.freed = True  # one attribute write: safe from whichever thread frees the graph


def _graph_task_id() -> Optional[int]:
    """Id of the autograd graph task (backward pass) running now, or None (unknown / outside one)."""
    f = getattr(torch._C, "_current_graph_task_id", None)
    try:
        i = f() if f is not None else -1
    except RuntimeError:
        return None
    return None if i < 0 else int(i)


class ModelActivity:
    """What one wrapped model is doing, and the check that refuses a second thread (see module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._forward: Dict[int, _Session] = {}  # thread -> its forward / layer call
        self._backward: Dict[int, list] = {}  # thread -> [depth, name]
        self._graphs: List[_Graph] = []
        self._tasks: Dict[int, set] = {}  # graph task id -> the _Graphs its backward went through

    # ------------------------------------------------------------------ checks
    def _conflict(self, me: int, backward: bool) -> Optional[str]:
        """Under the lock: what another thread is doing with the model, in words, or None."""
        for t, session in self._forward.items():
            if t != me:
                return f"thread {session.name!r} is running a forward"
        for t, (_, name) in self._backward.items():
            if t != me:
                return f"thread {name!r} is running a backward"
        self._graphs = [g for g in self._graphs if g.pending()]
        if not backward and me not in self._backward:  # (a forward re-run inside this model's backward is its own)
            for g in self._graphs:
                if g.owner != me:
                    return (f"thread {g.name!r} ran a forward with autograd on whose backward has not finished; "
                            "the model is in use until it has, or until that forward's outputs are deleted")
        return None

    def _raise(self, what: str, doing: str) -> None:
        raise ModelInUseError(f"megatrain: this wrapped model cannot {doing} here: it is in use by another thread "
                              f"({what}); {_ADVICE}")

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> None:
        """The model's forward starts in this thread (its forward pre-hook).

        Raises:
            ModelInUseError: another thread is in a forward or backward of this model, or holds the
                graph of a forward whose backward has not finished. Nothing is changed.
        """
        me = threading.get_ident()
        with self._lock:
            what = self._conflict(me, backward=False)
            if what is not None:
                self._raise(what, "start a forward")
            # a fresh session: one left by a forward interrupted outside a layer call (KeyboardInterrupt
            # skips the always-called forward hook) is replaced, not nested
            self._forward[me] = _Session(threading.current_thread().name, model_forward=True)

    def end_forward(self) -> None:
        """The model's forward returned or raised in this thread (its always-called forward hook)."""
        with self._lock:
            self._forward.pop(threading.get_ident(), None)

    @contextlib.contextmanager
    def layer_call(self):
        """Around one streamed layer call (``run_layer``): inside the model's forward, or a direct call.

        Raises:
            ModelInUseError: as :meth:`begin_forward`, before the layer is touched.
        """
        me = threading.get_ident()
        with self._lock:
            session = self._forward.get(me)
            if session is None:
                what = self._conflict(me, backward=False)
                if what is not None:
                    self._raise(what, "run a decoder layer")
                session = self._forward[me] = _Session(threading.current_thread().name, model_forward=False)
            session.depth += 1
        try:
            yield
        except Exception:
            raise
        except BaseException:  # KeyboardInterrupt / SystemExit: the forward is abandoned; its hook may not run
            with self._lock:
                if self._forward.get(me) is session:
                    del self._forward[me]
            raise
        finally:
            with self._lock:
                session.depth -= 1
                if session.depth <= 0 and not session.model_forward and self._forward.get(me) is session:
                    del self._forward[me]  # a direct layer call ends here

    def graph_token(self) -> GraphToken:
        """The token the layer nodes (autograd ctx) of this thread's current forward keep (inside
        :meth:`layer_call`): the forward counts as pending until a backward through it finishes or
        its graph is freed. One per model forward; one per layer call for a direct layer call."""
        me = threading.get_ident()
        with self._lock:
            session = self._forward.get(me)
            if session is not None and session.token is not None:
                return session.token
            g = _Graph(me, threading.current_thread().name)
            tok = GraphToken(g)
            weakref.finalize(tok, _mark_freed, g)
            self._graphs.append(g)
            if session is not None and session.model_forward:
                session.token = tok  # held until the forward ends, then by the graph alone
            return tok

    # ------------------------------------------------------------------ backward
    @contextlib.contextmanager
    def layer_backward(self, token: Optional[GraphToken]):
        """Around one streamed layer's backward (in whichever thread autograd runs it).

        Raises:
            ModelInUseError: another thread is in a forward or a backward of this model; before
                anything is touched.
        """
        me = threading.get_ident()
        with self._lock:
            what = self._conflict(me, backward=True)
            if what is not None:
                self._raise(what, "run a backward")
            entry = self._backward.setdefault(me, [0, threading.current_thread().name])
            entry[0] += 1
            if token is not None:
                self._note_backward(token.graph)
        try:
            yield
        finally:
            with self._lock:
                entry[0] -= 1
                if entry[0] <= 0:
                    self._backward.pop(me, None)

    def _note_backward(self, graph: _Graph) -> None:
        """Under the lock: ``graph``'s forward is finished once the running backward (graph task) ends."""
        tid = _graph_task_id()
        if tid is None:
            return  # no task id here: the forward stays pending until its graph is freed
        seen = self._tasks.get(tid)
        if seen is None:
            # a task whose final callback never ran (it raised) leaves its entry: drop those
            self._tasks = {tid: set()}
            seen = self._tasks[tid]
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._backward_done(tid))
        seen.add(graph)

    def _backward_done(self, tid: int) -> None:
        with self._lock:
            for g in self._tasks.pop(tid, ()):
                g.done = True
