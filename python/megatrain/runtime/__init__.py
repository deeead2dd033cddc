"""Streaming runtime: the engine (host store, slots, streams, CPU worker) and ``wrap``."""
from .wrap import UnsupportedModelError, find_decoder_layers, wrap

__all__ = ["wrap", "find_decoder_layers", "UnsupportedModelError"]

from .clip_grad import install_clip_grad_norm as _install_clip_grad_norm  # noqa: E402

_install_clip_grad_norm()  # torch.nn.utils.clip_grad_norm_ is exact on wrapped models' parameters

from .autograd_guard import install_autograd_guard as _install_autograd_guard  # noqa: E402

_install_autograd_guard()  # torch.autograd.grad / backward(inputs=...) refuse a wrapped model's layer placeholders

from .functional_call_guard import install_functional_call_guard as _install_functional_call_guard  # noqa: E402
from .functional_call_guard import install_parametrize_guard as _install_parametrize_guard  # noqa: E402

_install_functional_call_guard()  # torch.func.functional_call refuses to replace a wrapped model's layer tensors
_install_parametrize_guard()  # parametrize.register_parametrization refuses a wrapped model's layer modules
