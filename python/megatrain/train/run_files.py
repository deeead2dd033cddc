"""What a ``megatrain train`` run writes first to its output directory, and how it takes that back
when it fails before its first step (``--out`` is then left as it was found).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Optional

from megatrain.state.checkpoint import existing_ancestor
from megatrain.train import metrics as metrics_mod
from megatrain.train.checkpoints import CHECKPOINTS
from megatrain.train.config import Config
from megatrain.train.config_build import to_yaml
from megatrain.train.distributed import Ranks


def write_text_atomic(path: str, text: str) -> None:
    """Writes ``path`` through a temporary file beside it and one rename: a full disk or a kill leaves
    the old file (or none), never an empty or half-written one.

    Raises:
        OSError: the file system refused (ENOSPC, permissions); the temporary file is removed.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror, path) from None  # a failed write() names no file: name it
        raise


# what every run writes first to its output directory: a directory holding both is a run's output
# (megatrain.train.data does not read one as data)
RUN_MARKERS = ("config.yaml", metrics_mod.METRICS_FILE)


class RunFiles:
    """What a new run adds to its output directory, so that a run that fails before its first step
    leaves ``--out`` as it found it (a rerun is then not refused as "not empty").

    Files the run replaced (``log.overwrite``, ``--resume``) stay; only what did not exist is
    removed, and the directories the run created, if they are empty again.
    """

    NAMES = (*RUN_MARKERS, "tensorboard", "summary.json")

    def __init__(self, out_dir: str):
        self.out_dir = os.path.abspath(out_dir)
        self.ancestor = self.out_dir if os.path.isdir(self.out_dir) else existing_ancestor(self.out_dir)
        self.new = [n for n in self.NAMES if not os.path.lexists(os.path.join(self.out_dir, n))]
        self.taken_back = False

    def take_back(self, exc: Optional[BaseException] = None) -> None:
        """Removes what this run added; marks ``exc`` (``out_left_as_found = True``) for the message."""
        for name in self.new:
            path = os.path.join(self.out_dir, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        d = self.out_dir
        while d != self.ancestor and len(d) > len(self.ancestor):
            try:
                os.rmdir(d)  # only an empty directory: never anything the user put there
            except OSError:
                break
            d = os.path.dirname(d)
        self.taken_back = True
        if exc is not None:
            with contextlib.suppress(AttributeError, TypeError):
                exc.out_left_as_found = True


class NullSink:
    """The metrics sink of ranks other than 0 under torchrun (rank 0 writes the metrics)."""

    path = None
    tensorboard_dir = None

    def write(self, record: dict, prefix: str = "train") -> None:
        pass

    def close(self) -> None:
        pass


def open_run_files(cfg: Config, out_dir: str, ranks: Ranks, resumed: bool):
    """The first writes of a run (global rank 0 under torchrun): ``out_dir`` created, a reused directory's
    checkpoints and TensorBoard logs removed (a new run, not ``resumed``), ``config.yaml`` written, the
    metrics sink opened (appending when ``resumed``).

    Returns:
        ``(RunFiles, sink)``: what the run added (taken back if it fails before its first step) and the
        :class:`~megatrain.train.metrics.MetricsSink` (:class:`NullSink` on other ranks).

    Raises:
        OSError: the file system refused; what was added is taken back first.
    """
    added = RunFiles(out_dir)  # what this run adds to out_dir: taken back if the run fails before its first step
    sink = NullSink()
    if ranks.main:
        try:
            os.makedirs(out_dir, exist_ok=True)
            if not resumed:  # a new run in a reused (log.overwrite) directory: nothing of the old run is mixed in
                for name in (CHECKPOINTS, "tensorboard"):
                    shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
            write_text_atomic(os.path.join(out_dir, "config.yaml"), to_yaml(cfg))
            sink = metrics_mod.MetricsSink(out_dir, tensorboard=cfg.log.tensorboard, append=resumed)
        except BaseException as exc:
            added.take_back(exc)
            raise
    return added, sink
