"""GPU parity with Liger-Kernel: ``wrap(model)`` as a user gets it (no placement option: the planner's
default placement, Liger-Kernel applied because it is installed) against GPU-resident PyTorch with
Liger-Kernel applied the way ``Trainer(use_liger_kernel=True)`` applies it (fp32 master, autocast bf16,
torch AdamW), ~1B Llama, 20 steps, max_grad_norm 1.0.

Same bounds as tests/python/test_parity_cuda.py: per-step loss within 1e-2 relative and final
parameters with cosine similarity > 0.9999 per tensor. Skipped without a GPU or without liger-kernel.
"""

import copy
import sys

import pytest
import torch

from megatrain.runtime.model.fused_kernels import _modeling_modules
from parity import make_batches, train_megatrain, train_reference
from test_parity_cuda import STEPS, assert_trained_alike, llama_1b

pytestmark = pytest.mark.cuda


def test_default_placement_with_liger_matches_pytorch_with_liger_1b():
    liger = pytest.importorskip("liger_kernel.transformers")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = llama_1b()
    batches = make_batches(model.config.vocab_size, STEPS, 1, 4, 512, seed=5)
    kw = dict(lr=3e-4, wd=0.1, betas=(0.9, 0.95), max_grad_norm=1.0, groups="two")
    ref_model = copy.deepcopy(model)
    before = _modeling_modules()
    try:
        liger._apply_liger_kernel_to_instance(model=ref_model)  # patches transformers' modeling modules too
        ref = train_reference(ref_model, batches, device="cuda", autocast=torch.bfloat16, **kw)
    finally:
        # the reference's global patches go: wrap applies Liger as a user gets it, and later tests build
        # Llamas with transformers' own classes
        _restore_modules(before)
    del ref_model
    torch.cuda.empty_cache()
    # activation_policy=None: wrap's own default (the parity helper would otherwise name recompute)
    got, wrapped, _ = train_megatrain(model, batches, device="cuda", compute_dtype=torch.bfloat16,
                                      activation_policy=None, **kw)
    placement = wrapped.megatrain.placement()
    wrapped.megatrain.close()
    print(f"\nplacement: liger {placement.get('liger_kernel')}, device_state_layers "
          f"{placement.get('device_state_layers')}, replan {placement.get('replan')}")
    assert placement.get("liger_kernel"), placement  # applied by default, as it is installed
    assert_trained_alike(ref, got)


def _restore_modules(before: dict) -> None:
    for name, old in before.items():
        mod = sys.modules.get(name)
        for attr, was in old.items():
            if mod is not None and vars(mod).get(attr, was) is not was:
                setattr(mod, attr, was)
