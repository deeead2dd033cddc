"""Load the compiled extension ``megatrain._C`` (and its ops), explaining any failure."""
import importlib

from ._build_check import explain_import_failure

_SOURCES_CHECKED = False


def load_extension():
    """Return the ``megatrain._C`` module; its import registers the ``torch.ops.megatrain`` ops.

    Raises:
        ImportError: the extension is missing or was built against another torch / CUDA (the
            message, from ``megatrain._build_check``, names the mismatch), or, in a source tree, from other
            C++ sources than ``csrc/`` holds now (``megatrain._source_hash``); each says how to rebuild.
    """
    try:
        mod = importlib.import_module("megatrain._C")
    except ImportError as err:
        raise ImportError(explain_import_failure(err)) from err
    global _SOURCES_CHECKED
    if not _SOURCES_CHECKED:  # once per process: a stale build of an editable install fails here
        from pathlib import Path

        from ._source_hash import check_source_tree

        here = Path(__file__).parent
        check_source_tree(here, here / "_build_info.json")
        _SOURCES_CHECKED = True
    try:
        importlib.import_module("megatrain.ops")  # fake kernels for torch.compile / opcheck
    except ImportError:
        pass
    return mod
