"""CPU parity for model families beyond the plain decoder: multimodal wrappers, per-layer configs, hybrid
(attention + state-space) decoders; and the one-line refusals of models megatrain cannot stream.

fp32 on the CPU, megatrain against the same model trained with plain PyTorch + ``torch.optim.AdamW``:
the loss of every step and every parameter after the last step within ``RTOL`` relative (elements
near zero held to the tensor's scale, as :func:`parity.assert_close_rel` does).
"""

import copy
import json
import os

import pytest
import torch
import transformers

import megatrain
from parity import make_batches, train_megatrain, train_reference

RTOL = 1e-6
STEPS = 4


def _seeded(cfg):
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # (the fp64 reference: torch's grouped_mm takes no float64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def tiny_gemma3():
    """A Gemma3ForConditionalGeneration (the causal-LM mapping's ``gemma3``): 2 text layers, 1 vision layer."""
    from transformers import Gemma3Config

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
                       boi_token_index=93, eoi_token_index=94)
    return _seeded(cfg)


def run_pair(model, *, steps=STEPS, micro_batches=1, max_grad_norm=1.0, seq=16, **wrap_kw):
    """Train copies of ``model`` with plain PyTorch in fp32 and in fp64, and ``model`` with megatrain, on
    the same batches: ``(fp32 reference, fp64 reference, megatrain result, wrapped model, optimizer)``."""
    vocab = model.config.get_text_config().vocab_size
    batches = make_batches(vocab - 8, steps, micro_batches, 2, seq, seed=1)  # below any special token id
    kw = dict(lr=1e-3, wd=0.1, betas=(0.9, 0.95), max_grad_norm=max_grad_norm, groups="one")
    ref = train_reference(copy.deepcopy(model), batches, **kw)
    exact = train_reference(copy.deepcopy(model).double(), batches, **kw)
    got, wrapped, opt = train_megatrain(model, batches, **kw, **wrap_kw)
    return ref, exact, got, wrapped, opt


def check(ref, exact, got, rtol=RTOL):
    """Every step's loss and every parameter element of ``got`` within ``rtol`` relative of the fp32
    reference ``ref`` (elements near zero held to the tensor's scale), or, where fp32 rounding alone
    moves an element further (Adam's m / sqrt(v) enlarges the ulps of a near-zero gradient), no
    further from the fp64 run ``exact`` than twice the fp32 reference's own worst distance from it
    in that tensor."""
    assert len(got.losses) == len(ref.losses)
    for i, (a, b, e) in enumerate(zip(got.losses, ref.losses, exact.losses)):
        assert abs(a - b) <= rtol * abs(b) or abs(a - e) <= 2 * abs(b - e) + rtol * abs(e), \
            f"step {i}: loss {a} vs reference {b} (fp64 {e})"
    assert set(got.params) >= set(ref.params)
    for name, b in ref.params.items():
        a, b, e = got.params[name].double(), b.double(), exact.params[name].double()
        direct = (a - b).abs() <= rtol * b.abs() + rtol * float(b.abs().max())
        noise = float((b - e).abs().max())
        judged = (a - e).abs() <= 2 * noise + rtol * e.abs()
        bad = ~(direct | judged)
        assert not bool(bad.any()), (f"{name}: {int(bad.sum())} elements off; max |got-ref32| "
                                     f"{float((a - b).abs().max()):.3e}, max |got-ref64| {float((a - e).abs().max()):.3e}, "
                                     f"fp32 reference's own max |ref32-ref64| {noise:.3e}")


def test_gemma3_conditional_generation_trains_with_parity(tmp_path):
    """gemma3 in the causal-LM mapping is Gemma3ForConditionalGeneration: its text model reads
    text_config.use_cache (the top-level config has none), so wrap must turn that one off too."""
    model = tiny_gemma3()
    assert model.config.text_config.use_cache is True
    ref, exact, got, wrapped, _ = run_pair(model, micro_batches=2)
    check(ref, exact, got)
    assert wrapped.config.text_config.use_cache is False
    x = torch.randint(0, 80, (1, 8))
    assert wrapped(input_ids=x, labels=x).past_key_values is None  # no cache built in training
    wrapped.save_pretrained(tmp_path / "hf")  # the user's flags are saved, training keeps them off
    with open(tmp_path / "hf" / "config.json") as f:
        assert json.load(f)["text_config"]["use_cache"] is True
    assert wrapped.config.text_config.use_cache is False


def tiny_dots3():
    """A 2-layer Dots 3 text model: a heterogeneous config whose sliding-attention layers have their own
    head counts and MLA ranks (transformers raises on a global read of ``num_attention_heads``)."""
    mod = pytest.importorskip("transformers.models.dots3_note.configuration_dots3_note")
    cfg = mod.Dots3NoteTextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        layer_types=["indexed_attention", "sliding_attention"], mlp_layer_types=["dense", "sparse"],
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=4, v_head_dim=8, qk_nope_head_dim=8, head_dim=12, index_topk=8,
        index_head_dim=8, index_n_heads=2, sliding_window=8, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, shared_experts_intermediate_size=16, use_sliding_window=True,
        swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=16, swa_kv_lora_rank=8,
        swa_head_dim=12, swa_qk_nope_head_dim=8, swa_v_head_dim=8)
    return _seeded(cfg)


class _RefusesGlobalHeads(transformers.LlamaConfig):
    """A Llama config that refuses a global read of ``num_attention_heads``, as transformers' heterogeneous
    (per-layer) configs do, once ``_per_layer`` is set (after the model has been built from it)."""

    def __getattribute__(self, key):
        if key == "num_attention_heads" and object.__getattribute__(self, "__dict__").get("_per_layer"):
            raise RuntimeError("'num_attention_heads' is a per-layer attribute and may vary across layers")
        return super().__getattribute__(key)


def test_config_refusing_a_global_per_layer_attribute_trains():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = _seeded(cfg)
    model.config.__class__ = _RefusesGlobalHeads
    model.config._per_layer = True
    est = megatrain.estimate(model, device="cpu", micro_batch_size=2, seq_len=4096)  # reads shapes from the config
    assert est.activation_bytes > 0
    ref, exact, got, _, _ = run_pair(model, steps=2)  # the forward's long-context check read the heads
    check(ref, exact, got)


@pytest.mark.slow
def test_per_layer_config_attributes_train_with_parity():
    model = tiny_dots3()
    with pytest.raises(Exception, match="per-layer attribute"):
        model.config.num_attention_heads  # noqa: B018 - what megatrain must not read globally
    ref, exact, got, wrapped, _ = run_pair(model, steps=3)
    check(ref, exact, got)
    est = megatrain.estimate(tiny_dots3().config, device="cpu", micro_batch_size=2, seq_len=4096)  # reads the config
    assert est.activation_bytes > 0 and est.num_layers == 2
