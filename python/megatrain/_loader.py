"""Load the compiled extension ``megatrain._C`` (and its ops), explaining any failure."""
import importlib


def load_extension():
    """Return the ``megatrain._C`` module; its import registers the ``torch.ops.megatrain`` ops.

    Raises:
        ImportError: the extension is missing or was built against another torch / CUDA; the
            message (from ``megatrain._ext``) names the mismatch and how to rebuild.
    """
    try:
        mod = importlib.import_module("megatrain._C")
    except ImportError:
        importlib.import_module("megatrain._ext")  # raises an ImportError that names the mismatch
        raise
    try:
        importlib.import_module("megatrain.ops")  # fake kernels for torch.compile / opcheck
    except ImportError:
        pass
    return mod
