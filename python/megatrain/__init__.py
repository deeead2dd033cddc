"""megatrain: full-precision LLM training on one GPU with all training state in host memory.

Usage::

    import megatrain
    model = megatrain.wrap(model)                      # decoder layers streamed from host memory
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=3e-4, max_grad_norm=1.0)
    loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()

Source of the idea: MegaTrain (arXiv 2604.05091).
"""

__version__ = "0.1.0"

from . import optim  # noqa: E402
from .runtime import UnsupportedModelError, wrap  # noqa: E402
from .state.export import export_pretrained, master_state_dict  # noqa: E402
from .errors import CheckpointError  # noqa: E402
from .runtime.model.thread_guard import ModelInUseError  # noqa: E402
from .state.loading import from_config, from_pretrained  # noqa: E402
from .runtime.placement.estimate import MemoryEstimate, estimate  # noqa: E402
from .runtime.wrap_options import WrapOptions  # noqa: E402
from .runtime.activations.activation_policy import ActivationPolicy  # noqa: E402
from .state.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint  # noqa: E402


def cuda_status() -> str:
    """Why CUDA tests can or cannot run here: ``"ok"`` or a reason (no CUDA torch, no GPU, extension without CUDA)."""
    import torch

    if torch.version.cuda is None:
        return "torch was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    from ._loader import load_extension

    info = load_extension().build_info()
    if not info.get("with_cuda"):
        return "megatrain._C was built without CUDA (rebuild with MEGATRAIN_WITH_CUDA=1)"
    return "ok"


__all__ = ["wrap", "WrapOptions", "ActivationPolicy", "from_pretrained", "from_config", "estimate", "MemoryEstimate", "CheckpointError", "optim", "export_pretrained", "master_state_dict", "save_checkpoint", "load_checkpoint",
           "verify_checkpoint", "cuda_status", "UnsupportedModelError", "ModelInUseError", "__version__"]
