"""The torch functions megatrain reroutes, installed at the first ``megatrain.wrap`` (not at import).

Importing megatrain changes nothing in torch. The first ``wrap`` (:func:`install_torch_patches`,
idempotent: later calls find them installed and change nothing) routes through megatrain's own:

* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_`` (also under
  ``torch.nn.utils.clip_grad``): :mod:`.clip_grad`; the norm over a wrapped model's parameters is
  exact (their gradients live in the host store), the value clip is refused for them.
* ``torch.autograd.grad`` and ``torch.autograd.backward`` (so ``Tensor.backward`` too):
  :mod:`.autograd_guard`; refuse a wrapped model's layer placeholders as ``inputs``.
* ``torch.nn.Module.zero_grad``: :mod:`.container_zero_grad`; a module holding a wrapped model also
  drops that model's host-store gradients.
* ``torch.nn.utils._named_member_accessor.swap_tensor`` / ``set_tensor`` (what
  ``torch.func.functional_call`` calls) and ``torch.nn.utils.parametrize.register_parametrization``:
  :mod:`.functional_call_guard`; refuse to replace or parametrize a streamed layer's tensors.

Each wrapper hands every other call to torch's own function unchanged. A reference taken before the
first ``wrap`` (``from torch.autograd import grad``) keeps torch's function.
"""

from .autograd_guard import install_autograd_guard
from .clip_grad import install_clip_grad_norm
from .container_zero_grad import install_container_zero_grad
from .functional_call_guard import install_functional_call_guard, install_parametrize_guard

_INSTALLED = False


def install_torch_patches() -> None:
    """Install the reroutes listed in this module's docstring (idempotent; main thread, at ``wrap``)."""
    global _INSTALLED
    if _INSTALLED:
        return
    install_clip_grad_norm()
    install_container_zero_grad()
    install_autograd_guard()
    install_functional_call_guard()
    install_parametrize_guard()
    _INSTALLED = True
