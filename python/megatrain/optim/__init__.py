"""Optimizers whose state lives in megatrain's host store."""
from .cpu_adamw import CPUAdamW

__all__ = ["CPUAdamW"]
