"""Why ``megatrain._C`` failed to import: the build-time facts and the message that names the mismatch.

The extension is built against one torch (and CUDA) version; importing it under another one fails
with an undefined-symbol or similar error. :func:`explain_import_failure` compares the versions
recorded at build time (``_build_info.json``, written by setup.py) with those installed now and
says which differs. No project imports here: :mod:`megatrain._loader` and :mod:`megatrain._ext`
both use it.
"""

import json
import sys
from pathlib import Path

import torch  # libc10 / libtorch must be loaded before _C

_BUILD_INFO_PATH = Path(__file__).with_name("_build_info.json")
_REBUILD = "rebuild it with `pip install --no-build-isolation -e .` from the repository root"


def recorded_build_info():
    """Build-time facts from ``_build_info.json``, or ``None`` when no build happened here.

    Returns:
        dict | None: keys ``version``, ``torch_version``, ``cuda_version`` (str or None),
        ``with_cuda``, ``isas_compiled``, ``git_sha``, ``python_version``.
    """
    try:
        return json.loads(_BUILD_INFO_PATH.read_text())
    except (OSError, ValueError):
        return None


def explain_import_failure(err: BaseException) -> str:
    """A message naming the most likely mismatch behind a failed ``import megatrain._C``."""
    info = recorded_build_info()
    lines = [f"megatrain._C could not be imported ({type(err).__name__}: {err})."]
    if info is None:
        lines.append(f"No build was found (no {_BUILD_INFO_PATH.name} next to the package): {_REBUILD}.")
        return "\n".join(lines)
    now_py = ".".join(map(str, sys.version_info[:3]))
    mismatches = []
    if info.get("torch_version") != torch.__version__:
        mismatches.append(
            f"it was built against torch {info.get('torch_version')} but torch {torch.__version__} is installed"
        )
    if info.get("with_cuda") and info.get("cuda_version") != torch.version.cuda:
        mismatches.append(
            f"it was built for CUDA {info.get('cuda_version')} but the installed torch uses CUDA "
            f"{torch.version.cuda}"
        )
    built_py = str(info.get("python_version", ""))
    if built_py.rsplit(".", 1)[0] != now_py.rsplit(".", 1)[0]:
        mismatches.append(f"it was built for Python {built_py} but this is Python {now_py}")
    if mismatches:
        lines.append("Likely cause: " + "; ".join(mismatches) + f". {_REBUILD}.")
    elif "undefined symbol" in str(err):
        lines.append(
            "Versions match the recorded build, but a symbol is missing: the extension is stale or "
            f"was built by a different compiler/ABI; {_REBUILD}."
        )
    else:
        lines.append(f"The recorded build matches the installed torch/CUDA/Python; {_REBUILD}.")
    return "\n".join(lines)
