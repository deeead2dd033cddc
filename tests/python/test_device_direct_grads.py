"""Device-state decoder layers without the fp32 gradient buffer at ``gradient_accumulation_steps`` 1.

A device-state layer's first gradient of a step goes into its own compute buffer (*direct*); its
fp32 ``grad`` buffer (4 B/param) is allocated only when gradients are summed. The reference for
bit-identity is the path that sums every gradient into the fp32 buffer (what every device-state
layer did before: ``direct_grads`` off, ``grad`` allocated); parity with ``torch.optim.AdamW`` is
checked in test_device_state.py. On the CPU backend the "device" is the CPU.
"""

import importlib

import pytest
import torch

import megatrain
from parity import make_batches, poison_gradient_at
from test_parity_cpu import tiny

dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")


def _wrap(dtype=torch.bfloat16, k=3, seed=0):
    torch.manual_seed(seed)
    return megatrain.wrap(tiny("llama"), device="cpu", compute_dtype=dtype, activation_policy="recompute",
                          device_state_layers=k)


def _device_units(model):
    return [u for u in model.megatrain.layers if u.device_state is not None]


def _sum_into_fp32_buffer(model):
    """The reference path: every gradient summed into the fp32 ``grad`` buffer (no direct gradient)."""
    for u in _device_units(model):
        u.device_state.direct_grads = False
        u.device_state.ensure_grad()


def _train(direct: bool, ga: int, clip, micro: int, dtype=torch.bfloat16, steps: int = 3, impl=None, monkeypatch=None):
    if impl is not None:
        monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", impl)
    model = _wrap(dtype)
    if not direct:
        _sum_into_fp32_buffer(model)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=clip,
                                   gradient_accumulation_steps=ga)
    for batch in make_batches(96, steps, micro, 2, 16, seed=1):
        for x in batch:
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    moments = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)} for k, s in opt.state_dict()["state"].items()}
    return megatrain.master_state_dict(model), moments, model, opt


def _assert_identical(a, b):
    (pa, ma), (pb, mb) = a[:2], b[:2]
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    assert ma.keys() == mb.keys()
    for k in ma:
        for n in ma[k]:
            assert torch.equal(ma[k][n], mb[k][n]), (k, n)


@pytest.mark.parametrize("ga,clip,micro", [(1, None, 1), (1, 1.0, 1), (2, 1.0, 2), (3, None, 3), (1, 1.0, 2)])
def test_direct_gradients_train_bit_identically_to_the_fp32_buffer_path(ga, clip, micro):
    """(1, 1.0, 2): two backwards at gradient_accumulation_steps 1 (the first gradient moves to the buffer)."""
    got = _train(True, ga, clip, micro)
    _assert_identical(got, _train(False, ga, clip, micro))
    summed = micro > 1
    assert all((u.device_state.grad is not None) == summed for u in _device_units(got[2]))


def test_direct_gradients_with_the_fused_device_adamw_and_fp32_compute(monkeypatch):
    for dtype, clip in ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, 1.0)):
        got = _train(True, 1, clip, 1, dtype=dtype, impl="fused", monkeypatch=monkeypatch)
        _assert_identical(got, _train(False, 1, clip, 1, dtype=dtype, impl="fused", monkeypatch=monkeypatch))


def test_device_layers_hold_no_fp32_gradient_buffer_without_accumulation():
    model = _wrap(torch.bfloat16)
    units = _device_units(model)
    assert len(units) == 3
    for u in units:
        du = u.device_state
        assert du.grad is None
        assert du.nbytes == 2 * u.numel + 12 * u.state_numel == dsp.unit_device_bytes(u, torch.bfloat16)
    before = model.megatrain.device_state.nbytes
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
    x = make_batches(96, 1, 1, 2, 16, seed=1)[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert all(u.device_state.grad is None for u in units)
    assert model.megatrain.device_state.nbytes == before
    # accumulation declared: the buffers exist from the optimizer's creation, and are counted
    opt2 = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, gradient_accumulation_steps=2)
    assert opt2 is not None and all(u.device_state.grad is not None for u in units)
    assert model.megatrain.device_state.nbytes == before + sum(4 * u.state_numel for u in units)


def test_planner_counts_12_bytes_of_fp32_state_per_layer_and_16_for_the_resident_unit():
    model = _wrap(torch.bfloat16, k=1)
    u = model.megatrain.layers[0]
    assert dsp.unit_device_bytes(u, torch.bfloat16) == 2 * u.numel + 12 * u.state_numel
    assert dsp.unit_device_bytes(u, torch.bfloat16, with_grad=True) == 2 * u.numel + 16 * u.state_numel
    res = model.megatrain.resident
    assert dsp.unit_device_bytes(res, torch.bfloat16, with_compute=False) == 16 * res.state_numel


def test_weights_read_between_backward_and_step_are_the_weights_not_the_gradient():
    model = _wrap(torch.bfloat16)
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    batches = make_batches(96, 3, 1, 2, 16, seed=1)
    x = batches[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()  # the device copies are now newer than the host store's (to_host copies on read)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    units = _device_units(model)
    assert all(u.device_state.host_stale for u in units)
    y = batches[1][0]
    model(input_ids=y, labels=y).loss.backward()
    assert all(u.device_state.grad_in_compute for u in units)
    eng.sync_host()  # what checkpoint, export and state_dict read
    for u in units:  # the host store's compute copy: the master rounded, not the gradient
        host = eng.store.section(u.index, "compute")
        for i, e in enumerate(u.entries):
            want = u.device_state.fp32("master", i).to(torch.bfloat16)
            assert torch.equal(host[e.offset:e.offset + e.numel], want), e.name
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():  # a forward before the step runs on the weights (the gradient moves to the buffer)
        assert torch.equal(model(input_ids=x).logits, logits)
    assert all(u.device_state.grad is not None for u in units)  # the gradient still counted: it moved there
    after = model.state_dict()
    for k in sd:
        assert torch.equal(after[k], sd[k]), k
    opt.step()
    got = megatrain.master_state_dict(model)
    # the same two steps without the reads in between
    ref_model = _wrap(torch.bfloat16)
    ref_opt = megatrain.optim.CPUAdamW(ref_model.parameters(), lr=1e-2, max_grad_norm=1.0)
    for b in batches[:2]:
        ref_model(input_ids=b[0], labels=b[0]).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = megatrain.master_state_dict(ref_model)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("clip", [None, 1.0])
def test_skipped_nonfinite_step_leaves_weights_and_state_exact(clip):
    model = _wrap(torch.bfloat16)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=clip)
    batches = make_batches(96, 2, 1, 2, 16, seed=1)
    x = batches[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    units = _device_units(model)
    keep = [{n: getattr(u.device_state, n).clone() for n in ("compute", "master", "exp_avg", "exp_avg_sq")}
            for u in units]
    handle = poison_gradient_at(model.model.layers[2])  # reaches every layer below: all device layers skip
    y = batches[1][0]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        model(input_ids=y, labels=y).loss.backward()
        opt.step()
    handle.remove()
    for u, k in zip(units, keep):
        assert not u.device_state.grad_in_compute
        for n, t in k.items():
            assert torch.equal(getattr(u.device_state, n), t), (u.index, n)


def test_optimizer_state_read_between_backward_and_step_keeps_the_direct_gradient():
    """``optimizer.state[p]`` hands the host sections out writable: the update first takes them back
    (``from_host``), which must leave the gradient in the compute buffer."""
    def run(read: bool):
        model = _wrap(torch.bfloat16)
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
        p = model.model.layers[0].mlp.up_proj.weight
        for batch in make_batches(96, 2, 1, 2, 16, seed=1):
            model(input_ids=batch[0], labels=batch[0]).loss.backward()
            if read:
                assert opt.state[p]["exp_avg"].shape == p.shape
                assert model.megatrain.layers[0].device_state.host_dirty
            opt.step()
            opt.zero_grad()
        return megatrain.master_state_dict(model)

    got, ref = run(True), run(False)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
