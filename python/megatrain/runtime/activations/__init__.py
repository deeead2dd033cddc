"""Activation policies: what a layer keeps for backward (recompute, store, offload, long context)."""
