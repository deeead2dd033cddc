"""``megatrain.checkpoint``: where ``save_checkpoint`` / ``load_checkpoint`` / ``verify_checkpoint`` were
imported from before the state package; they live in :mod:`megatrain.state.checkpoint` (and at the
top level, ``megatrain.save_checkpoint``), and scripts that import them from here keep working."""

from .state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "CheckpointError"]
