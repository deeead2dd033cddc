"""megatrain's own exception types, one class each, shared by every module that raises them."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or model directory that cannot be loaded or saved to.

    Raised by ``megatrain.load_checkpoint`` (a missing, truncated, altered or mismatched file),
    ``megatrain.from_pretrained`` / ``megatrain.estimate`` (no config or weights, a missing tensor,
    a wrong shape or dtype) and ``megatrain.save_checkpoint`` (a destination that is a file or a
    non-empty directory that is not a megatrain checkpoint). A ``ValueError``, so older
    ``except ValueError`` handlers still catch it; the file system's own refusals (permissions,
    a full disk) stay ``OSError``.
    """
