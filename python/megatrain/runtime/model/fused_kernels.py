"""Liger-Kernel's fused Triton kernels on a wrapped model: ``megatrain.wrap(..., liger_kernel=None | True | False)``.

`Liger-Kernel <https://github.com/linkedin/Liger-Kernel>`_ (``pip install liger-kernel``)
replaces a Hugging Face model's RMSNorm, rotary embedding, SwiGLU / GeGLU MLP and LM head + loss with
fused Triton kernels, for the architectures it knows (``model.config.model_type``: llama, mistral,
qwen2, qwen3, gemma, ... : ``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``).
Measured on one H200 (3.37B Llama, 4 x 4096 tokens, bf16, ``max_grad_norm=1.0``): megatrain ``auto``
0.922 s/step, with Liger 0.677 s/step; PyTorch + checkpointing 1.166, with Liger 0.902.

How it is applied: ``wrap`` calls Liger's own entry point, the one ``transformers.Trainer`` calls for
``TrainingArguments(use_liger_kernel=True)``: ``liger_kernel.transformers._apply_liger_kernel_to_instance
(model=model)`` (Liger's defaults for the architecture), once, after ``wrap`` checked its arguments and
before it builds the engine. Liger patches the ``transformers`` modeling module of the architecture
(``apply_rotary_pos_emb``, the norm and MLP classes: what the attention of every streamed layer calls)
and binds its kernels' ``forward`` on the model instance's modules (each decoder layer's norms and
``mlp``, the final norm) and its fused LM head + loss ``forward`` on the causal LM. Streamed layers
keep their own module objects, so the bound forwards run on the streamed weights; megatrain's tiled
MLP / norms (``tile_mlp``) take the bound forward as the untiled one (:mod:`..activations.long_context`), and
``lean_activations`` leaves the modules Liger patched alone (Liger's RMSNorm keeps only its input
and ``rstd``, its SwiGLU ``gate`` and ``up``: what the lean forms keep).

The loss: where Liger's fused linear cross-entropy is on (Liger's default for the causal LMs),
a training forward with ``labels`` computes the loss with it (LM head and cross-entropy over
chunks of rows, fp32 inside the kernel, never the full logits; the same label shift,
``ignore_index`` and ``num_items_in_batch`` reduction as transformers' ``ForCausalLMLoss``), and
megatrain's chunked loss (``chunked_loss``) is not used there: its LM-head hook is never reached.
Forwards that compute logits (evaluation, no labels) go through the model's LM head and loss as
before, chunked by megatrain when ``chunked_loss`` says so. Both are exact (no approximation).

``transformers.Trainer(..., args=TrainingArguments(use_liger_kernel=True))`` on a wrapped model calls
the same function again: it binds the same forwards again (same effect), and megatrain's tiling still
runs (the tiled modules' ``forward`` is a data descriptor that takes precedence over the instance
attribute Liger writes).

Other models in the process are left as they were: Liger's patches of the ``transformers`` modeling
modules are global (every model of the architecture built or run afterwards would get them, and
Liger's Triton kernels fail on CPU tensors). ``wrap`` therefore puts back each class Liger replaced
in those modules (this model's modules already hold Liger's forwards), and each module-level
function it replaced (``apply_rotary_pos_emb``) becomes one that calls Liger's kernel for CUDA
tensors and the original otherwise (:func:`_contain_module_patches`).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Optional

import torch
from torch import nn


def check_liger_kernel(value, what: str = "megatrain.wrap: liger_kernel") -> None:
    """Raise ``ValueError`` unless ``value`` is None (auto), True or False."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{what} must be None (on when liger-kernel is installed and the device is CUDA), True "
                         f"(required) or False (off), got {value!r}")


def liger_installed() -> bool:
    """Whether ``liger_kernel`` can be imported (found on the path, or already imported)."""
    if "liger_kernel" in sys.modules:
        return sys.modules["liger_kernel"] is not None
    try:
        return importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        return False


def resolve_liger_kernel(value, device: torch.device, what: str = "megatrain.wrap: liger_kernel") -> bool:
    """Whether ``wrap`` applies Liger-Kernel: ``value`` None: when it is installed and ``device`` is CUDA;
    False: never; True: always.

    Raises:
        ValueError: ``value`` is not None / True / False; or True while liger-kernel is not installed,
            or with a device other than CUDA (its kernels are Triton kernels).
    """
    check_liger_kernel(value, what)
    if value is False:
        return False
    installed = liger_installed()
    cuda = torch.device(device).type == "cuda"
    if value is True:
        if not cuda:
            raise ValueError(f"{what}=True needs a CUDA device (Liger's kernels are Triton kernels), got "
                             f"{str(device)!r}; pass liger_kernel=None or False")
        if not installed:
            raise ValueError(f"{what}=True, but liger-kernel is not installed: pip install liger-kernel (the "
                             "'kernels' extra), or pass liger_kernel=None (used when installed)")
    return installed and cuda


def _model_type(model: nn.Module) -> Optional[str]:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) if cfg is not None else None


def apply_liger_kernel(model: nn.Module, layers, required: bool = False) -> dict:
    """Apply Liger-Kernel to ``model`` (before ``wrap`` builds its engine; see the module docstring).

    Args:
        model: the Hugging Face causal LM being wrapped (real or meta-device parameters: Liger binds
            forwards and patches classes, it touches no weight).
        layers: its decoder layers (checked afterwards: a streamed layer's own ``forward`` must stay
            megatrain's).
        required: ``liger_kernel=True``: an architecture Liger does not know raises instead of being skipped.

    Returns:
        ``dict(applied=bool, model_type=..., reason=...)`` (``model.megatrain.liger_kernel``, in
        ``placement()``).

    Raises:
        ValueError: ``required`` and Liger has no kernels for ``model.config.model_type``.
        RuntimeError: Liger bound a ``forward`` on a decoder layer itself (megatrain streams through it).
    """
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model_type = _model_type(model)
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN as known
    except ImportError:  # an older layout: let Liger decide (it logs and returns for an unknown type)
        known = None
    if model_type is None or (known is not None and model_type not in known):
        if required:
            raise ValueError(f"megatrain.wrap: liger_kernel=True, but liger-kernel has no kernels for model_type "
                             f"{model_type!r}; pass liger_kernel=None (used where supported) or False")
        return dict(applied=False, model_type=model_type, reason="architecture not supported by liger-kernel")
    before = _modeling_modules()
    _apply_liger_kernel_to_instance(model=model)
    _contain_module_patches(before)
    for layer in layers:
        if "forward" in vars(layer):
            raise RuntimeError(f"megatrain.wrap: liger-kernel replaced the forward of decoder layer "
                               f"{type(layer).__name__} itself; megatrain streams through it: pass liger_kernel=False")
    return dict(applied=True, model_type=model_type, reason=None)


def _modeling_modules() -> dict:
    """``{module name: dict of its attributes}`` of every imported ``transformers.models`` module."""
    return {name: dict(vars(mod)) for name, mod in list(sys.modules.items())
            if mod is not None and name.startswith("transformers.models.")}


def _on_cuda(args, kwargs) -> bool:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            return x.is_cuda
    return False


def _device_dispatch(original, liger_fn):
    """``liger_fn`` for CUDA tensors (the first tensor argument decides), ``original`` otherwise."""
    original = getattr(original, "_megatrain_original", original)  # a second wrap: no nesting

    def dispatch(*args, **kwargs):
        return (liger_fn if _on_cuda(args, kwargs) else original)(*args, **kwargs)

    dispatch._megatrain_original = original
    dispatch.__name__ = getattr(original, "__name__", "dispatch")
    dispatch.__doc__ = getattr(original, "__doc__", None)
    return dispatch


def _contain_module_patches(before: dict) -> None:
    """Undoes the global side of Liger's patching (see the module docstring): classes put back,
    module-level functions dispatched by device. ``before``: :func:`_modeling_modules` taken just
    before Liger was applied."""
    for name, old in before.items():
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for attr, was in old.items():
            now = vars(mod).get(attr, was)
            if now is was:
                continue
            if isinstance(was, type):
                setattr(mod, attr, was)
            elif callable(was) and callable(now):
                setattr(mod, attr, _device_dispatch(was, now))
