"""GPU: a kept attention output (runtime/activations/attention_reuse.py) and its fused backward against SDPA's own autograd.

bf16, causal, the kernel SDPA's dispatcher picks (cuDNN or flash on the H200), with and without
grouped-query heads. The training-level check is ``block3_reuse_race_debug`` in test_parity_cuda.py.
"""

import pytest
import torch
import torch.nn.functional as F

from megatrain.runtime.activations import attention_reuse as ar

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_kept_output_and_its_backward_match_sdpa_autograd(kv_heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv_heads, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, kv_heads, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    go = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    gqa = kv_heads != 8
    backend = ar._backend(q, k, v, True, None, gqa)
    assert backend in ("cudnn", "flash"), backend

    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
    ref_grads = torch.autograd.grad(ref, (qs, ks, vs), go)
    with torch.no_grad():
        nograd = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        out, lse, aux = ar._forward(backend, q, k, v, True, None)
    kept = ar._Kept(backend, ar._signature(q, k, v, True, None, gqa), out, lse, aux, True, None)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    got = ar._ReusedAttention.apply(qs, ks, vs, kept)
    got_grads = torch.autograd.grad(got, (qs, ks, vs), go)
    print(f"\nbackend {backend}, kv heads {kv_heads}: kept output == SDPA with grad: {torch.equal(got, ref)}; "
          f"SDPA without grad == with grad: {torch.equal(nograd, ref)}; grads equal: "
          f"{[torch.equal(a, b) for a, b in zip(got_grads, ref_grads)]}")
    assert torch.equal(got.detach(), ref.detach())  # the same kernel on the same inputs, with its log-sum-exp
    for a, b, name in zip(got_grads, ref_grads, "qkv"):
        assert a.shape == b.shape, name
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 1e-2, (name, float(err))
