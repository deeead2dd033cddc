"""``model.state_dict()`` tensors held across optimizer steps, for layers whose state is on the device.

torch's state_dict tensors are the parameters: one kept after later ``step()`` calls reads the
current weights, and an in-place write into it changes the parameter. On a wrapped model they are
views of the host store's fp32 masters; a device-state layer (``device_state_layers``) is updated on
the device, and ``step()`` copies its new masters to the host store while such a tensor of it is
alive (only then). On the CPU backend the "device" is the CPU (separate buffers, the same logic).
"""

import copy
import gc
import importlib

import pytest
import torch

import megatrain
from parity import PARITY_EPS, assert_close_rel, make_batches
from test_device_state import HOST_RTOL, _device_layers, _limit_device_room, _step_both
from test_parity_cpu import tiny

LAYER0 = "model.layers.0.mlp.up_proj.weight"  # a device-state layer's weight in every case below


def _wrap_with_reference(k, monkeypatch):
    if k == "auto":
        _limit_device_room(monkeypatch, 1)  # the resident unit and layer 0 on the device, the rest streamed
    model = tiny("llama")
    ref_model = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=k)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=PARITY_EPS, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=PARITY_EPS, foreach=False)
    assert _device_layers(wrapped)[:1] == [0]
    return wrapped, opt, ref_model, ref_opt


@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_a_held_state_dict_reads_the_current_weights_after_steps(monkeypatch, k):
    """``sd = model.state_dict()`` taken before training: after 3 steps every ``sd[name]`` equals a new
    ``model.state_dict()[name]`` and torch.optim.AdamW's parameter (device-state layers, the resident
    unit under ``"auto"``, streamed layers)."""
    wrapped, opt, ref_model, ref_opt = _wrap_with_reference(k, monkeypatch)
    sd = wrapped.state_dict()
    init = sd[LAYER0].clone()
    for (x,) in make_batches(96, 3, 1, 2, 12, seed=6):
        _step_both(wrapped, opt, ref_model, ref_opt, x)
    assert not torch.equal(sd[LAYER0], init)
    now = wrapped.state_dict()
    names = dict(ref_model.named_parameters())
    for name, t in sd.items():
        assert torch.equal(t, now[name]), name
        if name in names:
            assert_close_rel(t, names[name].detach(), HOST_RTOL, name)


def test_a_dropped_state_dict_costs_no_copy_from_the_device(monkeypatch):
    """No state_dict tensor alive: ``step()`` copies nothing to the host store; a slice of one tensor of
    layer 0 alive (its state dict dropped): each ``step()`` copies layer 0's masters alone (not its
    moments, not the other layer's), and the slice reads the current weights."""
    ds = importlib.import_module("megatrain.runtime.placement.device_state").DeviceState
    copied, full = [], []
    masters_to_host, to_host = ds.masters_to_host, ds.to_host

    def count_masters(self, units=None):
        copied.append(sorted(u.index for u in self._select(units) if u.device_state.host_master_stale))
        return masters_to_host(self, units)

    def count_full(self, units=None):
        full.append(sorted(u.index for u in self._select(units) if u.device_state.host_stale))
        return to_host(self, units)

    monkeypatch.setattr(ds, "masters_to_host", count_masters)
    monkeypatch.setattr(ds, "to_host", count_full)
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
    data = make_batches(96, 5, 1, 2, 12, seed=2)

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    sd = model.state_dict()
    assert LAYER0 in sd
    del sd
    gc.collect()
    full.clear()
    for (x,) in data[:2]:
        step(x)
    assert copied == [] and full == []
    layer0 = model.megatrain.layers[0].index
    held = model.state_dict()[LAYER0][1:3]
    gc.collect()
    full.clear()
    for (x,) in data[2:4]:
        step(x)
    assert copied == [[layer0], [layer0]] and full == []
    assert torch.equal(held, megatrain.master_state_dict(model)[LAYER0][1:3])
    del held
    gc.collect()
    full.clear()
    step(data[4][0])
    assert copied == [[layer0], [layer0]] and full == []
    assert model.megatrain.layers[0].device_state.host_stale  # the moments are copied when read, not before


@pytest.mark.parametrize("k", [1, "auto"])
def test_writes_through_held_state_dict_tensors_are_taken_as_in_torch(monkeypatch, k):
    """The same in-place edits on both models: through a state dict held across a step, after
    ``step()`` (the next forward uses it) and between ``backward()`` and ``step()`` (the update
    applies to the written weights); every parameter compared with torch.optim.AdamW's after."""
    wrapped, opt, ref_model, ref_opt = _wrap_with_reference(k, monkeypatch)
    sd, ref_sd = wrapped.state_dict(), ref_model.state_dict()
    keys = (LAYER0, "model.layers.2.self_attn.q_proj.weight", "lm_head.weight")
    data = make_batches(96, 4, 1, 2, 12, seed=7)
    for step, (x,) in enumerate(data):
        if step == 2:  # after the last step
            with torch.no_grad():
                for d in (sd, ref_sd):
                    for name in keys:
                        d[name].mul_(0.5)
        for m, o in ((wrapped, opt), (ref_model, ref_opt)):
            m(input_ids=x, labels=x).loss.backward()
            if step == 1:  # the gradients are in, the update not yet
                with torch.no_grad():
                    for name in keys:
                        (sd if m is wrapped else ref_sd)[name].add_(0.01)
            if m is ref_model:
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
            o.step()
            o.zero_grad()
    got = megatrain.master_state_dict(wrapped)
    for name, p in ref_model.named_parameters():
        assert_close_rel(got[name], p.detach(), HOST_RTOL, name)
        assert torch.equal(sd[name], got[name]), name


def test_a_write_through_a_tensor_not_alive_through_the_last_step_is_refused():
    """A ``.detach()`` of a state_dict tensor kept after the state dict was dropped is not refreshed by
    ``step()``: a write through it (into an older master) is refused at the next forward, the device
    state unchanged; after a new ``model.state_dict()`` (which refreshes the host store it views) a
    write is taken."""
    model = megatrain.wrap(tiny("llama"), device="cpu", compute_dtype=torch.float32, device_state_layers=1)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    x = make_batches(96, 1, 1, 2, 12, seed=3)[0][0]
    u = model.megatrain.layers[0]
    e = [i for i, en in enumerate(u.entries) if en.name == LAYER0][0]
    alias = model.state_dict()[LAYER0].detach()
    old = alias.clone()
    gc.collect()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    device_master = u.device_state.fp32("master", e).view_as(alias)
    trained = device_master.clone()
    assert torch.equal(alias, old) and not torch.equal(trained, old)  # the master of before the step
    with torch.no_grad():
        alias.mul_(3)
    with pytest.raises(RuntimeError, match=r"state_dict\(\) tensor holding an older master"):
        model(input_ids=x, labels=x)
    assert torch.equal(device_master, trained)
    fresh = model.state_dict()  # the host store current again: the alias views it too
    assert torch.equal(alias, trained) and torch.equal(fresh[LAYER0], trained)
    with torch.no_grad():
        fresh[LAYER0].mul_(3)
        model(input_ids=x)
    assert torch.equal(device_master, trained * 3)
    assert torch.equal(megatrain.master_state_dict(model)[LAYER0], trained * 3)


def test_held_state_dict_tensors_of_host_layers_read_the_step_when_it_returns(monkeypatch):
    """Host-stored layers with clipping: the CPU updates are queued in ``step()`` and run on the worker
    while the next forward starts. A held state_dict tensor reads the store directly, so ``step()``
    waits for the updates of the units with such a tensor alive (only those) before it returns, and
    each read right after ``step()`` is torch's parameter after its step."""
    slots = importlib.import_module("megatrain.runtime.engine.waits").Waits
    waited = []
    wait_update = slots.wait_update

    def record(self, unit):
        waited.append(unit.index)
        return wait_update(self, unit)

    monkeypatch.setattr(slots, "wait_update", record)
    model = tiny("llama")
    ref_model = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=0)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=PARITY_EPS, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=PARITY_EPS, foreach=False)
    names = dict(ref_model.named_parameters())
    held = {LAYER0: wrapped.state_dict()[LAYER0]}  # layer 0 only: its state dict dropped
    for (x,) in make_batches(96, 3, 1, 2, 12, seed=6):
        wrapped(input_ids=x, labels=x).loss.backward()
        waited.clear()
        opt.step()
        assert waited == [0], waited  # the held unit's update, none of the others'
        after = held[LAYER0].clone()  # read at once, before anything else could wait for the update
        opt.zero_grad()
        ref_model(input_ids=x, labels=x).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        assert_close_rel(after, names[LAYER0].detach(), HOST_RTOL, LAYER0)
    del held
    gc.collect()
    (x,) = make_batches(96, 1, 1, 2, 12, seed=7)[0]
    wrapped(input_ids=x, labels=x).loss.backward()
    waited.clear()
    opt.step()
    assert waited == []  # nothing held: step() returns at once


def test_a_write_after_backward_without_clipping_is_refused():
    """Without ``max_grad_norm`` a host-stored layer's update runs during ``backward()``: a write into its
    state_dict tensor after that would replace the updated weights (torch updates the written ones),
    so ``step()`` refuses it with what to do; a write before the backward is taken as torch's."""
    model = tiny("llama")
    ref_model = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=0)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=PARITY_EPS)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=PARITY_EPS, foreach=False)
    sd, ref_sd = wrapped.state_dict(), ref_model.state_dict()
    (x,), (y,) = make_batches(96, 2, 1, 2, 12, seed=8)
    for t in (sd[LAYER0], ref_sd[LAYER0]):
        t.mul_(0.5)  # before the forward: what this step updates
    for m, o in ((wrapped, opt), (ref_model, ref_opt)):
        m(input_ids=x, labels=x).loss.backward()
        o.step()
        o.zero_grad()
    assert_close_rel(sd[LAYER0], ref_model.get_parameter(LAYER0).detach(), HOST_RTOL, LAYER0)
    wrapped(input_ids=y, labels=y).loss.backward()
    sd[LAYER0].add_(0.25)
    with pytest.raises(RuntimeError, match=r"written through a model.state_dict\(\) tensor after backward\(\)"):
        opt.step()


def test_a_write_into_a_frozen_layer_after_backward_without_clipping_is_taken():
    """A frozen parameter has no update that a write after ``backward()`` could replace: without
    ``max_grad_norm`` such a write is taken as torch's (the next forward uses it), not refused."""
    model = tiny("llama")
    model.model.layers[0].requires_grad_(False)
    ref_model = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=0)
    opt = megatrain.optim.CPUAdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3, eps=PARITY_EPS)
    ref_opt = torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-3, eps=PARITY_EPS,
                                foreach=False)
    sd, ref_sd = wrapped.state_dict(), ref_model.state_dict()
    for (x,) in make_batches(96, 3, 1, 2, 12, seed=9):
        losses = []
        for m, o, d in ((wrapped, opt, sd), (ref_model, ref_opt, ref_sd)):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            d[LAYER0].mul_(0.9)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert_close_rel(sd[LAYER0], ref_sd[LAYER0], 1e-6, LAYER0)


@pytest.mark.parametrize("key", ["model.embed_tokens.weight", LAYER0])  # a resident entry, a streamed layer's
def test_a_frozen_bf16_entry_written_in_place_is_told_to_use_load_state_dict(key):
    """A frozen entry in a bf16 compute copy has no fp32 master and its ``state_dict()`` tensor is an fp32 copy:
    a parameter written in place is refused at the next forward with advice that works for it
    (``load_state_dict``), not ``state_dict()[name].copy_`` (refused too); following it sets the value."""
    model = tiny("llama")
    model.model.embed_tokens.weight.requires_grad_(False)
    model.model.layers[0].mlp.requires_grad_(False)
    w = megatrain.wrap(model, device="cpu", compute_dtype=torch.bfloat16)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    param = dict(w.named_parameters())[key]
    new = (w.state_dict()[key] + 1.0).bfloat16().float()
    with torch.no_grad():
        param.add_(1.0)
    with pytest.raises(RuntimeError) as info:
        w(input_ids=x, labels=x)
    msg = str(info.value)
    assert "\n" not in msg and f"megatrain: {key} was modified in place" in msg
    assert "frozen (requires_grad=False at megatrain.wrap)" in msg and "model.load_state_dict(...)" in msg
    assert "state_dict()[name].copy_" not in msg and "write the masters" not in msg
    w.load_state_dict({key: new}, strict=False)  # the advice
    assert torch.equal(w.state_dict()[key], new)
    with torch.no_grad():
        w(input_ids=x, labels=x)
    sd = w.state_dict()
    sd[key].add_(1.0)  # the other advice of a trainable entry: refused for this one, naming load_state_dict
    with pytest.raises(RuntimeError, match=r"frozen .*fp32 copy.*model\.load_state_dict"):
        w(input_ids=x, labels=x)


def test_a_trainable_entry_written_in_place_keeps_its_advice():
    w = megatrain.wrap(tiny("llama"), device="cpu", compute_dtype=torch.bfloat16)
    with torch.no_grad():
        w.model.embed_tokens.weight.add_(1.0)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=r"model\.state_dict\(\)\[name\]\.copy_\(\.\.\.\) \(both write the masters\)"):
        w(input_ids=x, labels=x)
