"""Import the compiled extension ``megatrain._C``, naming the likely cause when that fails.

``from megatrain._ext import _C`` is :func:`megatrain._loader.load_extension`'s module: an import
under another torch / CUDA / Python than the build's raises an ImportError that names the
mismatch (:func:`explain_import_failure`, from :mod:`megatrain._build_check`), and, in a source
tree, a build from other C++ sources than ``csrc/`` holds now raises one naming the rebuild.
"""

from megatrain._build_check import explain_import_failure, recorded_build_info
from megatrain._loader import load_extension

_C = load_extension()

__all__ = ["_C", "recorded_build_info", "explain_import_failure"]
