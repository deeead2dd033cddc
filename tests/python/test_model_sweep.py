"""Model-type sweep: a tiny model of each causal-LM type of transformers, megatrain vs plain PyTorch.

``model_sweep.run_type`` trains one type both ways (3 steps, AdamW + clipping) and compares the loss
of every step and every parameter per element, with an fp64 run of plain PyTorch as the judge of
rounding noise. The CI sample below must pass; the whole mapping runs under ``-m slow`` and may not
``fail`` except for the types in ``KNOWN_FAILURES`` (each with its reason; strict: a type that
starts to pass or to be refused fails the test until its entry is removed, so the list only shrinks).
``scripts/model_support_table.py`` runs the same sweep and writes ``docs/models.md``.
"""

import pytest
import torch

import model_sweep
from model_sweep import run_type

# One of each family kind: dense Llama, GPT-2 (tied embeddings, Conv1D, learned positions), two
# MoE (Qwen2-MoE with a shared expert, Mixtral), Gemma2 (sliding + full layers, soft-capping),
# Phi-3 (fused qkv / gate_up projections).
CI_SAMPLE = ["llama", "gpt2", "qwen2_moe", "mixtral", "gemma2", "phi3"]

# type -> why megatrain fails it today (first error of the sweep). Remove an entry when the type
# passes or is refused with a one-line error.
KNOWN_FAILURES = {
    "fuyu": "parity: one element of 16 in language_model.layers.0.self_attn.k_layernorm.bias differs by "
            "2.8e-07 (the tensor's max is 1.9e-03) after 3 steps; losses match; not yet judged",
    "xglm": "parity miss on self_attn.k_proj.bias only (|diff| ~3e-9 on a tensor of max 7e-9: a gradient that "
            "is zero in exact arithmetic); not yet checked why the fp64 judge does not accept it",
}


@pytest.mark.parametrize("model_type", CI_SAMPLE)
def test_sweep_sample_passes(model_type):
    r = run_type(model_type)
    assert r.status == "pass", f"{model_type}: {r.status}: {r.detail}"
    assert r.max_rel_diff is not None and r.max_rel_diff < 1e-4


def _all_types():
    params = []
    for t in model_sweep.causal_lm_types():
        marks = [pytest.mark.xfail(reason=KNOWN_FAILURES[t], strict=True)] if t in KNOWN_FAILURES else []
        params.append(pytest.param(t, marks=marks))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _all_types())
def test_sweep_every_causal_lm_type(model_type):
    r = run_type(model_type)
    if r.status == "skipped":
        pytest.skip(r.detail)
    assert r.status in ("pass", "refused"), f"{model_type}: {r.detail}"
    if r.status == "refused":
        assert r.detail.startswith("megatrain") and "\n" not in r.detail


# The sweep itself must be able to tell a miss from a match: these fail if compare() or the
# classification stops looking.

def test_compare_flags_one_element_off():
    ref = {"w": torch.linspace(-1, 1, 64)}
    got = {"w": ref["w"].clone()}
    assert model_sweep.compare([1.0, 0.9], got, [1.0, 0.9], ref)[0]
    got["w"][7] += 1e-3
    ok, max_rel, _, worst, msg = model_sweep.compare([1.0, 0.9], got, [1.0, 0.9], ref)
    assert not ok and worst == "w" and "1/64 elements differ" in msg and max_rel == pytest.approx(1e-3, rel=1e-3)
    ok, *_ , msg = model_sweep.compare([1.0, 0.91], {"w": ref["w"]}, [1.0, 0.9], ref)
    assert not ok and "step 1 loss" in msg


def test_compare_accepts_rounding_noise_that_plain_fp32_has_too():
    # plain fp32 is 1e-4 away from fp64 in this tensor (noise, e.g. Adam on a zero-in-theory gradient);
    # megatrain, 5e-5 away from plain fp32 in another element, is within that noise ...
    ref64 = {"w": torch.linspace(-1, 1, 64, dtype=torch.float64)}
    ref = {"w": ref64["w"].float()}
    ref["w"][3] += 1e-4
    got = {"w": ref["w"].clone()}
    got["w"][9] += 5e-5
    assert not model_sweep.compare([1.0], got, [1.0], ref)[0]
    assert model_sweep.compare([1.0], got, [1.0], ref, [1.0], ref64)[0]
    # ... but not 10x beyond it
    got["w"][9] += 1e-3
    assert not model_sweep.compare([1.0], got, [1.0], ref, [1.0], ref64)[0]


def test_run_type_classifies_refusal_failure_and_skip(monkeypatch):
    import megatrain

    real_wrap = megatrain.wrap

    def refuse(model, **kw):
        raise megatrain.UnsupportedModelError("megatrain.wrap: LlamaForCausalLM is not supported here")

    monkeypatch.setattr(megatrain, "wrap", refuse)
    r = run_type("llama")
    assert (r.status, r.detail) == ("refused", "megatrain.wrap: LlamaForCausalLM is not supported here")

    # an update that differs from torch's AdamW (weight decay off) is a parity miss
    monkeypatch.setattr(megatrain, "wrap", real_wrap)
    monkeypatch.setattr(model_sweep, "WD", 0.0)
    real_plain = model_sweep.train_plain

    def plain_with_decay(model, batches, dtype=torch.float32):
        monkeypatch.setattr(model_sweep, "WD", 0.1)
        try:
            return real_plain(model, batches, dtype)
        finally:
            monkeypatch.setattr(model_sweep, "WD", 0.0)

    monkeypatch.setattr(model_sweep, "train_plain", plain_with_decay)
    r = run_type("llama")
    assert r.status == "fail" and r.detail.startswith("parity: "), r

    def plain_fails(model, batches, dtype=torch.float32):
        raise ValueError("needs pixel_values")

    monkeypatch.setattr(model_sweep, "train_plain", plain_fails)
    r = run_type("llama")
    assert (r.status, r.detail) == ("skipped", "plain PyTorch does not train it here: ValueError: needs pixel_values")
