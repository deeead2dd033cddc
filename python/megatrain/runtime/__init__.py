"""Streaming runtime: the engine (host store, slots, streams, CPU worker) and ``wrap``.

Importing it changes nothing in torch: the torch functions megatrain reroutes are installed at the
first ``wrap`` (:mod:`.compat.torch_patches`).
"""
from .model.wrap import UnsupportedModelError, find_decoder_layers, wrap

__all__ = ["wrap", "find_decoder_layers", "UnsupportedModelError"]
