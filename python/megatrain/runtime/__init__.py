"""Streaming runtime: the engine (host store, slots, streams, CPU worker) and ``wrap``."""
from .wrap import UnsupportedModelError, find_decoder_layers, wrap

__all__ = ["wrap", "find_decoder_layers", "UnsupportedModelError"]
