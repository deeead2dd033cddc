"""Liger-Kernel on a wrapped model (``wrap(liger_kernel=None | True | False)``, ``megatrain.runtime.model.fused_kernels``).

liger-kernel (Triton) runs only on CUDA and is not installed here: a fake ``liger_kernel`` package is put
in ``sys.modules``. Its ``_apply_liger_kernel_to_instance`` dispatches on ``model.config.model_type``
like the real one, and its Llama patch binds forwards on the instance's modules exactly as Liger's
``_bind_method_to_module`` does (``module.__dict__["forward"] = ...``), with the model's own math,
counted. The tests check when and with what it is called, that the streamed layers run the bound
forwards (tiling still in force), that training gives the same result, and the switches.
"""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

import megatrain
from megatrain.runtime.model import fused_kernels as kernels

wrap_mod = importlib.import_module("megatrain.runtime.model.wrap")
wrap_options_mod = importlib.import_module("megatrain.runtime.wrap_options")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


class FakeLiger:
    """What the fake package recorded: each apply call and each bound forward's calls."""

    def __init__(self):
        self.calls = []
        self.count = {"mlp": 0, "norm": 0}


def _rms_forward(self, hidden_states):  # LlamaRMSNorm.forward's math
    FAKE.count["norm"] += 1
    dtype = hidden_states.dtype
    h = hidden_states.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(dtype)


def _swiglu_forward(self, x):  # LlamaMLP.forward's math
    FAKE.count["mlp"] += 1
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _apply_to_llama(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                    model=None):
    base = getattr(model, model.base_model_prefix, model)
    FAKE.calls.append(dict(model=model, kwargs=dict(rope=rope, fused_linear_cross_entropy=fused_linear_cross_entropy),
                           engine_built=getattr(model, "megatrain", None) is not None,
                           layer_classes=[type(m).__name__ for m in base.layers]))
    for layer in base.layers:
        if swiglu:
            layer.mlp.__dict__["forward"] = _swiglu_forward.__get__(layer.mlp, type(layer.mlp))
        if rms_norm:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.__dict__["forward"] = _rms_forward.__get__(norm, type(norm))


def _apply_liger_kernel_to_instance(model, **kwargs):
    fn = _monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(getattr(model.config, "model_type", None))
    if fn is not None:
        fn(model=model, **kwargs)


FAKE = FakeLiger()
_pkg = types.ModuleType("liger_kernel")
_pkg.__path__ = []
_transformers = types.ModuleType("liger_kernel.transformers")
_transformers.__path__ = []
_monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
_monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": _apply_to_llama}
_transformers._apply_liger_kernel_to_instance = _apply_liger_kernel_to_instance
_transformers.monkey_patch = _monkey_patch
_pkg.transformers = _transformers


@pytest.fixture
def liger(monkeypatch):
    """The fake liger_kernel importable (``liger_installed()`` True); a fresh record."""
    global FAKE
    FAKE = FakeLiger()
    for name, mod in (("liger_kernel", _pkg), ("liger_kernel.transformers", _transformers),
                      ("liger_kernel.transformers.monkey_patch", _monkey_patch)):
        monkeypatch.setitem(sys.modules, name, mod)
    return FAKE


@pytest.fixture
def no_liger(monkeypatch):
    monkeypatch.delitem(sys.modules, "liger_kernel", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "liger_kernel" else real(name, *a, **k))


@pytest.fixture
def as_on_cuda(monkeypatch):
    """``wrap`` decides as on a CUDA device with liger-kernel installed (None: on), on the CPU backend."""
    real = kernels.resolve_liger_kernel
    monkeypatch.setattr(wrap_options_mod, "resolve_liger_kernel",
                        lambda value, device, *a: real(value, torch.device("cuda", 0), *a))


def _batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 96, (2, 8), generator=g)
    return x


def _train(model, steps=3):
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    x, losses = _batch(), []
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, megatrain.master_state_dict(model)


# ------------------------------------------------------------------ resolve: the switch
def test_auto_is_on_with_liger_installed_on_cuda_only(liger):
    assert kernels.resolve_liger_kernel(None, torch.device("cuda", 0)) is True
    assert kernels.resolve_liger_kernel(None, torch.device("cpu")) is False
    assert kernels.resolve_liger_kernel(False, torch.device("cuda", 0)) is False
    assert kernels.resolve_liger_kernel(True, torch.device("cuda", 0)) is True


def test_auto_is_off_without_liger(no_liger):
    assert kernels.resolve_liger_kernel(None, torch.device("cuda", 0)) is False


def test_required_without_liger_raises_one_line(no_liger):
    with pytest.raises(ValueError) as info:
        kernels.resolve_liger_kernel(True, torch.device("cuda", 0))
    msg = str(info.value)
    assert "\n" not in msg and msg == ("megatrain.wrap: liger_kernel=True, but liger-kernel is not installed: pip install "
                                       "liger-kernel (the 'kernels' extra), or pass liger_kernel=None (used when installed)")
    model = _model()  # off CUDA the device is the first reason, installed or not
    with pytest.raises(ValueError, match=r"^megatrain.wrap: liger_kernel=True needs a CUDA device"):
        megatrain.wrap(model, device="cpu", liger_kernel=True)
    assert getattr(model, "megatrain", None) is None


@pytest.mark.parametrize("installed", [False, True])
def test_cli_liger_kernel_true_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                                 installed):
    from parity import run_cli

    monkeypatch.setattr(kernels, "liger_installed", lambda: installed)
    out = tmp_path / "out"
    for extra in ([], ["--dry-run"]):
        code, _, err = run_cli(["train", "--liger-kernel", "true", "--device", "cpu", "--steps", "1", "--out", str(out),
                                *extra], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and not out.exists(), lines
        assert lines[0] == ("megatrain: error: runtime.liger_kernel=true needs a CUDA device (Liger's kernels are "
                            "Triton kernels), the run's is 'cpu'; use --liger-kernel auto (on when installed and on CUDA)")


def test_required_on_cpu_raises_one_line(liger):
    with pytest.raises(ValueError, match=r"^megatrain.wrap: liger_kernel=True needs a CUDA device \(Liger's kernels are "
                                         r"Triton kernels\), got 'cpu'; pass liger_kernel=None or False$"):
        megatrain.wrap(_model(), device="cpu", liger_kernel=True)
    assert not liger.calls


@pytest.mark.parametrize("bad", ["auto", 1, 0, "yes"])
def test_bad_switch_raises_one_line(bad):
    with pytest.raises(ValueError, match=r"^megatrain.wrap: liger_kernel must be None \(on when liger-kernel is installed"):
        megatrain.wrap(_model(), device="cpu", liger_kernel=bad)


def test_cpu_default_applies_nothing(liger):
    model = megatrain.wrap(_model(), device="cpu")
    try:
        assert not liger.calls and model.megatrain.placement()["liger_kernel"] is None
        assert all("forward" not in vars(m) for m in model.model.layers.modules())
    finally:
        model.megatrain.close()


def test_false_disables_even_where_auto_would_apply(liger, as_on_cuda):
    model = megatrain.wrap(_model(), device="cpu", liger_kernel=False)
    model.megatrain.close()
    assert not liger.calls


# ------------------------------------------------------------------ apply: when, what, and that it runs
def test_auto_applies_liger_once_to_the_model_before_the_engine_is_built(liger, as_on_cuda):
    model = _model()
    wrapped = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
    try:
        assert len(liger.calls) == 1
        call = liger.calls[0]
        assert call["model"] is model and call["kwargs"] == dict(rope=True, fused_linear_cross_entropy=True)  # Liger's defaults
        assert not call["engine_built"] and call["layer_classes"] == ["LlamaDecoderLayer"] * 3
        assert wrapped.megatrain.placement()["liger_kernel"] == dict(applied=True, model_type="llama", reason=None)
        with torch.no_grad():
            wrapped(input_ids=_batch())
        assert liger.count["mlp"] == 3 and liger.count["norm"] == 6  # the streamed layers ran the bound forwards
    finally:
        wrapped.megatrain.close()


def test_unsupported_architecture_is_skipped_under_auto_and_refused_when_required(liger, as_on_cuda, monkeypatch):
    monkeypatch.setattr(_monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {})
    model = megatrain.wrap(_model(), device="cpu")
    try:
        assert not liger.calls
        assert model.megatrain.placement()["liger_kernel"]["applied"] is False
    finally:
        model.megatrain.close()
    with pytest.raises(ValueError, match=r"^megatrain.wrap: liger_kernel=True, but liger-kernel has no kernels for "
                                         r"model_type 'llama'; pass liger_kernel=None \(used where supported\) or False$"):
        megatrain.wrap(_model(), device="cpu", liger_kernel=True)


def test_tiling_stays_in_force_with_liger_forwards(liger, as_on_cuda):
    """tile_mlp=5 rows over 16 tokens: each MLP call runs 4 tiles, through Liger's bound forward."""
    wrapped = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, tile_mlp=5)
    try:
        with torch.no_grad():
            wrapped(input_ids=_batch())
        assert liger.count["mlp"] == 3 * 4
        assert wrapped.megatrain.long_context.last["mlp_tiled_calls"] == 3
    finally:
        wrapped.megatrain.close()


@pytest.mark.parametrize("policy, tile", [("recompute", 5), ("store", False)])
def test_training_with_liger_forwards_matches_without(liger, as_on_cuda, policy, tile):
    """The fake's forwards are the model's own math: losses and fp32 masters must agree exactly."""
    ref = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, activation_policy=policy, tile_mlp=tile,
                         liger_kernel=False)
    try:
        want_losses, want = _train(ref, steps=2)
    finally:
        ref.megatrain.close()
    assert liger.count["mlp"] == 0
    got_model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, activation_policy=policy,
                               tile_mlp=tile)
    try:
        got_losses, got = _train(got_model, steps=2)
    finally:
        got_model.megatrain.close()
    assert liger.count["mlp"] > 0 and liger.count["norm"] > 0
    assert got_losses == want_losses
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0)


@pytest.mark.parametrize("use_liger", [False, True])
def test_lean_activations_leave_liger_modules_to_liger(liger, as_on_cuda, monkeypatch, use_liger):
    """lean_activations=True: without Liger the norms and MLP run lean_ops' forms; with Liger its bound
    forwards (which keep what the lean forms keep) run instead, in forward and in the backward re-run."""
    from megatrain.runtime.activations import tiling

    lean_calls = []
    real = tiling.lean_forward
    monkeypatch.setattr(tiling, "lean_forward", lambda m, x: lean_calls.append(m) or real(m, x))
    wrapped = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, lean_activations=True,
                             liger_kernel=None if use_liger else False)
    try:
        _train(wrapped, steps=1)
    finally:
        wrapped.megatrain.close()
    if use_liger:
        assert not lean_calls and liger.count["mlp"] >= 3 and liger.count["norm"] >= 6
    else:
        assert len(lean_calls) >= 9 and liger.count["mlp"] == 0


# ------------------------------------------------------------------ the Hugging Face Trainer's use_liger_kernel
def test_trainer_use_liger_kernel_patches_the_wrapped_model_and_trains(liger, monkeypatch, tmp_path):
    """``TrainingArguments(use_liger_kernel=True)``: the Trainer calls Liger's
    ``_apply_liger_kernel_to_instance(model=...)`` on the wrapped model; the bound forwards then run in
    the streamed layers (tiled MLP still tiled) and training matches the run without it."""
    pytest.importorskip("accelerate")
    import transformers
    from transformers import TrainingArguments

    from megatrain.integrations import MegatrainTrainer

    for mod in ("transformers.trainer", "transformers.integrations.liger"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        if hasattr(m, "is_liger_kernel_available"):
            monkeypatch.setattr(m, "is_liger_kernel_available", lambda: True)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, 96, (8, 8), generator=g)]

    def run(use_liger):
        model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, tile_mlp=5, liger_kernel=False)
        args = TrainingArguments(output_dir=str(tmp_path / str(use_liger)), per_device_train_batch_size=2, max_steps=3,
                                 learning_rate=1e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                 seed=7, dataloader_num_workers=0, disable_tqdm=True, use_liger_kernel=use_liger)
        losses = []
        model.register_forward_hook(lambda m, a, out: losses.append(out.loss.item()) if m.training else None)
        tr = MegatrainTrainer(model=model, args=args, train_dataset=data)
        tr.train()
        out = megatrain.master_state_dict(model)
        model.megatrain.close()
        return losses, out

    want_losses, want = run(False)
    assert not liger.calls
    got_losses, got = run(True)
    assert len(liger.calls) == 1 and liger.calls[0]["engine_built"]  # the Trainer's call, on the wrapped model
    assert liger.calls[0]["layer_classes"] == ["StreamedLlamaDecoderLayer"] * 3
    assert liger.count["mlp"] > 0 and liger.count["mlp"] % 4 == 0  # every MLP call through 4 tiles
    assert got_losses == want_losses
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0)
    assert transformers.__version__  # (the Trainer of this transformers version was the one exercised)


# ------------------------------------------------------------------ other models in the process
def test_liger_global_patches_do_not_reach_other_models(liger, as_on_cuda, monkeypatch):
    """Liger's apply also replaces classes and ``apply_rotary_pos_emb`` in ``modeling_llama`` (global:
    a CPU model built afterwards would get Triton kernels that fail on CPU tensors). After ``wrap`` the
    classes are the originals and the function runs Liger's kernel only for CUDA tensors."""
    from transformers.models.llama import modeling_llama as ml

    orig_norm, orig_rope = ml.LlamaRMSNorm, ml.apply_rotary_pos_emb
    monkeypatch.setattr(ml, "LlamaRMSNorm", ml.LlamaRMSNorm)  # restored at teardown whatever wrap does
    monkeypatch.setattr(ml, "apply_rotary_pos_emb", ml.apply_rotary_pos_emb)

    class GlobalNorm(orig_norm):
        pass

    def liger_rope(*a, **k):
        raise RuntimeError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")

    def apply_with_globals(model=None, **kw):
        ml.LlamaRMSNorm, ml.apply_rotary_pos_emb = GlobalNorm, liger_rope  # what Liger's apply_liger_kernel_to_llama does
        _apply_to_llama(model=model, **kw)

    monkeypatch.setitem(_monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "llama", apply_with_globals)
    torch.manual_seed(0)
    other = _model()
    x = _batch()
    with torch.no_grad():
        expected = other(input_ids=x).logits
    wrapped = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    try:
        assert ml.LlamaRMSNorm is orig_norm
        assert ml.apply_rotary_pos_emb is not liger_rope and ml.apply_rotary_pos_emb._megatrain_original is orig_rope
        with torch.no_grad():
            assert torch.equal(other(input_ids=x).logits, expected)  # a CPU model keeps the original RoPE
        torch.manual_seed(0)
        fresh = _model()
        assert not any(isinstance(m, GlobalNorm) for m in fresh.modules())
        monkeypatch.setattr(kernels, "_on_cuda", lambda args, kwargs: True)  # as for CUDA tensors:
        with pytest.raises(RuntimeError, match="Triton"):                     # Liger's kernel is called
            ml.apply_rotary_pos_emb(x.float(), x.float(), x.float(), x.float())
    finally:
        wrapped.megatrain.close()
