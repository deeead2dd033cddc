"""A checkpoint directory's layout: its file names, ``manifest.json``, and the check of every file against it."""

from __future__ import annotations

import glob
import json
import os

from ...errors import CheckpointError
from ..safetensors_file import file_digest

FORMAT = "megatrain-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
STATE = "state.json"
SCHEDULER = "scheduler.pt"
SECTIONS = ("master", "exp_avg", "exp_avg_sq")


def unit_file(index: int) -> str:
    """The file name of unit ``index``: ``unit-00003.safetensors``."""
    return f"unit-{index:05d}.safetensors"


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` holds a megatrain checkpoint manifest (what a save may replace)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def read_manifest(directory: str, where: str = "megatrain.read_manifest") -> dict:
    """Read and sanity-check ``manifest.json`` of a checkpoint directory.

    ``where``: the caller named at the start of an error message.

    Raises:
        CheckpointError: no checkpoint there, or not a megatrain checkpoint.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        hint = ""
        parent, base = os.path.split(os.path.abspath(directory))
        olds = glob.glob(os.path.join(parent, f".{base}.old-*"))
        if olds:
            hint = f" (a save was interrupted while replacing it; the previous checkpoint is at {olds[0]})"
        raise CheckpointError(f"{where}: {path} not found: {directory} is not a complete "
                              f"megatrain checkpoint{hint}")
    try:
        with open(path) as f:
            m = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{where}: {path} is not valid JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"{where}: {path} is not a megatrain checkpoint manifest")
    if m.get("version") != VERSION:
        raise CheckpointError(f"{where}: {path} has format version {m.get('version')}, "
                              f"this megatrain reads version {VERSION}")
    return m


def verify_checkpoint(directory: str, where: str = "megatrain.verify_checkpoint") -> dict:
    """Check every file listed in the manifest: present, right size, right sha256. Returns the manifest.

    Raises:
        CheckpointError: naming the first missing, truncated or altered file.
    """
    m = read_manifest(directory, where)
    for fname, want in m["files"].items():
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            raise CheckpointError(f"{where}: {path} is missing (listed in the manifest)")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{where}: {path} is truncated or altered: "
                                  f"{size} bytes, the manifest says {want['bytes']}")
        got = file_digest(path)["sha256"]
        if got != want["sha256"]:
            raise CheckpointError(f"{where}: {path} is corrupted: sha256 {got} does not match "
                                  f"the manifest ({want['sha256']})")
    return m
