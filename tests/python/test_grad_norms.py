"""The per-layer gradient norms of ``submit_grads``: one fused ``torch._foreach_norm`` launch on CUDA
(``Options.fused_grad_norms``), one ``vector_norm`` per tensor on the CPU (bit-identical to before)."""

import copy

import pytest
import torch
import transformers

import megatrain
from megatrain.runtime.engine.grads import grad_norms
from megatrain.runtime.options import options_set


def _layer_like(device, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(1)
    shapes = [(96, 64), (32, 64), (32, 64), (64, 64), (17,), (5, 3, 7)]  # remainders on purpose
    return [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_norms_are_per_tensor_vector_norms_bit_for_bit(dtype):
    ts = _layer_like("cpu", dtype)
    want = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in ts])
    for fused in (True, False):
        got = grad_norms(ts, fused)
        assert got.dtype == torch.float64 and got.shape == (len(ts),)
        assert torch.equal(got, want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fused_norms_match_per_tensor(dtype):
    ts = _layer_like("cuda", dtype) + [torch.randn(3072, 8192, device="cuda").to(dtype)]
    fused, per = grad_norms(ts, True), grad_norms(ts, False)
    assert fused.dtype == torch.float64 and fused.device.type == "cuda" and fused.shape == (len(ts),)
    rel = ((fused ** 2 - per ** 2).abs() / per ** 2).max().item()
    print(f"\nmax relative difference of the squared norms, fused vs per tensor: {rel:.3e}")
    assert rel < 1e-5, rel


@pytest.mark.cuda
def test_cuda_clipping_norm_is_the_same_with_and_without_fused_norms():
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(5)).cuda()
    runs = {}
    for fused in (True, False):
        with options_set(fused_grad_norms=fused):
            m = megatrain.wrap(copy.deepcopy(model), device="cuda", compute_dtype=torch.bfloat16)
        assert m.megatrain.fused_grad_norms is fused
        opt = megatrain.optim.CPUAdamW(m.parameters(), lr=1e-3, max_grad_norm=0.5)
        norms, losses = [], []
        for _ in range(3):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            norms.append(opt.last_grad_norm)
            losses.append(loss.item())
        m.megatrain.close()
        runs[fused] = norms, losses
    print(f"\nclip norms fused {runs[True][0]} per tensor {runs[False][0]}")
    # step 1 starts from the same weights: only the summation order differs
    assert runs[True][0][0] > 0.5 and abs(runs[True][0][0] - runs[False][0][0]) <= 1e-5 * runs[False][0][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert abs(a - b) <= 1e-3 * abs(b), (runs[True][1], runs[False][1])
