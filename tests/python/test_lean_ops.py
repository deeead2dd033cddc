"""Lean activations (megatrain.runtime.activations.lean_ops): less kept for backward, the same gradients bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import megatrain
from megatrain.runtime.activations.lean_ops import lean_kind
from parity import PARITY_EPS, make_batches


def _llama(hidden=64, inter=176, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    return transformers.LlamaForCausalLM(cfg)


def _saved_bytes_per_token(layer_module_forward, tokens):
    """Bytes of distinct storages the autograd graph of one call keeps (weights excluded), per token."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer_module_forward()
    return sum(seen.values()) / tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_layer_keeps_less_and_gives_identical_gradients(dtype):
    _check_lean_layer("cpu", dtype)


@pytest.mark.cuda
def test_lean_layer_keeps_less_and_gives_identical_gradients_cuda():
    _check_lean_layer("cuda", torch.bfloat16)


def _check_lean_layer(device, dtype):
    # One decoder layer of a wrapped model, called with grad on its streamed weights: the kept
    # tensors shrink (Llama shapes scaled down: hidden 64, intermediate 176, 4 heads) and every
    # gradient (input and weights) is torch.equal to the plain graph's.
    results = {}
    for lean in (False, True):
        model = megatrain.wrap(_llama(), device=device, compute_dtype=dtype, lean_activations=lean,
                               liger_kernel=False)  # the lean forms of the model's own modules
        eng = model.megatrain
        unit = eng.layers[1]
        layer = unit.module
        assert layer.mlp._megatrain_lean == "gated"
        assert [n._megatrain_lean for n in (layer.input_layernorm, layer.post_attention_layernorm)] == ["norm"] * 2
        b, t = 2, 16
        g = torch.Generator().manual_seed(1)
        x = torch.randn(b, t, 64, generator=g).to(device, dtype).requires_grad_(True)
        go = torch.randn(b, t, 64, generator=g).to(device, dtype)
        pos = torch.arange(t, device=device)[None].expand(b, t)
        cos, sin = model.model.rotary_emb(x, pos)
        slot = eng.acquire(unit)
        bound = eng.bind(unit, slot.buf, requires_grad=True)
        try:
            out = {}

            def run():
                out["y"] = layer._megatrain_orig_forward(x, position_embeddings=(cos, sin), attention_mask=None,
                                                         position_ids=pos)
            per_token = _saved_bytes_per_token(run, b * t)
            y = out["y"][0] if isinstance(out["y"], tuple) else out["y"]
            grads = torch.autograd.grad(y, [x] + list(bound), go, allow_unused=True)
        finally:
            eng.unbind(unit)
            eng.release(slot)
        results[lean] = (y.detach(), [None if g_ is None else g_.clone() for g_ in grads], per_token)
    (y0, g0, plain), (y1, g1, lean) = results[False], results[True]
    assert torch.equal(y0, y1)
    assert len(g0) == len(g1) and all((a is None and b_ is None) or torch.equal(a, b_) for a, b_ in zip(g0, g1))
    print(f"{device} {dtype}: kept per token plain {plain:.0f} B, lean {lean:.0f} B")
    # per token (hidden 64, intermediate 176, element size e): act(gate) (176 e) is no longer kept;
    # in bf16 also each norm's fp32 input copy (64 x 4 B), normalised rows (64 e) and rsqrt (4 B),
    # while each norm now keeps its input (64 e; the first one's is the layer input, held anyway)
    e = torch.tensor([], dtype=dtype).element_size()
    expect = 176 * e + (2 * (64 * 4 + 64 * e + 4) - 2 * 64 * e if dtype != torch.float32 else 0)
    assert plain - lean == expect, (plain, lean, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", ["store", "recompute"])
def test_lean_training_equals_plain_training_bit_for_bit(policy, dtype):
    # 3 steps with clipping and 2 micro-batches: losses and every fp32 master equal with
    # lean_activations on and off (the default policy and the kept-graph one; in fp32 the norms
    # run as written, in bf16 they are recomputed too).
    base = _llama(layers=3)
    batches = make_batches(96, steps=3, micro_batches=2, batch=2, seq=12, seed=3)
    out = {}
    for lean in (False, True):
        model = megatrain.wrap(copy.deepcopy(base), device="cpu", compute_dtype=dtype, activation_policy=policy,
                               lean_activations=lean)
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS,
                                       max_grad_norm=0.5, gradient_accumulation_steps=2)
        losses = []
        for micro in batches:
            for x in micro:
                loss = model(input_ids=x, labels=x).loss / 2
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out[lean] = (losses, megatrain.master_state_dict(model), opt.last_grad_norm)
    (l0, s0, n0), (l1, s1, n1) = out[False], out[True]
    assert l0 == l1 and n0 == n1
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)


def test_lean_is_off_for_modules_it_does_not_know():
    # A gated MLP whose forward differs from Llama's (here: a scale) runs as written; nn.LayerNorm
    # keeps its fused kernel; lean_activations must be a bool.
    class ScaledMLP(transformers.models.llama.modeling_llama.LlamaMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, vocab_size=96)
    assert lean_kind(transformers.models.llama.modeling_llama.LlamaMLP(cfg), is_norm=False) == "gated"
    assert lean_kind(ScaledMLP(cfg), is_norm=False) is None
    assert lean_kind(torch.nn.LayerNorm(32), is_norm=True) is None
    with pytest.raises(ValueError, match="lean_activations must be True or False"):
        megatrain.wrap(_llama(), device="cpu", lean_activations="yes")
