"""Long context: the chunked LM-head loss and the sequence-tiled MLP are exact (fp32, CPU).

Reference: the same model trained the ordinary way (its own lm_head + ForCausalLMLoss, untiled
MLP). Adam runs with eps=1 here, so updates are proportional to the gradients (with a small eps,
Adam's m / sqrt(v) would hide a gradient scaled by a constant, e.g. a wrong loss divisor).
"""

import copy

import pytest
import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss

import megatrain
from megatrain.runtime.activations import long_context as lc
from megatrain.runtime.activations.tiling import norms_of, tiled_class
from parity import assert_close_rel

VOCAB, SEQ, BATCH = 96, 16, 2
RTOL = 1e-6
OPT = dict(lr=0.05, betas=(0.9, 0.95), eps=1.0, weight_decay=0.1)


def tiny(arch: str):
    if arch == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
                                       tie_word_embeddings=False)
    else:
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=2, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def batches(steps: int, micro: int):
    """Micro-batches with right padding (attention_mask 0, labels -100) and a few ignored labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(micro):
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            mask = torch.ones_like(x)
            mask[0, SEQ - 5:] = 0
            labels = x.masked_fill(mask == 0, -100)
            labels[1, 3] = -100
            step.append((x, mask, labels))
        out.append(step)
    return out


def _train(model, opt, data, wrapped):
    losses = []
    for step in data:
        n = sum(int((lab[..., 1:] != -100).sum()) for _, _, lab in step)  # as the HF Trainer counts them
        total = 0.0
        for x, mask, labels in step:
            out = model(input_ids=x, attention_mask=mask, labels=labels, num_items_in_batch=n)
            out.loss.backward()
            total += out.loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, out


def run(arch, micro=2, steps=3, policy="recompute", on_wrapped=None, **wrap_kw):
    model = tiny(arch)
    data = batches(steps, micro)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **OPT)
    ref_losses, _ = _train(ref, ref_opt, data, False)
    w = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32, activation_policy=policy, **wrap_kw)
    opt = megatrain.optim.CPUAdamW(w.parameters(), gradient_accumulation_steps=micro, **OPT)
    if on_wrapped is not None:
        on_wrapped(w)
    try:
        losses, last = _train(w, opt, data, True)
        params = megatrain.master_state_dict(w)
    finally:
        w.megatrain.close()
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= RTOL * abs(b), f"step {i}: loss {a} vs reference {b}"
    checked = 0
    for name, p in ref.named_parameters():
        assert_close_rel(params[name], p.detach(), RTOL, name)
        checked += 1
    assert checked == len(list(ref.parameters())) and checked > 0
    return w, last


@pytest.mark.parametrize("arch,rows,policy", [
    ("llama", 1, "recompute"), ("llama", 7, "recompute"), ("llama", 1000, "recompute"), ("llama", 7, "store"),
    ("gpt2", 1, "recompute"), ("gpt2", 7, "block:2"), ("gpt2", 1000, "store"),
])
def test_chunked_loss_and_tiled_mlp_match_the_untiled_model_after_3_steps(arch, rows, policy):
    w, last = run(arch, policy=policy, chunked_loss=rows, tile_mlp=rows)
    assert w.megatrain.long_context.last["loss_rows"] == rows
    assert w.megatrain.long_context.last["mlp_rows"] == rows
    assert w.megatrain.long_context.last["norm_rows"] == rows  # Llama's RMSNorms, GPT-2's LayerNorms
    assert last.logits is None and "logits" not in last.keys()  # no full logits exist


def test_chunked_loss_alone_with_one_micro_batch():
    w, _ = run("llama", micro=1, chunked_loss=5, tile_mlp=False)
    assert w.megatrain.long_context.last["mlp_rows"] is None


def _grads(fn, *tensors):
    for t in tensors:
        t.grad = None
    loss = fn()
    loss.backward()
    return loss.detach(), [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("rows", [1, 3, 10, 10 ** 6])
@pytest.mark.parametrize("num_items", [None, 23])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_loss_value_and_gradients_are_the_hf_loss(rows, num_items, with_bias):
    torch.manual_seed(0)
    h = torch.randn(2, 5, 8, requires_grad=True)
    w = torch.randn(VOCAB, 8, requires_grad=True)
    b = torch.randn(VOCAB, requires_grad=True) if with_bias else None
    y = torch.randint(0, VOCAB, (2, 5))
    y[0, 2] = -100
    ts = [h, w] + ([b] if with_bias else [])
    ref_loss, ref_g = _grads(lambda: 0.7 * ForCausalLMLoss(torch.nn.functional.linear(h, w, b), y, VOCAB,
                                                           num_items_in_batch=num_items), *ts)
    got_loss, got_g = _grads(lambda: 0.7 * lc.chunked_causal_lm_loss(h, w, b, y, rows, num_items_in_batch=num_items),
                             *ts)
    assert abs(float(got_loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    for name, a, r in zip(["hidden", "weight", "bias"], got_g, ref_g):
        assert_close_rel(a, r, RTOL, name)


def test_chunked_loss_shift_labels_and_ignore_index():
    torch.manual_seed(0)
    h = torch.randn(1, 6, 8, requires_grad=True)
    w = torch.randn(VOCAB, 8, requires_grad=True)
    shift = torch.tensor([[3, 7, 7, 7, 1, 7]])
    ref_loss, ref_g = _grads(lambda: ForCausalLMLoss(h @ w.t(), None, VOCAB, ignore_index=7, shift_labels=shift), h, w)
    got_loss, got_g = _grads(lambda: lc.chunked_causal_lm_loss(h, w, None, None, 4, ignore_index=7,
                                                               shift_labels=shift), h, w)
    assert abs(float(got_loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    for a, r in zip(got_g, ref_g):
        assert_close_rel(a, r, RTOL, "grad")


class _Rows:
    def __init__(self, rows):
        self.rows = rows

    def tile_rows(self, module, x):
        return self.rows


@pytest.mark.parametrize("rows", [1, 5, 10 ** 6])
def test_tiled_mlp_and_norm_gradients_are_the_untiled_ones(rows):
    model = tiny("llama")
    tiled = copy.deepcopy(model)
    for layer in tiled.model.layers:
        parts = [layer.mlp] + norms_of(layer)
        assert len(parts) == 3  # the MLP, input_layernorm, post_attention_layernorm
        for m in parts:
            m.__class__ = tiled_class(type(m))
            m._megatrain_long = _Rows(rows)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    a = model(input_ids=x, labels=x).loss
    b = tiled(input_ids=x, labels=x).loss
    a.backward()
    b.backward()
    assert abs(float(a) - float(b)) <= RTOL * abs(float(a))
    for (name, p), (_, q) in zip(model.named_parameters(), tiled.named_parameters()):
        assert_close_rel(q.grad, p.grad, RTOL, name)


def test_logits_are_there_without_labels_and_auto_is_off_at_short_context():
    model = tiny("llama")
    ref = copy.deepcopy(model)
    w = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)  # chunked_loss / tile_mlp "auto"
    try:
        megatrain.optim.CPUAdamW(w.parameters(), lr=1e-3)
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        with torch.no_grad():
            out = w(input_ids=x, labels=x)
            expect = ref(input_ids=x, labels=x)
        assert w.megatrain.long_context.last["loss_rows"] is None
        assert w.megatrain.long_context.last["mlp_rows"] is None
        assert w.megatrain.long_context.last["norm_rows"] is None
        assert out.logits is not None and out.logits.shape == (BATCH, SEQ, VOCAB)
        assert torch.allclose(out.logits, expect.logits, rtol=1e-5, atol=1e-6)
    finally:
        w.megatrain.close()


def _free_falls_during_the_forward(start_bytes: int, now_bytes: int):
    """``on_wrapped`` for :func:`run`: the long-context rule sees ``start_bytes`` free when a model
    forward begins and ``now_bytes`` at every later call (memory a planner's placement and the
    forward's own activations took), as on a GPU that ``activation_policy="auto"`` filled."""
    def install(w):
        state = {"start": False}
        lcx = w.megatrain.long_context

        def free():
            start, state["start"] = state["start"], False
            return start_bytes if start else now_bytes

        w.register_forward_pre_hook(lambda *a: state.update(start=True), prepend=True)
        lcx._free = free
    return install


# tiny llama, fp32, B*T = 32 tokens: the untiled MLP's intermediates 32 KiB (its whole working memory
# 48 KiB), the fp32 logits 12 KiB (84 KiB with their gradient and copies), the norms' copies 16 KiB
KIB = 1024


def test_auto_does_not_tile_when_memory_taken_during_the_forward_still_leaves_room():
    """Free memory that falls during the forward (from 1 MiB to 256 KiB) below 16x the untiled
    intermediates, but not below twice their working memory: nothing is chunked or tiled, so one
    placement gets one set of decisions in every step (the old rule, free-now / 16, tiled here)."""
    assert lc.mlp_rows_for("auto", 32, 64, 4, 256 * KIB) is not None  # what a free-now-only rule decides
    w, last = run("llama", on_wrapped=_free_falls_during_the_forward(1024 * KIB, 256 * KIB))
    got = w.megatrain.long_context.last
    assert got["loss_rows"] is None and got["mlp_rows"] is None and got["norm_rows"] is None
    assert got["mlp_tiled_calls"] == got["norm_tiled_calls"] == 0
    assert last.logits is not None


def test_auto_still_splits_when_memory_is_short_at_the_call():
    """The same start, but 64 KiB free at the call: the MLP's 48 KiB working memory is over half of
    it, so the MLP is tiled and the loss chunked (the norms' 24 KiB is not) -- and training is exact."""
    w, last = run("llama", on_wrapped=_free_falls_during_the_forward(1024 * KIB, 64 * KIB))
    got = w.megatrain.long_context.last
    assert got["mlp_rows"] is not None and got["mlp_tiled_calls"] > 0
    assert got["loss_rows"] is not None and last.logits is None
    assert got["norm_rows"] is None and got["norm_tiled_calls"] == 0


def test_chunked_loss_true_without_labels_returns_logits():
    model = tiny("gpt2")
    ref = copy.deepcopy(model)
    w = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32, chunked_loss=True, tile_mlp=True)
    try:
        x = torch.randint(0, VOCAB, (BATCH, SEQ))
        with torch.no_grad():
            out = w(input_ids=x)
            loss = w(input_ids=x, labels=x, return_dict=False)
            expect = ref(input_ids=x, labels=x)
        assert torch.allclose(out.logits, expect.logits, rtol=1e-5, atol=1e-6)
        assert isinstance(loss, tuple) and loss[1] is None  # (loss, logits=None, ...)
        assert abs(float(loss[0]) - float(expect.loss)) <= 1e-6 * float(expect.loss)
        assert w.megatrain.long_context.last["loss_rows"] >= 1
    finally:
        w.megatrain.close()


@pytest.mark.parametrize("kw,match", [
    (dict(chunked_loss="sometimes"), "chunked_loss must be"), (dict(tile_mlp=0), "tile_mlp must be"),
    (dict(chunked_loss=-3), "chunked_loss must be"),
])
def test_bad_modes_rejected_before_wrapping(kw, match):
    model = tiny("llama")
    with pytest.raises(ValueError, match=match):
        megatrain.wrap(model, device="cpu", **kw)
    assert getattr(model, "megatrain", None) is None
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_chunked_loss_refused_for_soft_capped_logits():
    model = tiny("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        megatrain.wrap(model, device="cpu", chunked_loss=True)
    assert getattr(model, "megatrain", None) is None


def _long_context_refusal(monkeypatch, impl, mask, match):
    model = tiny("llama")
    model.config._attn_implementation = impl
    w = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
    try:
        monkeypatch.setattr(w.megatrain, "free_device_bytes", lambda: 8 * 1024 ** 3)
        t = 40000
        x = torch.zeros(1, t, dtype=torch.long)
        m = torch.ones_like(x)
        if mask:
            m[0, -1] = 0
        with pytest.raises(ValueError, match=match):
            with torch.no_grad():
                w(input_ids=x, attention_mask=m, labels=x)
    finally:
        w.megatrain.close()


def test_eager_attention_at_long_context_is_refused(monkeypatch):
    _long_context_refusal(monkeypatch, "eager", False, "eager attention at 40000 tokens")


def test_padding_mask_at_long_context_is_refused(monkeypatch):
    _long_context_refusal(monkeypatch, "sdpa", True, "B x 1 x T x T mask")


def test_checkpoint_spacing():
    gib = 1024 ** 3
    assert lc.checkpoint_spacing(32, gib, 40 * gib) == 1  # all 32 inputs fit
    assert lc.checkpoint_spacing(32, 2 * gib, 49 * gib) == 2  # 16 + 1 inputs of 2 GiB
    assert lc.checkpoint_spacing(32, 4 * gib, 49 * gib) == 4  # 8 + 3 inputs of 4 GiB
    assert lc.checkpoint_spacing(32, 8 * gib, 10 * gib) == 4  # none fits: fewest (11, at K = 4..6)


def test_chunked_output_reads_like_a_model_output():
    """output["loss"] (what the HF Trainer's compute_loss reads), keys(), to_tuple() and [0] work."""
    w = megatrain.wrap(tiny("llama"), chunked_loss=True, tile_mlp=False)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = w(input_ids=x, labels=x)
    assert list(out.keys())[0] == "loss" and "logits" not in list(out.keys())
    assert out["loss"] is out.loss and out[0] is out.loss and out.to_tuple()[0] is out.loss
    assert torch.isfinite(out["loss"])
