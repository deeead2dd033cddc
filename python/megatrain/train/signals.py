"""SIGINT / SIGTERM during a ``megatrain train`` run: noted while a step runs, then a checkpoint and a stop
at the step's end (on every rank under torchrun)."""

from __future__ import annotations

import contextlib
import signal
from typing import Optional

from megatrain.train.distributed import Ranks


class StopRequest:
    """SIGINT / SIGTERM while training: finish the current step, write a checkpoint, stop.

    Installed by :func:`megatrain.train.trainer.run` for the training loop (``deferred``). Outside it
    (loading, the first evaluation, the final export) and on a second signal, the signal raises
    KeyboardInterrupt at once.
    """

    def __init__(self):
        self.signum: Optional[int] = None
        self.deferred = False

    def __call__(self, signum, frame):
        if self.deferred and self.signum is None:
            self.signum = signum
            return
        self.signum = self.signum or signum
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def installed(self):
        """Handles SIGINT and SIGTERM while the block runs (main thread only; elsewhere: no change)."""
        previous = {}
        try:
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class Interrupted(KeyboardInterrupt):
    """Training stopped on a signal at a step boundary; ``checkpoint`` resumes it (None if none was written)."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def step_outcome(ranks: Ranks, step_loss, signum: Optional[int]):
    """``(loss, signal to stop on)`` of a step: under torchrun the mean loss over the ranks and the signal
    any rank got (so every rank saves and stops after the same step), else this process's."""
    if ranks.world == 1:
        return float(step_loss), signum
    loss, sigint, sigterm = ranks.sum([float(step_loss), float(signum == signal.SIGINT),
                                       float(signum is not None and signum != signal.SIGINT)])
    return loss / ranks.world, (signal.SIGTERM if sigterm else signal.SIGINT if sigint else None)
