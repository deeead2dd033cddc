"""Attention outputs kept from a block's re-run (runtime/activations/attention_reuse.py), CPU (SDPA's flash kernel for CPU).

Against plain PyTorch training of the same SDPA model and against megatrain with the reuse off;
with a count of the attention forwards that run in backward."""

import copy

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

import megatrain
from parity import assert_close_rel, make_batches, train_megatrain, train_reference

FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def sdpa_llama(layers=4, kv_heads=2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=kv_heads,
                                   intermediate_size=64, num_hidden_layers=layers, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class _CountAttentionForwards(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is FLASH_CPU:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _train(model, policy, steps=3, **wrap_kw):
    batches = make_batches(96, steps, 1, 2, 16, seed=1)
    kw = dict(lr=1e-3, wd=0.1, betas=(0.9, 0.95), max_grad_norm=1.0, groups="one")
    return train_megatrain(model, batches, activation_policy=policy, **kw, **wrap_kw), batches, kw


@pytest.mark.parametrize("policy,kv_heads", [("block:2", 2), ("block:3", 4), ("block:4", 2)])
def test_block_policy_with_kept_attention_matches_plain_pytorch(policy, kv_heads):
    model = sdpa_llama(kv_heads=kv_heads)
    ref_model = copy.deepcopy(model)
    (got, wrapped, _), batches, kw = _train(model, policy)
    ref = train_reference(ref_model, batches, **kw)
    for a, b in zip(got.losses, ref.losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    for n, p in ref.params.items():
        assert_close_rel(got.params[n], p, 1e-6, n)
    reuse = wrapped.megatrain.attention_reuse
    k = int(policy.split(":")[1])
    # per step, every block of K layers keeps (and reuses) the attention of its first K - 1 layers
    per_step = sum(min(k, 4 - s) - 1 for s in range(0, 4, k))
    assert reuse.kept_calls == reuse.reused_calls == 3 * per_step and reuse.skipped == 0


def test_kept_attention_is_bit_identical_to_running_it_again():
    # The CPU flash kernel computes the same output with and without grad, so keeping it changes no bit.
    (on, _, _), _, _ = _train(sdpa_llama(), "block:2", steps=3)
    (off, wrapped, _), _, _ = _train(sdpa_llama(), "block:2", steps=3, reuse_attention=False)
    assert wrapped.megatrain.attention_reuse is None
    assert on.losses == off.losses
    for n, p in off.params.items():
        assert torch.equal(on.params[n], p), n


@pytest.mark.parametrize("reuse,expected", [(True, 4 + 0), (False, 4 + 2)])
def test_backward_runs_fewer_attention_forwards(reuse, expected):
    # block:2 over 4 layers, in backward: the block re-runs run layers 0 and 2 (2 forwards); the
    # layers' own re-runs with grad run all 4, except, when kept, layers 0 and 2 (4 - 2 + 2 = 4 in all).
    model = megatrain.wrap(sdpa_llama(), device="cpu", compute_dtype=torch.float32, activation_policy="block:2",
                           reuse_attention=reuse)
    megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 16))
    loss = model(input_ids=x, labels=x).loss
    with _CountAttentionForwards() as count:
        loss.backward()
    assert count.n == expected


def test_a_padding_mask_runs_sdpa_unchanged_and_stays_exact():
    model = sdpa_llama()
    ref_model = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32, activation_policy="block:2")
    opts = [megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=1e-6),
            torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=1e-6, foreach=False)]
    x = torch.randint(0, 96, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0  # left padding: transformers passes a 4-D mask to SDPA
    labels = x.masked_fill(mask == 0, -100)
    for m, opt in zip((wrapped, ref_model), opts):
        m(input_ids=x, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    reuse = wrapped.megatrain.attention_reuse
    assert reuse.kept_calls == 0 and reuse.reused_calls == 0 and reuse.skipped == 2
    got = megatrain.master_state_dict(wrapped)
    for n, p in ref_model.named_parameters():
        assert_close_rel(got[n], p.detach(), 1e-5, n)


def test_no_room_keeps_nothing(monkeypatch):
    from megatrain.runtime.activations import attention_reuse

    monkeypatch.setattr(attention_reuse, "FREE_FRACTION", 0.0)
    (got, wrapped, _), batches, kw = _train(sdpa_llama(), "block:2", steps=2)
    reuse = wrapped.megatrain.attention_reuse
    assert reuse.kept_calls == 0 and reuse.skipped == 4
    (off, _, _), _, _ = _train(sdpa_llama(), "block:2", steps=2, reuse_attention=False)
    for n, p in off.params.items():
        assert torch.equal(got.params[n], p), n


def test_reuse_attention_must_be_a_bool():
    with pytest.raises(ValueError, match="reuse_attention must be True or False"):
        megatrain.wrap(sdpa_llama(), device="cpu", reuse_attention="yes")
