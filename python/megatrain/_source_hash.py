"""The hash of the C++ sources the extension is built from (no torch, no megatrain imports: setup.py loads it).

setup.py records :func:`csrc_hash` of the tree it builds in ``_build_info.json`` (``csrc_sha256``);
``import megatrain`` from a source tree (an editable install, or ``PYTHONPATH=<repo>/python``)
compares it with the tree's current sources (:func:`check_source_tree`), so an extension left
stale by a C++ change fails at import with what to run, not deep inside with
``incompatible function arguments``. A wheel install has no ``csrc/`` next to the package and is
never checked. Cost: reading and hashing ~0.4 MB (about a millisecond).
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".txt")
_REBUILD = "rebuild with `pip install --no-build-isolation -e .` or `python setup.py build_ext --inplace`"


def csrc_hash(csrc: Path) -> str:
    """SHA-256 (hex) over the relative paths and contents of ``csrc/**/*.{h,cpp,cu,txt}``, in sorted order."""
    h = hashlib.sha256()
    files = []
    for dirpath, dirnames, filenames in os.walk(csrc):
        dirnames.sort()
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(SOURCE_SUFFIXES)]
    for f in sorted(files):
        h.update(os.path.relpath(f, csrc).replace(os.sep, "/").encode() + b"\0")
        with open(f, "rb") as fh:
            data = fh.read()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def source_tree(package_dir: Path) -> Optional[Path]:
    """The repository root when ``package_dir`` (``.../python/megatrain``) sits in a source tree, else None."""
    root = package_dir.resolve().parent.parent
    if package_dir.resolve().parent.name == "python" and (root / "csrc").is_dir() and (root / "setup.py").is_file():
        return root
    return None


def check_source_tree(package_dir: Path, build_info_path: Path) -> None:
    """Raise ImportError if the extension next to ``package_dir`` was built from other C++ sources.

    Nothing is checked for an install without ``csrc/`` (a wheel) or a build that recorded no
    ``csrc_sha256`` (one made before it was recorded).

    Raises:
        ImportError: one line with the recorded and current hashes and the command to rebuild.
    """
    root = source_tree(package_dir)
    if root is None:
        return
    try:
        info = json.loads(build_info_path.read_text())
    except (OSError, ValueError):
        return
    built = info.get("csrc_sha256") if isinstance(info, dict) else None
    if not built:
        return
    now = csrc_hash(root / "csrc")
    if now != built:
        raise ImportError(
            f"megatrain's compiled extension was built from other C++ sources (built {built[:12]} at git "
            f"{str(info.get('git_sha', 'unknown'))[:12]}, tree {now[:12]} in {root / 'csrc'}): {_REBUILD}")
