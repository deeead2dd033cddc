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
from parity import PARITY_EPS, make_batches, param_groups, train_megatrain, train_reference

RTOL = 1e-6
STEPS = 4


def _seeded(cfg):
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # (the fp64 reference: torch's grouped_mm takes no float64)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def tiny_gemma3(vision_hidden=16):
    """A Gemma3ForConditionalGeneration (the causal-LM mapping's ``gemma3``): 2 text layers, 1 vision layer."""
    from transformers import Gemma3Config

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
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


def check_checkpoint_round_trip(build, wrapped, opt, directory, micro_batches):
    """Save ``wrapped``'s training state, load it into a freshly wrapped ``build()``: masters, Adam moments
    and step counts bit-identical."""
    megatrain.state.checkpoint.save_checkpoint(str(directory), wrapped, opt)
    fresh = megatrain.wrap(build(), device="cpu", compute_dtype=torch.float32)
    opt2 = megatrain.optim.CPUAdamW(param_groups(fresh, "one", 1e-3, 0.1), lr=1e-3, betas=(0.9, 0.95),
                                    weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=1.0,
                                    gradient_accumulation_steps=micro_batches)
    megatrain.state.checkpoint.load_checkpoint(str(directory), fresh, opt2)
    a, b = megatrain.master_state_dict(wrapped), megatrain.master_state_dict(fresh)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(list(fresh.parameters()))
    for k in sa:
        for key, v in sa[k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb[k][key])), (k, key)


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


def test_gemma4_conditional_generation_trains_with_parity():
    """gemma4 (Gemma4ForConditionalGeneration, text only): per-layer input embeddings, a text_config.use_cache."""
    pytest.importorskip("transformers.models.gemma4")
    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
                vocab_size_per_layer_input=96, hidden_size_per_layer_input=8, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)
    model = _seeded(transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None))
    assert model.config.text_config.use_cache is True
    ref, exact, got, wrapped, _ = run_pair(model, steps=3, micro_batches=2)
    check(ref, exact, got)
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


def test_per_layer_config_attributes_train_with_parity():
    model = tiny_dots3()
    with pytest.raises(Exception, match="per-layer attribute"):
        model.config.num_attention_heads  # noqa: B018 - what megatrain must not read globally
    ref, exact, got, wrapped, _ = run_pair(model, steps=3)
    check(ref, exact, got)
    est = megatrain.estimate(tiny_dots3().config, device="cpu", micro_batch_size=2, seq_len=4096)  # reads the config
    assert est.activation_bytes > 0 and est.num_layers == 2


def tiny_jamba():
    """A 4-layer Jamba: attention at layer 1, Mamba elsewhere (two layer classes), MoE at layers 1 and 3."""
    cfg = transformers.JambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
        expert_layer_period=2, expert_layer_offset=1, attn_layer_period=4, attn_layer_offset=1,
        use_mamba_kernels=False, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _seeded(cfg)


def tiny_bamba():
    """A 3-layer Bamba: Mamba-2 layers and one attention layer (one class, two structures)."""
    cfg = transformers.BambaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_layer_indices=[1], mamba_n_heads=4,
        mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return _seeded(cfg)


def tiny_olmo_hybrid():
    """A 2-layer OLMo hybrid: a gated-delta-net (linear attention) layer, then an attention layer (two classes)."""
    cfg = transformers.OlmoHybridConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _seeded(cfg)


@pytest.mark.parametrize("family", ["jamba", "bamba", "olmo_hybrid"])
def test_hybrid_decoder_streams_every_layer_with_parity(family, tmp_path):
    build = {"jamba": tiny_jamba, "bamba": tiny_bamba, "olmo_hybrid": tiny_olmo_hybrid}[family]
    model = build()
    name, layers = megatrain.runtime.find_decoder_layers(model)
    assert name == "model.layers"
    ref, exact, got, wrapped, opt = run_pair(model, steps=3, micro_batches=2)
    check(ref, exact, got)
    check_checkpoint_round_trip(build, wrapped, opt, tmp_path / "ckpt", 2)
    structures = {u.template for u in wrapped.megatrain.layers}
    assert len(structures) >= 2 and set(wrapped.megatrain.slots) >= structures  # one slot pool per structure


def test_reversible_layers_are_refused_at_wrap():
    """Reformer's reversible layers run their own backward (from their outputs) on the layers' weights:
    on streamed placeholders that failed at the first backward ("Tensor on device meta")."""
    cfg = transformers.ReformerConfig(
        vocab_size=96, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        attn_layers=["local", "local"], axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=8,
        is_decoder=True, pad_token_id=0, eos_token_id=2)
    model = _seeded(cfg)
    with pytest.raises(megatrain.UnsupportedModelError, match=r"reformer\.encoder\.layers \(ReformerLayer\) runs its "
                       r"own backward .*train this model without megatrain$"):
        megatrain.wrap(model, device="cpu")
    assert all(p.device.type == "cpu" for p in model.parameters())  # refused before anything changed
    assert getattr(model, "megatrain", None) is None


class _IndexedOnly(torch.nn.Module):
    """A list of blocks that the forward never loops over (it calls one by index): no decoder list."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        return self.blocks[0](x)


class _Looped(_IndexedOnly):
    """The same blocks, plus a larger adapter list only called by index, and a loop over the blocks."""

    def __init__(self):
        super().__init__()
        self.adapters = torch.nn.ModuleList([torch.nn.Linear(4, 64) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.adapters[0](x)


def test_decoder_list_is_the_one_the_forward_loops_over():
    with pytest.raises(megatrain.UnsupportedModelError, match="_IndexedOnly has no repeated decoder layer list"):
        megatrain.wrap(_IndexedOnly(), device="cpu")
    name, _ = megatrain.runtime.find_decoder_layers(_Looped())
    assert name == "blocks"  # not the larger adapter list (Zamba2's adapters were streamed in its place)
    assert megatrain.runtime.find_decoder_layers(_IndexLooped())[0] == "blocks"
    # a multimodal model whose vision encoder outweighs its text decoder: the decoder is get_decoder()'s
    assert megatrain.runtime.find_decoder_layers(tiny_gemma3(vision_hidden=128))[0] == "model.language_model.layers"


class _IndexLooped(_IndexedOnly):
    """Blocks called by the loop variable's index (XLM's per-sublayer lists)."""

    n_layers = 3

    def forward(self, x):
        for i in range(self.n_layers):
            x = self.blocks[i](x)
        return x


def tiny_zamba2(num_mem_blocks=1):
    """A 4-layer Zamba 2: Mamba-2 layers and hybrid layers that all call one shared transformer block (each
    with adapters of its own inside that block)."""
    cfg = transformers.Zamba2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=4,
        num_mem_blocks=num_mem_blocks, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _seeded(cfg)


def test_zamba2_streams_its_decoder_with_a_shared_block_with_parity(tmp_path, steps=3, micro_batches=2):
    model = tiny_zamba2()
    assert megatrain.runtime.find_decoder_layers(model)[0] == "model.layers"  # not the adapter list
    ref, exact, got, wrapped, opt = run_pair(model, steps=steps, micro_batches=micro_batches)
    check(ref, exact, got)
    check_checkpoint_round_trip(tiny_zamba2, wrapped, opt, tmp_path / "ckpt", micro_batches)
    eng = wrapped.megatrain
    assert [u.module for u in eng.layers] == list(wrapped.model.layers)  # every decoder layer streamed
    assert all(p.device.type == "meta" for p in wrapped.model.layers[0].parameters())
    shared = [u.index for u in eng.layers if u.shared]
    assert shared == [1, 3]  # the hybrid layers use the shared block, resident
    sd = wrapped.state_dict()  # the shared block under each layer's name, as torch's
    assert sd.keys() == tiny_zamba2().state_dict().keys()
    assert sd["model.layers.1.shared_transformer.self_attn.q_proj.weight"] is \
        sd["model.layers.3.shared_transformer.self_attn.q_proj.weight"] or torch.equal(
            sd["model.layers.1.shared_transformer.self_attn.q_proj.weight"],
            sd["model.layers.3.shared_transformer.self_attn.q_proj.weight"])
