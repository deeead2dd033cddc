"""What a torch / Hugging Face user calls on a wrapped model and its CPUAdamW by habit or by mistake:
each behaves as on the plain model with torch.optim.AdamW (CPU, fp32), or is refused in one line
before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

from test_drop_in import assert_params_close, batches, make, weights


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_drops_the_gradients_as_on_the_plain_model(set_to_none):
    """``model.zero_grad()`` (nn.Module's, which the HF Trainer and many scripts call instead of the
    optimizer's) between two backward passes drops the first one's gradients, as torch does; it used to
    leave them in the host store, and the next step() summed both micro-batches (silently)."""
    ref, ropt = make(False)
    w, opt = make(True, copy.deepcopy(ref), max_grad_norm=1e9)
    x0, x1 = batches(2)
    for model, o in ((w, opt), (ref, ropt)):
        model(input_ids=x0, labels=x0).loss.backward()
        model.zero_grad(set_to_none=set_to_none)
        model(input_ids=x1, labels=x1).loss.backward()
        o.step()
    assert_params_close(weights(w), weights(ref))
