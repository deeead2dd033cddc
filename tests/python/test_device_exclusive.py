"""Exclusive device-state layers: a device-state layer whose fp32 state lives on the device only (the host
store holds no master / exp_avg / exp_avg_sq / accumulator section for it), chosen at wrap when the host
store of every unit does not fit ``host_memory_limit``. On the CPU backend the "device" is the CPU, so the
whole path runs here: training is bit-identical to the same layers kept on the device with their host
sections, and every reader (checkpoints, state dicts, export, optimizer state) sees the same values."""

import os
import sys

import pytest
import torch

import megatrain
from megatrain import _C

sys.path.insert(0, os.path.dirname(__file__))
from parity import PARITY_EPS, assert_close_rel, make_batches, poison_gradient_at, train_reference  # noqa: E402
from parity import keep_compute_copy  # noqa: E402

# These tests pin today's layout (a compute copy per layer) to exercise the exclusive / disk tiers.
kept_wrap, kept_estimate = keep_compute_copy(megatrain.wrap), keep_compute_copy(megatrain.estimate)
kept_from_pretrained = keep_compute_copy(megatrain.from_pretrained)
kept_from_config = keep_compute_copy(megatrain.from_config)
from test_disk_offload import VOCAB, _assert_bits, _model, _state, _train  # noqa: E402

K = 2  # device-state layers in these tests


def _full_host(ga=1, model=None):
    """Host bytes of the whole model with every section in the host store (what a wrap checks)."""
    return kept_estimate(model if model is not None else _model(), device="cpu",
                              gradient_accumulation_steps=ga).host_bytes


def _one_exclusive_host(ga=1, model=None, k=K):
    """Host bytes of the whole model with layer 0's fp32 state on the device only (what the planner
    chooses with ``host_memory_limit`` one byte short of the whole model's need)."""
    m = model if model is not None else _model()
    wrapped = kept_wrap(m, device="cpu", device_state_layers=k, host_memory_limit=_full_host(ga, m) - 1,
                             **({"grad_accumulator": True} if ga > 1 else {}))
    assert wrapped.megatrain.placement()["exclusive_layers"] == [0]  # the fewest: one layer is enough
    need = wrapped.megatrain.offload_plan.host_bytes
    wrapped.megatrain.close()
    return need


def _wrap(exclusive=True, ga=1, model=None, **kw):
    """The test model with ``K`` device-state layers; ``exclusive``: ``host_memory_limit`` one byte short of
    the host need with layer 0 alone exclusive, so both layers' fp32 state must stay on the device only
    (the planner makes the fewest exclusive)."""
    if ga > 1:
        kw.setdefault("grad_accumulator", True)
    if exclusive and "host_memory_limit" not in kw:
        frozen = model is not None  # a caller's model: measured on a copy built the same way
        kw["host_memory_limit"] = _one_exclusive_host(ga, _frozen_model() if frozen else None) - 1
    m = model if model is not None else _model()
    return kept_wrap(m, device="cpu", device_state_layers=K, **kw)


def test_exclusive_layers_leave_the_host_store():
    ref, model = _wrap(False), _wrap()
    eng = model.megatrain
    assert [u.index for u in eng.device_state.units] == [0, 1]
    assert all(u.device_state.exclusive for u in eng.device_state.units)
    assert not any(u.device_state.exclusive for u in ref.megatrain.device_state.units)
    # the host store lost exactly those layers' sections: fp32 master, exp_avg, exp_avg_sq (12 B/param) and the
    # compute copy (no frozen entry: the device compute buffer is the only one); nothing is held twice
    elem = torch.tensor([], dtype=eng.compute_dtype).element_size()
    gone = sum(12 * u.state_numel + elem * u.numel for u in eng.device_state.units)
    assert ref.megatrain.store.total_bytes - eng.store.total_bytes >= gone
    assert ref.megatrain.store.total_bytes - eng.store.total_bytes < gone + 4096 * 4 * K  # page padding at most
    for name in ("master", "compute"):
        with pytest.raises(ValueError):
            eng.store.section(0, name)
    assert all(eng.store.compute_absent(k) for k in (0, 1)) and not eng.store.compute_absent(2)
    assert not ref.megatrain.store.compute_absent(0)
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0, 1] and pl["device_state_layers"] == K
    assert pl["host_store_bytes"] == eng.store.total_bytes
    assert ref.megatrain.placement()["exclusive_layers"] == []
    # the replanner cannot give them back to the host store: they have no place there
    eng.resize_device_state(0)
    assert [u.index for u in eng.device_state.layers] == [0, 1]


@pytest.mark.parametrize("ga,max_grad_norm", [(1, None), (2, 1.0), (3, None), (2, 0.05)])
def test_training_is_bit_identical_to_device_state_with_host_sections(ga, max_grad_norm):
    ref = _wrap(False)
    ref_opt = _train(ref, 10, ga, max_grad_norm)
    model = _wrap(ga=ga)
    assert model.megatrain.placement()["exclusive_layers"] == [0, 1]
    opt = _train(model, 10, ga, max_grad_norm)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))


def test_parity_with_torch_adamw():
    batches = make_batches(VOCAB, 10, 2, 2, 8, seed=5)
    ref = train_reference(_model(), batches, lr=1e-3, wd=0.1, betas=(0.9, 0.95), max_grad_norm=1.0, groups="one")
    model = _wrap(ga=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=PARITY_EPS,
                                   max_grad_norm=1.0, gradient_accumulation_steps=2)
    _train(model, 10, 2, 1.0, batches=batches, opt=opt)
    got = megatrain.master_state_dict(model)
    for name, want in ref.params.items():
        assert_close_rel(got[name], want, 1e-5, name)


def _frozen_model():
    """The test model with layer 1's norms frozen."""
    m = _model()
    for n, p in m.named_parameters():
        if "layernorm" in n and "layers.1." in n:
            p.requires_grad_(False)
    return m


def test_frozen_entries_and_nonfinite_skip_are_exact():
    """An exclusive layer with frozen entries (no fp32 state), and a step whose exclusive layer's gradient is NaN."""
    results = []
    for exclusive in (False, True):
        m = _wrap(exclusive, model=_frozen_model())
        assert m.megatrain.placement()["exclusive_layers"] == ([0, 1] if exclusive else [])
        # layer 1's frozen norms have no copy but their compute section: it stays; layer 0 has none
        assert [m.megatrain.store.compute_absent(k) for k in (0, 1)] == [exclusive, False]
        opt = megatrain.optim.CPUAdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, eps=PARITY_EPS,
                                       weight_decay=0.1)
        for s, (x,) in enumerate(make_batches(VOCAB, 4, 1, 2, 8, seed=7)):
            h = poison_gradient_at(m.model.layers[0]) if s == 2 else None
            m(input_ids=x, labels=x).loss.backward()
            if h is not None:
                h.remove()
            if s == 2:
                with pytest.warns(RuntimeWarning, match="non-finite"):
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()
        results.append((_state(m, opt), opt.skipped_steps, m.state_dict()))
    assert results[0][1] == results[1][1] == 1
    _assert_bits(results[1][0], results[0][0])
    frozen = [k for k in results[0][2] if "layernorm" in k and "layers.1." in k]
    assert frozen and all(torch.equal(results[1][2][k], results[0][2][k]) for k in frozen)


def test_every_tier_at_once(tmp_path):
    """Layers 0-1 exclusive on the device, the middle ones in the host store, the deepest on disk."""
    ga = 2
    excl_only = _wrap(ga=ga)
    need = excl_only.megatrain.offload_plan.host_bytes
    del excl_only
    model = _wrap(ga=ga, offload_dir=str(tmp_path / "tier"), host_memory_limit=need - 1)
    eng = model.megatrain
    pl = eng.placement()
    assert pl["exclusive_layers"] == [0, 1] and pl["disk_layers"] and min(pl["disk_layers"]) > 1
    assert min(pl["disk_layers"]) > 2  # at least one layer still in the host store
    ref = _wrap(False)
    ref_opt = _train(ref, 8, ga, 1.0)
    opt = _train(model, 8, ga, 1.0)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))
    # and the state readers stream both tiers: a checkpoint resumes bit-identically
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _train(model, 2, ga, 1.0, opt=opt, start=8)
    want = _state(model, opt)
    model.megatrain.close()
    del model, opt
    fresh = _wrap(ga=ga, offload_dir=str(tmp_path / "tier2"), host_memory_limit=need - 1)
    opt = megatrain.optim.CPUAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=1.0,
                                   gradient_accumulation_steps=ga)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), fresh, opt)
    _train(fresh, 2, ga, 1.0, opt=opt, start=8)
    _assert_bits(_state(fresh, opt), want)


def test_checkpoint_resumes_bit_identically_and_reads_anywhere(tmp_path):
    ref = _wrap(False)
    ref_opt = _train(ref, 6, 2, 1.0)
    model = _wrap(ga=2)
    opt = _train(model, 3, 2, 1.0)
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    del model, opt
    model = _wrap(ga=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=1.0,
                                   gradient_accumulation_steps=2)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _train(model, 3, 2, 1.0, opt=opt, start=3)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))
    # a host-only model reads the same checkpoint (the format does not depend on where the state lived)
    plain = kept_wrap(_model(), device="cpu")
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), plain)
    megatrain.export_pretrained(model, str(tmp_path / "export"))
    model.save_pretrained(str(tmp_path / "pretrained"))
    from transformers import LlamaForCausalLM

    masters = megatrain.master_state_dict(model)
    for d in ("export", "pretrained"):
        got = dict(LlamaForCausalLM.from_pretrained(str(tmp_path / d)).named_parameters())
        for k, v in masters.items():
            assert torch.equal(got[k].detach(), v), (d, k)


def test_state_dicts_and_optimizer_state_read_and_write_exclusive_layers():
    model, ref = _wrap(), _wrap(False)
    opt, ref_opt = _train(model, 2, 1, None), _train(ref, 2, 1, None)
    name = next(e.name for e in model.megatrain.units[0].entries)  # a parameter of layer 0 (exclusive)
    sd = model.state_dict()
    assert torch.equal(sd[name], ref.state_dict()[name])
    new = {k: v + 0.5 for k, v in sd.items()}
    for m in (model, ref):
        m.load_state_dict(new)
    assert torch.equal(model.state_dict()[name], new[name])
    # optimizer.state: reads show the current moments; an in-place write takes effect, as in torch
    p, rp = dict(model.named_parameters())[name], dict(ref.named_parameters())[name]
    assert torch.equal(opt.state[p]["exp_avg"], ref_opt.state[rp]["exp_avg"])
    assert opt.state[p]["exp_avg"].abs().sum() > 0
    for o, q in ((opt, p), (ref_opt, rp)):
        o.state[q]["exp_avg"].mul_(0.5)
        o.state[q]["exp_avg_sq"].add_(1e-4)
    _train(model, 1, 1, None, opt=opt, start=2)
    _train(ref, 1, 1, None, opt=ref_opt, start=2)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))
    # optimizer.state_dict round trip, with a changed moment
    osd = ref_opt.state_dict()
    idx = [i for g in ref_opt.param_groups for i, q in enumerate(g["params"]) if q is rp][0]
    osd["state"][idx]["exp_avg"] = torch.full(rp.shape, 0.25)
    opt.load_state_dict(osd)
    ref_opt.load_state_dict(osd)
    assert torch.equal(opt.state[p]["exp_avg"], torch.full(p.shape, 0.25))
    back = opt.state_dict()
    assert torch.equal(back["state"][idx]["exp_avg"], torch.full(p.shape, 0.25))
    _train(model, 2, 1, None, opt=opt, start=3)
    _train(ref, 2, 1, None, opt=ref_opt, start=3)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))


def test_a_limit_too_small_even_for_exclusive_layers_is_refused_before_allocating():
    full = _full_host()
    with pytest.raises(_C.HostMemoryError) as info:
        _wrap(host_memory_limit=full // 10)
    msg = str(info.value)
    assert "\n" not in msg and "device_state_layers=2" in msg and "on the device only" in msg
    assert "even with every decoder layer's fp32 state on the device only it needs" in msg
    assert "offload_dir" in msg and "Nothing was allocated" in msg
    # a limit that more device-state layers would meet: the message says how many
    two = _wrap().megatrain.offload_plan.host_bytes
    with pytest.raises(_C.HostMemoryError, match=r"wrap with device_state_layers=[3-6] \(the fp32 state of layers"):
        _wrap(host_memory_limit=two - 1)


def test_explicit_k_makes_only_the_fewest_layers_exclusive():
    """device_state_layers=4 with a limit one byte short of the whole model: layer 0 alone is exclusive,
    layers 1..3 keep their host sections (the replanner may still give them back)."""
    model = kept_wrap(_model(), device="cpu", device_state_layers=4, host_memory_limit=_full_host() - 1)
    eng = model.megatrain
    pl = eng.placement()
    assert pl["exclusive_layers"] == [0] and pl["device_state_layers"] == 4
    assert [u.index for u in eng.device_state.units] == [0, 1, 2, 3]
    eng.store.section(1, "master")  # layer 1 has its host section (an exclusive one has none)
    eng.resize_device_state(0)
    assert [u.index for u in eng.device_state.layers] == [0]


def _auto_room(monkeypatch, layers_room, with_grad=None):
    """``device_state_layers="auto"`` on the CPU backend sees room (the whole free "device" memory, fraction 1)
    for the resident unit's state and ``layers_room`` layers' whole state (``with_grad``: with their fp32
    accumulators, as a wrap with ``grad_accumulator=True`` counts them): the device budget's test seam."""
    import importlib

    dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")
    core = importlib.import_module("megatrain.runtime.engine.core")
    sizer = kept_wrap(_model(), device="cpu", device_state_layers=0).megatrain
    res = next(u for u in sizer.units if u.kind == "resident")
    room = dsp.unit_device_bytes(res, torch.float32, with_compute=False) + \
        sum(dsp.unit_device_bytes(u, torch.float32, with_grad=with_grad) for u in sizer.layers[:layers_room])
    sizer.close()
    monkeypatch.setattr(dsp, "AUTO_DEVICE_STATE_FRACTION", 1.0)
    monkeypatch.setattr(core.Engine, "free_device_bytes", lambda self: room)
    return room


@pytest.mark.parametrize("ga,max_grad_norm", [(1, None), (2, 1.0)])
def test_auto_makes_the_fewest_layers_exclusive_and_trains_bit_identically(monkeypatch, ga, max_grad_norm):
    """The default planner (device_state_layers="auto") over a host limit below the whole model's need:
    layer 0 alone becomes exclusive, the other device-state layers keep host sections, and training is
    bit-identical to the same placement with every section in the host store."""
    _auto_room(monkeypatch, 3, with_grad=True if ga > 1 else None)
    kw = dict(device="cpu", device_state_layers="auto", **({"grad_accumulator": True} if ga > 1 else {}))
    ref = kept_wrap(_model(), **kw)
    model = kept_wrap(_model(), host_memory_limit=_full_host(ga) - 1, **kw)
    assert ref.megatrain.placement()["exclusive_layers"] == []
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0] and pl["device_state_layers"] == 3 and pl["device_state_resident"]
    ref_opt = _train(ref, 6, ga, max_grad_norm)
    opt = _train(model, 6, ga, max_grad_norm)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))


def test_auto_refusal_names_the_layers_the_device_budget_would_need(monkeypatch, tmp_path):
    """"auto" with room for 1 layer and a limit that needs 2 exclusive: refused before anything is allocated,
    naming the 2 layers, the device budget and the options; with offload_dir, layer 0 is exclusive (the
    device budget) and the deepest layers go to disk."""
    _auto_room(monkeypatch, 1)
    one = kept_wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=_full_host() - 1)
    assert one.megatrain.placement()["exclusive_layers"] == [0]
    need_one = one.megatrain.offload_plan.host_bytes
    one.megatrain.close()
    with pytest.raises(_C.HostMemoryError) as info:
        kept_wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=need_one - 1)
    msg = str(info.value)
    assert "\n" not in msg and "Nothing was allocated" in msg
    assert "holds the whole state of 1 decoder layers" in msg
    assert "the fp32 state of 2 layers (0..1) would have to live on the device only" in msg
    assert "gpu_memory_limit" in msg and "offload_dir" in msg and "host_memory_limit" in msg
    model = kept_wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=need_one - 1,
                           offload_dir=str(tmp_path / "tier"))
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0] and pl["disk_layers"] and min(pl["disk_layers"]) > 1


@pytest.mark.cuda
def test_cuda_bf16_exclusive_layers_train_like_host_sections_and_resume(tmp_path):
    """On the GPU (bf16 compute, clipping and not): the leading layers with their fp32 state on the GPU only
    give the same losses and masters (to the GPU's run-to-run rounding) as the same layers with host sections, and a checkpoint of the
    exclusive run resumes into a fresh exclusive wrap with the same next losses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(exclusive):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
        kw = {}
        if exclusive:
            kw["host_memory_limit"] = kept_estimate(m, device="cuda", compute_dtype=torch.bfloat16).host_bytes - 1
        return kept_wrap(m, device="cuda", compute_dtype=torch.bfloat16, device_state_layers=K,
                              activation_policy="recompute", **kw)

    def run(model, opt, batches):
        losses = []
        for (x,) in batches:
            x = x.cuda()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    batches = make_batches(512, 8, 1, 2, 128, seed=11)
    for mgn in (None, 1.0):
        out = []
        for exclusive in (False, True):
            model = build(exclusive)
            ex = model.megatrain.placement()["exclusive_layers"]  # the fewest leading layers the host limit needs
            assert (1 <= len(ex) <= K and ex == list(range(len(ex)))) if exclusive else ex == [], ex
            opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=mgn)
            losses = run(model, opt, batches[:5])
            if exclusive:
                megatrain.save_checkpoint(str(tmp_path / f"ck{mgn}"), model, opt)
            losses += run(model, opt, batches[5:])
            out.append((losses, megatrain.master_state_dict(model)))
            model.megatrain.close()
        (la, pa), (lb, pb) = out
        # the GPU kernels' reductions (attention backward) need not be bit-reproducible between two runs
        for a, b in zip(la, lb):
            assert abs(a - b) <= 1e-3 * abs(a), (mgn, la, lb)
        for k in pa:
            cos = torch.nn.functional.cosine_similarity(pa[k].flatten().double(), pb[k].flatten().double(), dim=0)
            assert cos > 0.99999, (mgn, k, float(cos))
        model = build(True)
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=mgn)
        megatrain.load_checkpoint(str(tmp_path / f"ck{mgn}"), model, optimizer=opt)
        for a, b in zip(run(model, opt, batches[5:]), lb[5:]):
            assert abs(a - b) <= 1e-3 * abs(a), mgn
        model.megatrain.close()


def test_a_write_into_an_exclusive_layers_state_dict_copy_is_refused_not_lost():
    """``model.state_dict()`` of an exclusive layer is a copy of the device master (there is no host view):
    an in-place write into it cannot reach the weights, so the next forward refuses it in one line naming
    the way that works (``load_state_dict``) instead of training on as if it had been applied."""
    model = _wrap()
    assert model.megatrain.placement()["exclusive_layers"] == [0, 1]
    assert_state_dict_copy_write_refused(model, "model.layers.0.mlp.down_proj.weight", "exclusive device-state layer")


def assert_state_dict_copy_write_refused(model, name: str, where: str) -> None:
    """An in-place write into ``model.state_dict()[name]`` (a copy: its layer's state is not in the host store) is
    refused at the next forward in one line naming ``where`` and ``load_state_dict``, applies nothing, is refused
    once, and ``load_state_dict`` then sets the value; closes ``model``."""
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=1)[0][0]
    sd = model.state_dict()
    sd[name].mul_(0)
    with pytest.raises(RuntimeError, match=where + r".*model\.load_state_dict") as ei:
        model(input_ids=x, labels=x)
    assert "\n" not in str(ei.value)
    assert model.state_dict()[name].abs().sum() > 0  # nothing applied
    model(input_ids=x, labels=x)  # refused once: the next forward runs
    model.load_state_dict({name: torch.zeros_like(sd[name])}, strict=False)  # the way that works
    assert model.state_dict()[name].abs().sum() == 0
    model.megatrain.close()


@pytest.mark.parametrize("placement", ["host", "device", "exclusive"])
def test_replacing_a_moment_tensor_is_the_state_from_then_on_as_in_torch(placement):
    """``optimizer.state[p]["exp_avg"] = t`` makes ``t``'s values the moment the next update reads, and
    ``optimizer.state[p]`` / ``state_dict()`` keep returning them (before: the update kept the old moment
    while the dict returned ``t``), for a layer in the host store, on the device, and exclusive there."""
    batches = make_batches(VOCAB, 4, 1, 2, 8, seed=7)
    ref = _model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=PARITY_EPS, weight_decay=0.0)
    if placement == "host":
        model = kept_wrap(_model(), device="cpu")
    else:
        model = _wrap(exclusive=placement == "exclusive")
        assert bool(model.megatrain.placement()["exclusive_layers"]) == (placement == "exclusive")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, eps=PARITY_EPS, weight_decay=0.0)
    name = "model.layers.0.self_attn.q_proj.weight"
    p, rp = dict(model.named_parameters())[name], dict(ref.named_parameters())[name]
    for k, (x,) in enumerate(batches):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(input_ids=x, labels=x).loss.backward()
            o.step()
            o.zero_grad()
        if k == 1:
            ref_opt.state[rp]["exp_avg"] = torch.full_like(ref_opt.state[rp]["exp_avg"], 1e-3)
            opt.state[p]["exp_avg"] = torch.full(p.shape, 1e-3)
    got = megatrain.master_state_dict(model)
    for n, want in ref.named_parameters():
        assert_close_rel(got[n], want.detach(), 1e-5, n)
    assert_close_rel(opt.state[p]["exp_avg"], ref_opt.state[rp]["exp_avg"], 1e-5, "exp_avg")
    saved = opt.state_dict()["state"]
    assert any(torch.equal(s["exp_avg"], opt.state[p]["exp_avg"]) for s in saved.values())
    with pytest.raises(ValueError, match="must keep its shape"):
        opt.state[p]["exp_avg"] = torch.zeros(3)
    model.megatrain.close()
