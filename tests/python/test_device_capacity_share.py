"""The capacity share of exclusive device-state layers: when the layers the ``"auto"`` share (half of the free
device memory) holds do not make the host store fit, the planner may make more leading layers exclusive, up to
the free device memory less the streamed schedule's minimum and an activation reserve (wrap: 20% of the free
memory; ``megatrain.estimate`` with a batch: its own activation + logits bytes). On the CPU backend the
"device" is the CPU: the device budget is faked as the other exclusive-layer tests fake it (``Engine.free_device_bytes``
and ``AUTO_DEVICE_STATE_FRACTION``)."""

import importlib
import os
import sys

import pytest
import torch

import megatrain
from megatrain import _C

sys.path.insert(0, os.path.dirname(__file__))
from test_device_exclusive import _full_host  # noqa: E402
from test_disk_offload import _assert_bits, _model, _state, _train, kept_estimate, kept_wrap  # noqa: E402

dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")
core = importlib.import_module("megatrain.runtime.engine.core")
AUTO_LAYERS, CAPACITY_LAYERS = 1, 4  # what the faked device budget holds under each share


def _sizes():
    """``(resident unit's fp32 state, one layer's whole device state, streamed schedule's minimum)`` in bytes
    (fp32 compute on the CPU backend), from a wrapped copy of the test model."""
    from megatrain.runtime.placement.streamed_minimum import streamed_device_bytes

    eng = kept_wrap(_model(), device="cpu", device_state_layers=0).megatrain
    res = next(u for u in eng.units if u.kind == "resident")
    res_state = dsp.unit_device_bytes(res, torch.float32, with_compute=False)
    layer = dsp.unit_device_bytes(eng.layers[0], torch.float32)
    slots, resident = streamed_device_bytes(eng.units, [u.numel for u in eng.units], torch.float32, eng.num_slots)
    eng.close()
    return res_state, layer, slots + resident


def _fake_device(monkeypatch):
    """A device whose free memory holds ``CAPACITY_LAYERS`` layers (and half a layer more) in the capacity share
    and whose ``"auto"`` share (a fraction chosen for it) holds the resident unit's state and 1.5 layers."""
    res_state, layer, streamed = _sizes()
    free = int((streamed + (CAPACITY_LAYERS + 0.5) * layer) / (1 - dsp.CAPACITY_ACTIVATION_RESERVE_FRACTION))
    monkeypatch.setattr(dsp, "AUTO_DEVICE_STATE_FRACTION", (res_state + (AUTO_LAYERS + 0.5) * layer) / free)
    monkeypatch.setattr(core.Engine, "free_device_bytes", lambda self: free)
    return free, layer, streamed


def _need(k, ga=1):
    """Host bytes with the fp32 state of layers ``0 .. k-1`` on the device only (explicit ``device_state_layers``;
    ``ga`` > 1: the accumulator in the store, ``grad_accumulator=True``)."""
    kw = {"grad_accumulator": True} if ga > 1 else {}
    limit = _full_host(ga) - 1
    for j in range(1, k + 1):
        m = kept_wrap(_model(), device="cpu", device_state_layers=j, host_memory_limit=limit, **kw)
        assert m.megatrain.placement()["exclusive_layers"] == list(range(j))
        need = m.megatrain.offload_plan.host_bytes
        m.megatrain.close()
        limit = need - 1
    return need


@pytest.mark.parametrize("ga,max_grad_norm", [(1, None), (2, 1.0)])
def test_beyond_the_auto_share_the_capacity_share_trains_bit_identically(monkeypatch, ga, max_grad_norm):
    """A host limit that needs 3 exclusive layers where the "auto" share holds 1 and the capacity share 4:
    layers 0..2 become exclusive (the capacity share; no other unit's state goes to the device), and training
    is bit-identical to the same device-state layers with their host sections."""
    free, layer, streamed = _fake_device(monkeypatch)
    kw = dict(device="cpu", **({"grad_accumulator": True} if ga > 1 else {}))
    ref = kept_wrap(_model(), device_state_layers="auto", **kw)  # no host limit: the auto share, 1 layer
    assert ref.megatrain.placement()["device_state_layers"] == AUTO_LAYERS
    assert ref.megatrain.placement()["exclusive_share"] is None
    ref.megatrain.close()
    model = kept_wrap(_model(), device_state_layers="auto", host_memory_limit=_need(2, ga) - 1, **kw)
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0, 1, 2] and pl["exclusive_share"] == "capacity"
    assert pl["device_state_layers"] == 3 and not pl["device_state_resident"]
    plan = model.megatrain.offload_plan
    # with the accumulator (grad_accumulator=True) each layer's device state has its fp32 gradient buffer too
    # (20 B/param with the CPU's fp32 compute, 16 without): the 4.5 layers' share holds 3 of them, still enough
    assert plan.exclusive_max == AUTO_LAYERS and plan.capacity["layers"] == (CAPACITY_LAYERS if ga == 1 else 3)
    assert plan.capacity["reserve"] == "fraction"
    assert plan.capacity["reserve_bytes"] == int(dsp.CAPACITY_ACTIVATION_RESERVE_FRACTION * free)
    assert plan.capacity["budget_bytes"] == free - streamed - plan.capacity["reserve_bytes"]
    ref = kept_wrap(_model(), device_state_layers=3, **kw)  # the same layers on the device, host sections kept
    assert ref.megatrain.placement()["exclusive_layers"] == []
    ref_opt = _train(ref, 6, ga, max_grad_norm)
    opt = _train(model, 6, ga, max_grad_norm)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))


def test_the_auto_share_when_it_is_enough(monkeypatch):
    """One exclusive layer, which the "auto" share holds: the capacity share is not sized, the report says "auto"."""
    _fake_device(monkeypatch)
    model = kept_wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=_full_host() - 1)
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0] and pl["exclusive_share"] == "auto" and pl["device_state_resident"]
    assert model.megatrain.offload_plan.capacity is None
    explicit = kept_wrap(_model(), device="cpu", device_state_layers=2, host_memory_limit=_full_host() - 1)
    assert explicit.megatrain.placement()["exclusive_share"] == "explicit"


def test_beyond_the_capacity_share_is_refused_naming_both_budgets(monkeypatch):
    """A host limit that needs 5 exclusive layers where the capacity share holds 4: one line, before anything is
    allocated, naming the "auto" share's budget and layers, the capacity share's (free, streamed, reserve), the
    layers needed and what to change."""
    free, layer, streamed = _fake_device(monkeypatch)
    limit = _need(4) - 1
    with pytest.raises(_C.HostMemoryError) as info:
        kept_wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=limit)
    msg = str(info.value)
    assert "\n" not in msg and "Nothing was allocated" in msg
    assert f"holds the whole state of {AUTO_LAYERS} decoder layers" in msg
    assert "its capacity share (" in msg and f"the whole state of {CAPACITY_LAYERS} decoder layers" in msg
    assert "for the streamed schedule" in msg and "activation reserve, 20% of the free memory" in msg
    assert "the fp32 state of 5 layers (0..4) would have to live on the device only" in msg
    assert "gpu_memory_limit" in msg and "offload_dir" in msg and "host_memory_limit" in msg


def _14b(layers):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=layers, num_attention_heads=40,
                       num_key_value_heads=8, vocab_size=32000)


def test_estimate_of_a_14b_llama_on_115_gib_of_host_and_141_gib_of_gpu():
    """50 layers of the 14B shape (14.09B parameters), 4 x 4096 tokens: the "auto" share holds 14 layers' whole
    state, too few for 115 GiB of host; the capacity share (141 GiB less the streamed schedule and this batch's
    activation estimate) holds enough: the fewest layers that make the host part fit are exclusive, and the
    verdict follows from the totals."""
    est = kept_estimate(_14b(50), host_memory="115GiB", gpu_memory="141GiB", seq_len=4096, micro_batch_size=4)
    gib = 2 ** 30
    k = est.exclusive_layers
    assert est.exclusive_share == "capacity" and est.exclusive_max < k <= est.capacity_max
    # the reserve is this batch's estimate under recompute (what "auto" falls back to), not the 20% default
    assert est.activation_reserve_bytes < 0.2 * 141 * gib
    assert est.capacity_budget_bytes == 141 * gib - est.slot_bytes - est.resident_bytes - est.activation_reserve_bytes
    per_layer = est.exclusive_device_bytes // k  # each exclusive layer's whole device state: 14 B/param
    assert 14 * 274e6 < per_layer < 14 * 276e6 and est.capacity_max == est.capacity_budget_bytes // per_layer
    # the fewest: with one layer fewer its fp32 state (12 B/param) would be back in the host, over 115 GiB
    assert est.host_bytes <= 115 * gib < est.host_bytes + est.exclusive_bytes // k
    assert est.gpu_bytes == (est.slot_bytes + est.resident_bytes + est.exclusive_device_bytes + est.activation_bytes
                             + est.logits_bytes)
    assert est.fits == (est.host_bytes <= 115 * gib and est.gpu_bytes <= 141 * gib)
    assert est.fits  # 14.09B parameters on this machine
    assert "the capacity share" in str(est)


def test_accumulation_counts_each_exclusive_layers_fp32_gradient_buffer():
    """With gradients summed (``gradient_accumulation_steps`` 2) each exclusive layer holds 18 B/param on the GPU
    (bf16 compute copy, fp32 master, moments and accumulator): the capacity share is sized with those bytes, so
    the exclusive layers' device state stays within it and the rest goes to disk (a 7B shape on a 40 GiB GPU and
    60 GiB of host); the summed gradients wait in the host accumulator, so no held gradient is counted."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=32000)
    kw = dict(host_memory="60GiB", gpu_memory="40GiB", micro_batch_size=1, seq_len=2048, max_grad_norm=1.0,
              offload_dir="/tmp")
    for accumulator in (True, None):
        est = megatrain.estimate(cfg, gradient_accumulation_steps=2, grad_accumulator=accumulator, **kw)
        assert est.fits and est.exclusive_layers and est.disk_layers
        assert est.exclusive_device_bytes <= est.capacity_budget_bytes
        per_param = est.exclusive_device_bytes / (est.exclusive_layers * 177_217_536)  # params of one such layer
        assert 18.0 <= per_param < 18.01
        assert "held gradients" not in str(est)
    one = megatrain.estimate(cfg, **kw)  # one backward per step: 14 B/param, held gradients counted
    assert one.exclusive_device_bytes / (one.exclusive_layers * 177_217_536) < 14.01 and "held gradients" in str(one)


def test_an_unplanned_accumulator_that_does_not_fit_the_device_is_refused_in_one_line(monkeypatch):
    """Exclusive layers wrapped without grad_accumulator=True, then CPUAdamW(gradient_accumulation_steps=2) when
    their fp32 accumulators do not fit the free device memory: one line naming grad_accumulator=True, and nothing
    allocated (the host accumulator neither)."""
    model = kept_wrap(_model(), device="cpu", device_state_layers=2, host_memory_limit=_full_host() - 1)
    eng = model.megatrain
    assert eng.placement()["exclusive_layers"] == [0]
    monkeypatch.setattr(core.Engine, "free_device_bytes", lambda self: 1024)
    with pytest.raises(RuntimeError, match=r"^megatrain: gradient accumulation needs the fp32 accumulators of 2 "
                                           r"device-state layers .* wrap with grad_accumulator=True") as info:
        megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=2)
    assert "\n" not in str(info.value)
    assert all(u.device_state.grad is None for u in eng.device_state.units) and eng.accumulator.nbytes() == 0
    monkeypatch.undo()  # with the device memory there, the device check passes (the host limit is its own check)
    eng.device_state.check_accumulator()


def test_a_slightly_short_host_makes_an_auto_share_layer_exclusive_before_master_streaming(monkeypatch):
    """host_compute_copy="auto" (the default) with the host one byte short: the layers the "auto" share puts on the
    device anyway (device_state_layers="auto") are tried exclusive first, which costs no device memory beyond that
    placement and no streaming; only when they are not enough are the deepest layers master-streamed."""
    _fake_device(monkeypatch)
    full = _full_host()
    model = megatrain.wrap(_model(), device="cpu", device_state_layers="auto", host_memory_limit=full - 1)
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == [0] and pl["master_streamed_layers"] == [] and pl["exclusive_share"] == "auto"
    model.megatrain.close()
    # device_state_layers=0 puts no layer on the device, "boundary" the auto share's layers neither (it keeps the
    # device for activations): the deepest layer is master-streamed instead
    for layers in (0, "boundary"):
        model = megatrain.wrap(_model(), device="cpu", device_state_layers=layers, host_memory_limit=full - 1)
        pl = model.megatrain.placement()
        assert pl["exclusive_layers"] == [] and pl["master_streamed_layers"] == [len(model.megatrain.layers) - 1]
        model.megatrain.close()
