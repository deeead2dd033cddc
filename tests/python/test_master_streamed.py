"""Master-streamed layers (wrap(host_compute_copy=False | "auto")): no compute section in the host store
(12 B/param), the slot filled from the fp32 master, gradients held until the update. Bit-identical to the
layout with a compute copy, and to torch.optim.AdamW within 1e-5; the store shrinks by exactly the compute
sections; the "auto" planner streams the deepest layer when the store is one unit short."""

import os
import sys
import threading
import warnings

import pytest
import torch

import megatrain
from megatrain import _C

sys.path.insert(0, os.path.dirname(__file__))
from parity import PARITY_EPS, assert_close_rel, make_batches, poison_gradient_at  # noqa: E402
from test_disk_offload import _state  # noqa: E402 - every fp32 training state by name (copies)

LAYERS = 4
VOCAB = 96


def _model(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB))


def _opt(model, ga, clip):
    return megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS,
                                    max_grad_norm=clip, gradient_accumulation_steps=ga)


def _train(model, opt, batches, ga):
    losses = []
    for micro in batches:
        total = 0.0
        for x in micro:
            loss = model(input_ids=x, labels=x).loss / ga
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _run(copy, ga, clip, steps=3, dtype=torch.float32, **kw):
    m = megatrain.wrap(_model(), device="cpu", compute_dtype=dtype, host_compute_copy=copy, **kw)
    opt = _opt(m, ga, clip)
    losses = _train(m, opt, make_batches(VOCAB, steps, ga, 2, 8, seed=3), ga)
    return m, opt, losses


@pytest.mark.parametrize("ga,clip", [(1, None), (1, 1.0), (2, 1.0), (3, None)])
def test_training_equals_the_compute_copy_layout_and_torch_adamw(ga, clip):
    ms, ms_opt, ms_losses = _run(False, ga, clip)
    assert ms.megatrain.placement()["master_streamed_layers"] == list(range(LAYERS))
    ref, ref_opt, ref_losses = _run(True, ga, clip)
    assert ref.megatrain.placement()["master_streamed_layers"] == []
    assert ms_losses == ref_losses
    _assert_same(_state(ms, ms_opt), _state(ref, ref_opt))
    # plain PyTorch
    torch_model = _model()
    topt = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS, foreach=False)
    for micro in make_batches(VOCAB, 3, ga, 2, 8, seed=3):
        for x in micro:
            (torch_model(input_ids=x, labels=x).loss / ga).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(torch_model.parameters(), clip)
        topt.step()
        topt.zero_grad()
    got = megatrain.master_state_dict(ms)
    for n, p in torch_model.named_parameters():
        assert_close_rel(got[n], p.detach(), 1e-5, n)


def test_bf16_compute_copy_cast_from_the_master_is_bit_identical():
    """bf16 slots: the cast of the master equals the CPU AdamW's compute copy (round to nearest even)."""
    ms, ms_opt, ms_losses = _run(False, 1, 1.0, dtype=torch.bfloat16)
    ref, ref_opt, ref_losses = _run(True, 1, 1.0, dtype=torch.bfloat16)
    assert ms_losses == ref_losses
    _assert_same(_state(ms, ms_opt), _state(ref, ref_opt))


def test_store_bytes_drop_by_exactly_the_compute_sections():
    ms = megatrain.wrap(_model(), device="cpu", host_compute_copy=False)
    ref = megatrain.wrap(_model(), device="cpu", host_compute_copy=True)
    s_ms, s_ref = ms.megatrain.store, ref.megatrain.store
    def section_bytes(store, u):  # the 4 KiB-padded compute section (tiny units: no skew gap)
        t = store.section(u, "compute")
        return -(-t.numel() * t.element_size() // 4096) * 4096

    compute = sum(section_bytes(s_ref, u) for u in ms.megatrain.offload_plan.master_streamed)
    assert compute > 0
    assert s_ref.total_bytes - s_ms.total_bytes == compute
    for u in ms.megatrain.offload_plan.master_streamed:
        assert s_ms.compute_absent(u) and not s_ref.compute_absent(u)
        with pytest.raises(ValueError, match="no compute section"):
            s_ms.section(u, "compute")
    p = ms.megatrain.placement()
    assert p["host_bytes_per_param"] < ref.megatrain.placement()["host_bytes_per_param"]


def test_auto_streams_the_deepest_layer_when_the_store_is_one_unit_short():
    full = megatrain.wrap(_model(), device="cpu")
    assert full.megatrain.offload_plan.master_streamed == []  # "auto": fits, today's layout
    limit = full.megatrain.offload_plan.host_bytes - 1
    m = megatrain.wrap(_model(), device="cpu", host_memory_limit=limit)
    plan = m.megatrain.offload_plan
    assert plan.master_streamed == [LAYERS - 1]
    assert plan.disk_units == [] and plan.exclusive_units == []
    assert m.megatrain.placement()["master_streamed_layers"] == [LAYERS - 1]
    with pytest.raises(_C.HostMemoryError):
        megatrain.wrap(_model(), device="cpu", host_memory_limit=limit, host_compute_copy=True)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_mixed_with_disk_tier_units_equals_host_only(tmp_path, clip):
    """Some layers master-streamed, some with their fp32 state on disk (those keep their compute copy)."""
    bf16 = dict(device="cpu", compute_dtype=torch.bfloat16)  # (a disk unit's fp32 compute copy costs more than it saves)
    streamed = megatrain.wrap(_model(), host_compute_copy=False, **bf16)
    limit = streamed.megatrain.offload_plan.host_bytes - 1
    del streamed
    m = megatrain.wrap(_model(), host_compute_copy=False, offload_dir=str(tmp_path / "tier"), host_memory_limit=limit,
                       **bf16)
    plan = m.megatrain.offload_plan
    assert plan.disk_units and plan.master_streamed
    assert not set(plan.disk_units) & set(plan.master_streamed)
    opt = _opt(m, 1, clip)
    batches = make_batches(VOCAB, 3, 1, 2, 8, seed=3)
    losses = _train(m, opt, batches, 1)
    ref = megatrain.wrap(_model(), host_compute_copy=True, **bf16)
    ref_opt = _opt(ref, 1, clip)
    assert losses == _train(ref, ref_opt, batches, 1)
    _assert_same(_state(m, opt), _state(ref, ref_opt))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_step_is_skipped_with_the_masters_untouched(clip):
    def run(copy):
        m = megatrain.wrap(_model(), device="cpu", host_compute_copy=copy)
        opt = _opt(m, 1, clip)
        batches = make_batches(VOCAB, 3, 1, 2, 8, seed=3)
        _train(m, opt, batches[:1], 1)
        h = poison_gradient_at(m.model.layers[2])
        with pytest.warns(RuntimeWarning, match="non-finite"):
            _train(m, opt, batches[1:2], 1)
        h.remove()
        _train(m, opt, batches[2:], 1)
        return _state(m, opt), opt.skipped_steps

    (a, na), (b, nb) = run(False), run(True)
    assert na == nb == 1
    _assert_same(a, b)


def test_save_resume_and_state_dict_are_bit_identical(tmp_path):
    batches = make_batches(VOCAB, 4, 1, 2, 8, seed=3)
    m = megatrain.wrap(_model(), device="cpu", host_compute_copy=False)
    opt = _opt(m, 1, 1.0)
    _train(m, opt, batches[:2], 1)
    megatrain.save_checkpoint(str(tmp_path / "ck"), m, opt)
    _train(m, opt, batches[2:], 1)
    resumed = megatrain.wrap(_model(seed=1), device="cpu", host_compute_copy=False)
    ropt = _opt(resumed, 1, 1.0)
    megatrain.load_checkpoint(str(tmp_path / "ck"), resumed, ropt)
    _train(resumed, ropt, batches[2:], 1)
    _assert_same(_state(m, opt), _state(resumed, ropt))
    # the layout with a compute copy, trained the same: the same state dict and export
    ref = megatrain.wrap(_model(), device="cpu", host_compute_copy=True)
    _train(ref, _opt(ref, 1, 1.0), batches, 1)
    sd, ref_sd = m.state_dict(), ref.state_dict()
    _assert_same({k: v.clone() for k, v in sd.items()}, {k: v.clone() for k, v in ref_sd.items()})
    m.save_pretrained(str(tmp_path / "ms"))
    ref.save_pretrained(str(tmp_path / "ref"))
    from safetensors.torch import load_file

    _assert_same(load_file(str(tmp_path / "ms" / "model.safetensors")),
                 load_file(str(tmp_path / "ref" / "model.safetensors")))


def test_load_state_dict_reaches_the_next_forward():
    m = megatrain.wrap(_model(), device="cpu", host_compute_copy=False, num_slots=LAYERS)  # every layer stays in a slot
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=3)[0][0]
    with torch.no_grad():
        m(input_ids=x)
    src = _model(seed=5)
    m.load_state_dict(src.state_dict())
    with torch.no_grad():
        assert torch.equal(m(input_ids=x).logits, src(input_ids=x).logits)


def test_torch_slot_path_and_a_load_between_backward_and_step():
    """``cpp_slots=False`` (torch's slot path) and an evaluation forward between backward() and step() (the
    master-streamed layers' gradients still held) give the bits of the layout with a compute copy."""
    from megatrain.runtime.options import options_set

    def run(copy):
        with options_set(cpp_slots=False):
            m = megatrain.wrap(_model(), device="cpu", host_compute_copy=copy)
        opt = _opt(m, 1, 1.0)
        outs = []
        for micro in make_batches(VOCAB, 3, 1, 2, 8, seed=3):
            x = micro[0]
            m(input_ids=x, labels=x).loss.backward()
            with torch.no_grad():
                outs.append(m(input_ids=x).logits.clone())
            opt.step()
            opt.zero_grad()
        return outs, _state(m, opt)

    (oa, sa), (ob, sb) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(oa, ob))
    _assert_same(sa, sb)


def test_updates_wait_for_a_staging_buffer_without_blocking_step():
    """With one staging buffer and clipping, step() defers the updates of the master-streamed layers that find
    every buffer in use; they are submitted as buffers free up and before their layer is loaded: the same bits."""
    def run(copy):
        m = megatrain.wrap(_model(), device="cpu", host_compute_copy=copy)
        grads = m.megatrain.grads
        grads.staging_max = 1  # (none allocated yet: at one backward per step only held gradients use the pool)
        opt = _opt(m, 1, 1.0)
        deferred = []
        for micro in make_batches(VOCAB, 3, 1, 2, 8, seed=3):
            x = micro[0]
            m(input_ids=x, labels=x).loss.backward()
            busy = threading.Event()  # the worker held in a task ahead of every update while step() queues them
            m.megatrain.worker.submit(lambda: busy.wait(30), klass=m.megatrain.worker.UPDATE, key=-1)
            opt.step()
            deferred.append(len(grads.held._deferred))
            busy.set()
            opt.zero_grad()
        return _state(m, opt), deferred

    (a, deferred), (b, none) = run(False), run(True)
    assert max(deferred) > 0 and max(none) == 0
    _assert_same(a, b)


def test_close_submits_the_deferred_updates():
    m = megatrain.wrap(_model(), device="cpu", host_compute_copy=False)
    eng = m.megatrain
    eng.grads.staging_max = 1
    opt = _opt(m, 1, 1.0)
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=3)[0][0]
    m(input_ids=x, labels=x).loss.backward()
    busy = threading.Event()
    eng.worker.submit(lambda: busy.wait(30), klass=eng.worker.UPDATE, key=-1)
    opt.step()
    assert eng.grads.held._deferred
    busy.set()
    eng.close()
    assert not eng.grads.held._deferred and all(h.done for u in eng.layers for h in u.update_tasks)
    assert sum(len(u.update_tasks) for u in eng.layers) == LAYERS


def test_two_backwards_before_step_sum_the_held_gradients():
    """gradient_accumulation_steps=1 but two backward() calls before step(): the held gradients move to the
    fp32 accumulator (as the direct ones of the compute-copy layout do)."""
    def run(copy):
        m = megatrain.wrap(_model(), device="cpu", host_compute_copy=copy)
        opt = _opt(m, 1, 1.0)
        for micro in make_batches(VOCAB, 2, 2, 2, 8, seed=3):
            for x in micro:
                m(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        return _state(m, opt)

    _assert_same(run(False), run(True))


def test_from_pretrained_fills_master_streamed_layers(tmp_path):
    """The streamed loader writes the masters of master-streamed layers; their forward reads them."""
    src = _model()
    src.save_pretrained(str(tmp_path / "hf"))
    m = megatrain.from_pretrained(str(tmp_path / "hf"), device="cpu", host_compute_copy=False)
    assert m.megatrain.placement()["master_streamed_layers"] == list(range(LAYERS))
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=3)[0][0]
    with torch.no_grad():
        assert torch.equal(m(input_ids=x).logits, src(input_ids=x).logits)


def test_layers_with_a_frozen_parameter_keep_their_compute_copy():
    model = _model()
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    m = megatrain.wrap(model, device="cpu", host_compute_copy=False)
    assert m.megatrain.placement()["master_streamed_layers"] == [0, 2, 3]


def test_bad_option_value_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        megatrain.wrap(_model(), device="cpu", host_compute_copy="yes")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("megatrain.wrap: host_compute_copy must be 'auto'") and "'yes'" in msg


@pytest.mark.cuda
def test_cuda_master_streamed_equals_the_compute_copy_layout_bf16_clipped():
    """8 bf16 steps with clipping on the GPU: master-streamed layers (H2D of the master, cast on the device,
    gradients held on the device) give the bits of the layout with a compute copy."""
    def run(copy):
        m = megatrain.wrap(_model(), device="cuda", compute_dtype=torch.bfloat16, host_compute_copy=copy,
                           device_state_layers=0, activation_policy="recompute")
        opt = _opt(m, 1, 1.0)
        batches = [[x.cuda() for x in micro] for micro in make_batches(VOCAB, 8, 1, 2, 8, seed=3)]
        losses = _train(m, opt, batches, 1)
        return losses, _state(m, opt)

    (la, sa), (lb, sb) = run(False), run(True)
    assert la == lb
    _assert_same(sa, sb)



def test_false_with_no_eligible_layer_warns_that_nothing_is_streamed():
    """``host_compute_copy=False`` on a model whose every decoder layer has a frozen parameter (a LoRA base): no layer
    can be master-streamed, and the user is told so instead of the option doing nothing silently; no warning when a
    layer is streamed."""
    frozen = _model()
    for layer in frozen.model.layers:
        layer.self_attn.q_proj.weight.requires_grad_(False)
    with pytest.warns(UserWarning, match="streams no layer from its master"):
        model = megatrain.wrap(frozen, device="cpu", host_compute_copy=False)
    assert model.megatrain.placement()["master_streamed_layers"] == []
    model.megatrain.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = megatrain.wrap(_model(), device="cpu", host_compute_copy=False)
    assert model.megatrain.placement()["master_streamed_layers"]
    model.megatrain.close()


def test_master_streamed_layers_moved_to_the_device_train_and_read_as_the_compute_copy_layout():
    """The planner's second decision may put master-streamed layers' state on the device (resize_device_state): their
    direct gradients then sit in the device compute buffer, and a state_dict read between backward and step (the
    host store made current: no compute section to write) works; training stays bit-identical to the same moves in
    the layout with a compute copy."""
    def run(copy):
        m = megatrain.wrap(_model(), device="cpu", host_compute_copy=copy, device_state_layers=0)
        opt = _opt(m, 1, 1.0)
        for s, (x,) in enumerate(make_batches(VOCAB, 4, 1, 2, 8, seed=3)):
            if s == 1:
                m.megatrain.resize_device_state(2)
                assert m.megatrain.placement()["device_state_layers"] == 2
            m(input_ids=x, labels=x).loss.backward()
            _ = {k: v.clone() for k, v in m.state_dict().items()}
            opt.step()
            opt.zero_grad()
        return _state(m, opt), m.megatrain.placement()["master_streamed_layers"]

    (a, streamed), (b, _) = run(False), run(True)
    assert streamed == list(range(LAYERS))
    _assert_same(a, b)
