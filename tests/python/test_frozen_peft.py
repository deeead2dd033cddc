"""Pay only for what trains: frozen parameters hold only their compute copy; the accumulator exists only when needed."""

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

import megatrain  # noqa: E402

from parity import assert_close_rel  # noqa: E402


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96)
    return AutoModelForCausalLM.from_config(cfg)


def _numel(model, trainable):
    return sum(p.numel() for p in model.parameters() if p.requires_grad == trainable)


def test_store_accounting_frozen_params_cost_compute_copy_only():
    model = _tiny()
    model.get_input_embeddings().weight.requires_grad_(False)
    for layer in model.model.layers:
        layer.mlp.requires_grad_(False)
    frozen, trainable = _numel(model, False), _numel(model, True)
    wrapped = megatrain.wrap(model, device="cpu", compute_dtype=torch.bfloat16)
    store = wrapped.megatrain.store
    assert store.frozen_numel == frozen
    sec = store.section_bytes
    assert "grad_accum" not in sec
    # compute section: 2 B for every parameter; fp32 sections: 4 B for the trainable ones only
    # (plus the 64-element / 4 KiB alignment padding, bounded per entry / unit)
    n_entries = sum(len(u.entries) for u in wrapped.megatrain.units)
    pad = 64 * n_entries * 4 + 4096 * len(wrapped.megatrain.units)
    assert 2 * (frozen + trainable) <= sec["compute"] <= 2 * (frozen + trainable) + pad
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert 4 * trainable <= sec[name] <= 4 * trainable + pad, name
    assert wrapped.megatrain.accumulator_bytes() == 0


def test_accumulator_only_when_gradient_accumulation_is_declared():
    w = megatrain.wrap(_tiny(), device="cpu")
    megatrain.optim.CPUAdamW(w.parameters(), lr=1e-3)
    assert w.megatrain.accumulator_bytes() == 0 and "grad_accum" not in w.megatrain.store.section_bytes
    w2 = megatrain.wrap(_tiny(), device="cpu")
    megatrain.optim.CPUAdamW(w2.parameters(), lr=1e-3, gradient_accumulation_steps=2)
    n = sum(p.numel() for p in w2.parameters())
    assert 4 * n <= w2.megatrain.accumulator_bytes() <= 4 * n + 4 * 64 * 64


def test_undeclared_second_backward_with_clipping_still_sums_exactly():
    model = _tiny()
    ref = copy.deepcopy(model)
    w = megatrain.wrap(model, device="cpu")
    opt = megatrain.optim.CPUAdamW(w.parameters(), lr=1e-2, max_grad_norm=0.5)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        xs = [torch.randint(0, 96, (2, 8), generator=g) for _ in range(2)]
        for x in xs:
            w(input_ids=x, labels=x).loss.backward()
            ref(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step(); opt.zero_grad(); ropt.step(); ropt.zero_grad()
    assert w.megatrain.accumulator_bytes() > 0
    got = megatrain.master_state_dict(w)
    for n, p in ref.named_parameters():
        assert_close_rel(got[n], p.detach(), 1e-5, n)


# ------------------------------------------------------------------------------------------- PEFT
peft = pytest.importorskip("peft")


def _lora(model, r=4):
    cfg = peft.LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          lora_dropout=0.0, init_lora_weights="gaussian")
    return peft.get_peft_model(model, cfg)


def test_peft_lora_parity_with_plain_peft_training():
    torch.manual_seed(0)
    ref = _lora(_tiny())
    model = copy.deepcopy(ref)
    frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters() if not p.requires_grad}
    w = megatrain.wrap(model, device="cpu")
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
    opt = megatrain.optim.CPUAdamW(w.parameters(), **kw)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **kw)
    store = w.megatrain.store
    assert store.frozen_numel == sum(frozen_before[n].numel() for n in frozen_before)
    g = torch.Generator().manual_seed(3)
    for step in range(10):
        x = torch.randint(0, 96, (2, 12), generator=g)
        l1 = w(input_ids=x, labels=x).loss
        l2 = ref(input_ids=x, labels=x).loss
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=0)
        l1.backward(); l2.backward()
        opt.step(); opt.zero_grad(); ropt.step(); ropt.zero_grad()
    got = megatrain.master_state_dict(w)
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert_close_rel(got[n], p.detach(), 1e-5, n)  # the project's per-element rule (parity.py)
        else:
            assert torch.equal(got[n], frozen_before[n]), n  # frozen: bit-identical
            assert torch.equal(p.detach(), frozen_before[n]), n


def _wrap_and_train(peft_model):
    """Wrap a PEFT model, train 2 steps on one batch; returns (wrapped, the batch, its logits after)."""
    w = megatrain.wrap(peft_model, device="cpu")
    opt = megatrain.optim.CPUAdamW(w.parameters(), lr=1e-2)
    x = torch.randint(0, 96, (2, 12))
    for _ in range(2):
        w(input_ids=x, labels=x).loss.backward()
        opt.step(); opt.zero_grad()
    with torch.no_grad():
        return w, x, w(input_ids=x).logits


def test_export_of_peft_model_round_trips_through_peft_and_transformers(tmp_path):
    torch.manual_seed(0)
    base = _tiny()
    base_dir = str(tmp_path / "base")
    base.save_pretrained(base_dir)
    model = _lora(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32))
    w, x, want = _wrap_and_train(model)
    out = str(tmp_path / "adapter")
    megatrain.export_pretrained(w, out)
    assert os.path.isfile(os.path.join(out, "adapter_config.json"))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-5, atol=1e-6)
    merged = str(tmp_path / "merged")
    megatrain.export_pretrained(w, merged, merge_adapter=True)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=x).logits, want, rtol=1e-4, atol=1e-5)


def test_merged_export_takes_modules_to_save_and_refuses_other_adapter_kinds(tmp_path):
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights="gaussian")
    w, x, want = _wrap_and_train(peft.get_peft_model(_tiny(), cfg))
    megatrain.export_pretrained(w, str(tmp_path / "merged"), merge_adapter=True)
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():  # the trained lm_head copy, not the original (nor a missing, random one)
        torch.testing.assert_close(plain(input_ids=x).logits, want, rtol=1e-4, atol=1e-5)
    ia3 = peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"])
    wi = megatrain.wrap(peft.get_peft_model(_tiny(), ia3), device="cpu")
    with pytest.raises(ValueError, match="merges LoRA adapters only, this one is IA3"):
        megatrain.export_pretrained(wi, str(tmp_path / "ia3"), merge_adapter=True)
    assert not os.path.exists(tmp_path / "ia3")


def test_megatrain_trainer_saves_a_peft_model_as_its_adapter(tmp_path):
    """As a plain Trainer: adapter_config.json + adapter_model.safetensors, which PeftModel loads."""
    from megatrain.integrations import MegatrainTrainer
    from transformers import TrainingArguments

    torch.manual_seed(0)
    base_dir = str(tmp_path / "base")
    _tiny().save_pretrained(base_dir)
    w = megatrain.wrap(_lora(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)), device="cpu")
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 96, (8, 12), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, logging_steps=1)
    tr = MegatrainTrainer(model=w, args=args, train_dataset=data)
    tr.train()
    tr.save_model(str(tmp_path / "final"))
    assert os.path.isfile(tmp_path / "final" / "adapter_config.json")
    assert not os.path.exists(tmp_path / "final" / "model.safetensors")
    x = data[0]["input_ids"][None]
    with torch.no_grad():
        want = w(input_ids=x).logits
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                            str(tmp_path / "final"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-5, atol=1e-6)


def test_peft_merge_and_unload_on_a_wrapped_model_is_refused_naming_export():
    model = megatrain.wrap(_lora(_tiny()))
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(x).logits
    for name in ("merge_and_unload", "merge_adapter", "unmerge_adapter", "unload"):
        for target in (model, model.base_model):
            with pytest.raises(RuntimeError, match=r"export_pretrained\(model, dir, merge_adapter=True\)"):
                getattr(target, name)()
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)

def test_from_config_with_peft_transform_equals_peft_on_hf_init():
    cfg = _tiny().config
    torch.manual_seed(5)
    ref = megatrain.wrap(_lora(AutoModelForCausalLM.from_config(cfg)), device="cpu")
    got = megatrain.from_config(cfg, seed=5, transform=_lora, device="cpu")
    assert got.megatrain.store.frozen_numel == ref.megatrain.store.frozen_numel > 0
    a, b = megatrain.master_state_dict(got), megatrain.master_state_dict(ref)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------ state_dict / load_state_dict of frozen parameters
def _freeze_embed(m):
    m.get_input_embeddings().weight.requires_grad_(False)
    return m


def _freeze_layer0(m):
    m.model.layers[0].requires_grad_(False)
    return m


def _lora_random_b(m):
    """LoRA with random A and B: a zero B's first Adam steps would follow the sign of near-zero
    gradients (fp32 summation noise), which differs between any two summation orders."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(m, cfg)


# (how the model is frozen, a frozen parameter's state_dict key)
_FROZEN = {
    "embed": (_freeze_embed, "model.embed_tokens.weight"),
    "layer0": (_freeze_layer0, "model.layers.0.mlp.up_proj.weight"),
    "lora": (_lora_random_b, "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"),
}


def _frozen_pair(monkeypatch, frozen, dsl, compute_dtype=torch.float32):
    """(wrapped, CPUAdamW, torch model, torch AdamW, frozen key) for one ``_FROZEN`` case; ``dsl="auto"``:
    the resident unit and layer 0 keep their state on the device."""
    if dsl == "auto":
        from test_device_state import _limit_device_room

        _limit_device_room(monkeypatch, 1)
    freeze, key = _FROZEN[frozen]
    torch.manual_seed(0)
    ref = freeze(_tiny())
    w = megatrain.wrap(copy.deepcopy(ref), device="cpu", device_state_layers=dsl, compute_dtype=compute_dtype)
    if dsl != 0:
        assert w.megatrain.layers[0].device_state is not None
    # eps 1e-4: an embedding element whose gradient is ~1e-7 of fp32 summation noise gets no update
    # of its own from that noise (with eps 1e-6 Adam turns it into ~1e-6 differences between any two
    # summation orders); every real gradient here is >> 1e-4
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-4)
    opt = megatrain.optim.CPUAdamW([p for p in w.parameters() if p.requires_grad], **kw)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False, **kw)
    return w, opt, ref, ropt, key


def _train_both(w, opt, ref, ropt, steps, seed):
    """``steps`` steps of both models on the same batches: the losses agree at each."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 96, (2, 12), generator=g)
        l1, l2 = w(input_ids=x, labels=x).loss, ref(input_ids=x, labels=x).loss
        torch.testing.assert_close(l1, l2, rtol=1e-5, atol=0)
        l1.backward(); l2.backward()
        opt.step(); opt.zero_grad(); ropt.step(); ropt.zero_grad()


def _assert_same_weights(w, ref):
    got = w.state_dict()
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert_close_rel(got[n], p.detach(), 1e-5, n)
        else:
            assert torch.equal(got[n], p.detach()), n  # frozen: bit-identical


@pytest.mark.parametrize("dsl", [0, "auto"])
@pytest.mark.parametrize("frozen", list(_FROZEN))
def test_load_state_dict_with_frozen_parameters_trains_as_torch(monkeypatch, frozen, dsl):
    """A frozen parameter's loaded value goes into its compute copy (and the device copies): the next
    forward and the training after it match torch's."""
    w, opt, ref, ropt, key = _frozen_pair(monkeypatch, frozen, dsl)
    _train_both(w, opt, ref, ropt, 1, seed=1)
    sd = {k: v.clone() + 0.01 for k, v in w.state_dict().items()}
    ref.load_state_dict(sd)
    out = w.load_state_dict(sd)
    assert not out.missing_keys and not out.unexpected_keys
    assert torch.equal(w.state_dict()[key], sd[key])
    _train_both(w, opt, ref, ropt, 2, seed=2)
    _assert_same_weights(w, ref)


@pytest.mark.parametrize("frozen", ["embed", "lora"])
def test_a_refused_load_with_frozen_parameters_changes_nothing(monkeypatch, frozen):
    """A shape mismatch (on the last key) or a missing key: raises as torch, and no parameter (frozen or
    not) nor the next forward changed."""
    w, opt, ref, ropt, key = _frozen_pair(monkeypatch, frozen, "auto")
    _train_both(w, opt, ref, ropt, 1, seed=1)
    before = {k: v.clone() for k, v in w.state_dict().items()}
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        loss = w(input_ids=x, labels=x).loss
    bad = {k: v + 0.01 for k, v in before.items()}
    last = list(bad)[-1]
    bad[last] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match="size mismatch for"):
        ref.load_state_dict(bad)
    with pytest.raises(RuntimeError, match="size mismatch for"):
        w.load_state_dict(bad)
    missing = {k: v + 0.01 for k, v in before.items() if k != last}
    with pytest.raises(RuntimeError, match="Missing key"):
        w.load_state_dict(missing)
    now = w.state_dict()
    for k, v in before.items():
        assert torch.equal(now[k], v), k
    with torch.no_grad():
        assert torch.equal(w(input_ids=x, labels=x).loss, loss)


@pytest.mark.parametrize("dsl", [0, 1, "auto"])
@pytest.mark.parametrize("frozen", list(_FROZEN))
def test_a_write_through_a_held_state_dict_tensor_of_a_frozen_parameter_is_used(monkeypatch, frozen, dsl):
    """fp32 compute copy: a frozen parameter's state_dict tensor is its compute copy; an in-place write
    into a held one is what the next forward uses (a streamed layer's slot, the resident buffer, a
    device-state unit's copy), and steps keep it, as torch's."""
    w, opt, ref, ropt, key = _frozen_pair(monkeypatch, frozen, dsl)
    _train_both(w, opt, ref, ropt, 1, seed=1)
    sd, sdt = w.state_dict(), ref.state_dict()
    sd[key].add_(0.5); sdt[key].add_(0.5)
    _train_both(w, opt, ref, ropt, 2, seed=2)
    sd[key][:2].mul_(2.0); sdt[key][:2].mul_(2.0)  # again through a view, after steps
    _train_both(w, opt, ref, ropt, 1, seed=3)
    assert torch.equal(sd[key], sdt[key])
    _assert_same_weights(w, ref)


def test_frozen_parameters_with_a_bf16_compute_copy(monkeypatch):
    """bf16 compute copy: a frozen parameter's state_dict tensor is an fp32 copy. A write into it is refused
    at the next forward (once, naming load_state_dict; nothing taken); a load converts the value to bf16,
    also one written into such a copy first."""
    w, opt, ref, ropt, key = _frozen_pair(monkeypatch, "embed", 0, compute_dtype=torch.bfloat16)
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    sd = w.state_dict()
    before = sd[key].clone()
    with torch.no_grad():
        loss = w(input_ids=x, labels=x).loss
    sd[key].add_(0.5)
    with pytest.raises(RuntimeError, match=r"frozen .* model\.load_state_dict"):
        w(input_ids=x, labels=x)
    assert torch.equal(w.state_dict()[key], before)
    with torch.no_grad():
        assert torch.equal(w(input_ids=x, labels=x).loss, loss)
    w.load_state_dict(sd)  # the written copy itself
    want = (before + 0.5).bfloat16().float()
    assert torch.equal(w.state_dict()[key], want)
    with torch.no_grad():
        l_loaded = w(input_ids=x, labels=x).loss
    assert not torch.equal(l_loaded, loss)
    w.load_state_dict({key: before}, strict=False)
    with torch.no_grad():
        assert torch.equal(w(input_ids=x, labels=x).loss, loss)


def test_an_adapter_only_load_copies_no_frozen_entry(monkeypatch):
    """``load_state_dict(adapter_sd, strict=False)`` on a LoRA model with a bf16 compute copy touches the
    adapter's entries only: no fp32 copy of a frozen base entry (4 bytes per base parameter, a 30B base's
    120 GB) is made, for the shape check or the load, and the base stays bit for bit."""
    from megatrain.runtime.model import state_dict_views

    torch.manual_seed(0)
    w = megatrain.wrap(_lora_random_b(_tiny()), device="cpu", compute_dtype=torch.bfloat16)
    base_before = {k: v.clone() for k, v in w.state_dict().items() if "lora_" not in k}
    sd = {k: v + 1 for k, v in w.state_dict().items() if "lora_" in k}
    loaded, frozen_copies = [], []
    for_load, get = state_dict_views._Masters.for_load, state_dict_views._Masters.get

    def spy_for_load(self, u, i):
        loaded.append(u.entries[i].name)
        return for_load(self, u, i)

    def spy_get(self, u, i):
        if u.entries[i].frozen:
            frozen_copies.append(u.entries[i].name)
        return get(self, u, i)

    monkeypatch.setattr(state_dict_views._Masters, "for_load", spy_for_load)
    monkeypatch.setattr(state_dict_views._Masters, "get", spy_get)
    res = w.load_state_dict(sd, strict=False)
    monkeypatch.undo()
    assert len(loaded) == len(sd) and frozen_copies == []
    assert not res.unexpected_keys and len(res.missing_keys) == len(base_before)
    after = w.state_dict()
    assert all(torch.equal(after[k], v) for k, v in sd.items())
    assert all(torch.equal(after[k], v) for k, v in base_before.items())
