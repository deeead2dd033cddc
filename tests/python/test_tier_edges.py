"""Edge cases of the tiers where a layer's state is not all in the host store: exclusive device-state
layers (no host section at all), master-streamed layers (no host compute copy) and the disk tier. Each
scenario is compared with the same training with every section in the host store (bit-identical where the
updates run in the same place) or refused in one line where megatrain cannot do what torch would."""

import os
import sys

import pytest
import torch

import megatrain

sys.path.insert(0, os.path.dirname(__file__))
from parity import make_batches  # noqa: E402
from test_device_exclusive import assert_state_dict_copy_write_refused  # noqa: E402
from test_disk_offload import VOCAB, _wrap as _disk_wrap  # noqa: E402


def test_a_write_into_a_disk_layers_state_dict_copy_is_refused_not_lost(tmp_path):
    """``model.state_dict()`` of a disk-tier layer is a copy read from the tier (there is no lasting host view):
    an in-place write into it cannot reach the weights. It was dropped silently (the next steps trained on the
    old weights); the next forward now refuses it in one line naming ``load_state_dict``, as for an exclusive
    device-state layer's copy."""
    model = _disk_wrap(tmp_path)
    name = next(e.name for e in model.megatrain.disk.units[-1].entries if not e.frozen)
    assert_state_dict_copy_write_refused(model, name, "disk tier")


def test_reading_a_closed_models_disk_layers_says_it_was_closed(tmp_path):
    """After ``model.megatrain.close()`` the disk tier's state is gone: ``state_dict()``, ``master_state_dict`` and
    ``save_checkpoint`` raised ``AttributeError: 'NoneType' object has no attribute 'acquire'``; now one line saying
    the model was closed and what to do (before any checkpoint file is written)."""
    model = _disk_wrap(tmp_path)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    model.megatrain.close()
    for read in (model.state_dict, lambda: megatrain.master_state_dict(model), opt.state_dict):
        with pytest.raises(RuntimeError, match=r"closed.*model\.megatrain\.close\(\)") as ei:
            read()
        assert "\n" not in str(ei.value)
    with pytest.raises(RuntimeError, match="closed"):
        megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    assert not os.path.exists(tmp_path / "ckpt") or not os.listdir(tmp_path / "ckpt")


def test_reads_and_moment_writes_between_backward_and_step_without_host_compute_sections():
    """Layer 0 exclusive (no host section), the other eligible layers master-streamed (no host compute copy):
    ``state_dict()`` / ``master_state_dict`` / ``optimizer.state_dict()`` reads between micro-batches and before
    ``step()``, and in-place writes into ``optimizer.state[p]["exp_avg"]`` of both kinds of layer, train
    bit-identically to every section in the host store (the same layer on the device, with host sections)."""
    import test_all_tiers as T

    ga, batches = 2, make_batches(T.VOCAB, 3, 2, 2, 8, seed=3)
    streamed = megatrain.wrap(T._model(), host_compute_copy=False, **T._kw(ga))
    need = streamed.megatrain.offload_plan.host_bytes
    streamed.megatrain.close()
    written = ["model.layers.0.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"]

    def reads(m, opt):
        m.state_dict(), megatrain.master_state_dict(m), opt.state_dict()

    out = []
    for kw in (dict(host_compute_copy=True), dict(host_compute_copy=False, host_memory_limit=need - 1)):
        m = megatrain.wrap(T._model(), **kw, **T._kw(ga))
        pl = m.megatrain.placement()
        assert (pl["exclusive_layers"], 3 in pl["master_streamed_layers"]) == (([0], True) if "host_memory_limit" in kw
                                                                                else ([], False))
        opt = T._opt(m, ga, 1.0)
        params = dict(m.named_parameters())
        for s, micro in enumerate(batches):
            for x in micro:
                (m(input_ids=x, labels=x).loss / ga).backward()
                reads(m, opt)
            if s == 1:
                for k in written:
                    opt.state[params[k]]["exp_avg"].mul_(0.5)
            opt.step()
            opt.zero_grad()
        out.append({**megatrain.master_state_dict(m), **{f"{k}.exp_avg": opt.state[params[k]]["exp_avg"].clone()
                                                         for k in written}})
        m.megatrain.close()
    assert out[0].keys() == out[1].keys()
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k


def test_an_in_place_write_into_a_disk_layers_optimizer_state_copy_is_refused_not_lost(tmp_path):
    """``optimizer.state[p]["exp_avg"]`` of a disk-tier parameter is a copy read from the tier: an in-place write
    into it was lost silently (the step used the tier's moments). The next ``step()`` now refuses it in one line
    naming ``optimizer.load_state_dict``, before anything of the step is touched; reads stay free."""
    model = _disk_wrap(tmp_path)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    name = next(e.name for e in model.megatrain.disk.units[-1].entries if not e.frozen)
    p = dict(model.named_parameters())[name]
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=1)[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    before = opt.state[p]["exp_avg"].clone()  # a read: nothing to refuse
    model(input_ids=x, labels=x).loss.backward()
    opt.state[p]["exp_avg"].fill_(0.5)
    with pytest.raises(RuntimeError, match=r"^megatrain: optimizer.state\[p\]\['exp_avg'\] of .* disk tier .*"
                                           r"optimizer.load_state_dict") as ei:
        opt.step()
    assert "\n" not in str(ei.value) and name.endswith(str(ei.value).split(" of ")[1].split(" was ")[0])
    assert torch.equal(opt.state[p]["exp_avg"], before)  # the tier's moments: untouched
    opt.step()  # refused once: the step then runs
    assert not torch.equal(opt.state[p]["exp_avg"], before)
    model.megatrain.close()


def test_a_closed_model_refuses_a_forward_in_one_line():
    """After ``model.megatrain.close()`` a forward ran and the next backward failed in the C++ worker ("submit after
    close()"); the forward itself now says the model was closed and what to do, before anything runs."""
    from test_master_streamed import _model as _small

    model = megatrain.wrap(_small(), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    x = make_batches(VOCAB, 1, 1, 2, 8, seed=1)[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    model.megatrain.close()
    with pytest.raises(RuntimeError, match=r"^megatrain: this model was closed \(model.megatrain.close\(\)\)") as ei:
        model(input_ids=x, labels=x)
    assert "\n" not in str(ei.value)
    assert megatrain.master_state_dict(model)  # the host store's state can still be read
