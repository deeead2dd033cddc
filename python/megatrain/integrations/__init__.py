"""Integrations with training frameworks (imported lazily: ``transformers`` is needed only here)."""

__all__ = ["MegatrainCallback", "MegatrainTrainer", "create_optimizer"]


def __getattr__(name):
    if name in __all__:
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module 'megatrain.integrations' has no attribute {name!r}")
