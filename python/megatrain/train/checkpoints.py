"""The checkpoints of a ``megatrain train`` run: where they go (``out/checkpoints/step-N``), which are
complete, pruning the old ones, and the one ``--resume`` means (found, then loaded).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional

from megatrain.train.config import UsageError
from megatrain.train.messages import first_line

CHECKPOINTS = "checkpoints"
TRAINER_TAG = "megatrain train"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_path(out_dir: str, step: int) -> str:
    """``out_dir/checkpoints/step-NNNNNNNN``: where the checkpoint after ``step`` steps goes."""
    return os.path.join(out_dir, CHECKPOINTS, f"step-{step:08d}")


def list_checkpoints(out_dir: str) -> list:
    """Complete checkpoints under ``out_dir/checkpoints`` as ``[(step, path)]``, oldest first."""
    root = os.path.join(out_dir, CHECKPOINTS)
    found = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = _STEP_DIR.match(name)
            path = os.path.join(root, name)
            if match and os.path.isfile(os.path.join(path, "manifest.json")):
                found.append((int(match.group(1)), path))
    return sorted(found)


def prune_checkpoints(out_dir: str, step: int, keep_last: int) -> None:
    """Deletes all but the ``keep_last`` newest checkpoints at or before ``step`` (later ones, left by
    a run resumed from an earlier checkpoint, are replaced when training reaches their step)."""
    old = [p for s, p in list_checkpoints(out_dir) if s <= step]
    for path in old[: max(0, len(old) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class ResumePoint:
    """A ``megatrain train`` checkpoint to continue from (see :func:`find_resume_point`)."""

    path: str  # absolute checkpoint directory
    step: int  # optimizer steps done
    state: dict  # the trainer's ``extra`` dict: config, data position, metrics so far
    run_dir: Optional[str]  # the run's out directory when the checkpoint is <run>/checkpoints/step-N


def find_resume_point(path: str) -> ResumePoint:
    """The checkpoint ``--resume PATH`` means: PATH itself, or the newest complete one of a run directory.

    Reads only the manifest and ``state.json`` (the tensors are verified and loaded by :func:`load_resume_point`).

    Raises:
        UsageError: PATH is neither, the checkpoint is damaged, or it was not written by ``megatrain train``.
    """
    from megatrain.state.checkpoint import CheckpointError, read_manifest

    if not os.path.exists(path):
        raise UsageError(f"--resume {path!r} does not exist; give a run's out directory or one of its checkpoints")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "manifest.json")):
        found = list_checkpoints(path)
        if not found:
            raise UsageError(
                f"--resume {path!r} holds no complete checkpoint ({CHECKPOINTS}/step-N/manifest.json); runs write "
                "them every train.save_every steps and on Ctrl-C/SIGTERM"
            )
        path = found[-1][1]
    path = os.path.abspath(path)
    try:
        read_manifest(path)
        with open(os.path.join(path, "state.json")) as f:
            extra = json.load(f).get("extra") or {}
    except CheckpointError as exc:
        raise UsageError(f"cannot resume from {path!r}: {first_line(exc)}") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot resume from {path!r}: state.json is unreadable ({first_line(exc)})") from None
    if extra.get("trainer") != TRAINER_TAG or "step" not in extra or "config" not in extra:
        raise UsageError(
            f"checkpoint {path!r} was not written by megatrain train (it has no training position); load it with "
            "megatrain.load_checkpoint in your own loop"
        )
    parent = os.path.dirname(path)
    run_dir = os.path.dirname(parent) if os.path.basename(parent) == CHECKPOINTS else None
    return ResumePoint(path=path, step=int(extra["step"]), state=extra, run_dir=run_dir)


def load_resume_point(resume: ResumePoint, model, optimizer, scheduler) -> dict:
    """Loads checkpoint ``resume`` into the run's model, optimizer and scheduler (verifying its tensors);
    returns the trainer's ``extra`` dict (``step``, ``metrics``, ...).

    Raises:
        UsageError: the checkpoint does not load (damaged, another model or optimizer).
    """
    import megatrain
    from megatrain.state.checkpoint import CheckpointError

    try:
        return megatrain.load_checkpoint(resume.path, model, optimizer, scheduler)
    except (CheckpointError, ValueError) as exc:  # megatrain's own one-line messages: whole (200 cut their name lists)
        raise UsageError(f"cannot resume from {resume.path!r}: {first_line(exc, limit=800)}") from None
