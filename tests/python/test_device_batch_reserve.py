"""``wrap(micro_batch_size=, seq_len=)``: with the batch known, the capacity share of exclusive device-state layers
keeps exactly the activation + logits bytes ``megatrain.estimate`` counts for that batch (the same function), so
wrap plans the exclusive layers the estimate reports; without it, 20% of the free device memory. On the CPU backend
the "device" is faked as the other capacity-share tests fake it (``Engine.free_device_bytes`` and
``AUTO_DEVICE_STATE_FRACTION``); the estimate is asked about a GPU with the same free bytes (``gpu_memory=``) and the
same compute dtype and policy, so that both plan from the same numbers."""

import importlib
import os
import sys
import warnings

import pytest
import torch

import megatrain
from megatrain import _C

sys.path.insert(0, os.path.dirname(__file__))
from test_device_capacity_share import _need, _sizes  # noqa: E402
from test_disk_offload import _model  # noqa: E402

dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")
core = importlib.import_module("megatrain.runtime.engine.core")
BATCH = dict(micro_batch_size=2, seq_len=8)
# wrap's CPU defaults, for the estimate too; every compute copy in the host store (the layout the exclusive tier is
# tested with: "auto" would stream layers from their masters first)
SAME = dict(compute_dtype=torch.float32, activation_policy="recompute", host_compute_copy=True)
EXCLUSIVE = 5  # layers the host limit makes exclusive; the 20% reserve leaves room for 4 of them only


def _estimate(free, limit, **kw):
    """The estimate of the test model on a GPU with ``free`` bytes free and ample host memory, under ``limit``."""
    return megatrain.estimate(_model(), gpu_memory=free, host_memory="1TiB", host_memory_limit=limit, **SAME, **kw)


def _fake_device(monkeypatch):
    """A device whose capacity share holds ``EXCLUSIVE`` layers (and half a layer more) after this batch's
    activation estimate, and fewer after 20% of its free memory; its ``"auto"`` share holds one layer. Returns
    ``(free bytes, a host limit that needs EXCLUSIVE exclusive layers)``."""
    res_state, layer, streamed = _sizes()
    limit = _need(EXCLUSIVE - 1) - 1
    free = streamed + (EXCLUSIVE + 0.5) * layer
    for _ in range(3):  # the batch's reserve depends (a little: loss chunks) on the free bytes
        reserve = _estimate(free, limit, **BATCH).activation_reserve_bytes
        free = int(streamed + (EXCLUSIVE + 0.5) * layer + reserve)
    assert 0 < reserve < dsp.CAPACITY_ACTIVATION_RESERVE_FRACTION * free - layer / 2  # the 20%: a layer fewer
    monkeypatch.setattr(dsp, "AUTO_DEVICE_STATE_FRACTION", (res_state + 1.5 * layer) / free)
    monkeypatch.setattr(core.Engine, "free_device_bytes", lambda self: free)
    return free, limit


def test_wrap_with_the_batch_plans_the_exclusive_layers_the_estimate_plans(monkeypatch):
    """A host limit that needs 5 exclusive layers: the estimate with the batch plans 5 (capacity share); wrap with
    the same batch plans exactly those, keeping the estimate's reserve; wrap without the batch keeps 20% of the free
    memory, whose capacity share holds only 4, and refuses in one line."""
    free, limit = _fake_device(monkeypatch)
    est = _estimate(free, limit, **BATCH)
    assert est.exclusive_layers == EXCLUSIVE and est.exclusive_share == "capacity" and est.host_fits
    model = megatrain.wrap(_model(), device="cpu", device_state_layers="auto", host_compute_copy=True,
                           host_memory_limit=limit, **BATCH)
    pl = model.megatrain.placement()
    assert pl["exclusive_layers"] == list(range(est.exclusive_layers)) and pl["exclusive_share"] == "capacity"
    assert pl["activation_reserve"] == "batch 2 x 8"
    assert pl["activation_reserve_bytes"] == est.activation_reserve_bytes
    assert model.megatrain.offload_plan.capacity["budget_bytes"] == est.capacity_budget_bytes
    model.megatrain.close()
    with pytest.raises(_C.HostMemoryError) as info:  # the batch unknown: 20% of the free memory
        megatrain.wrap(_model(), device="cpu", device_state_layers="auto", host_compute_copy=True,
                       host_memory_limit=limit)
    msg = str(info.value)
    assert "\n" not in msg and "activation reserve, 20% of the free memory" in msg
    assert f"the whole state of {EXCLUSIVE - 1} decoder layers" in msg
    # one of the two alone is not a batch: refused before any planning (not the fraction, silently)
    with pytest.raises(ValueError, match="^megatrain.wrap: seq_len=8 was given without micro_batch_size; pass both"):
        megatrain.wrap(_model(), device="cpu", device_state_layers="auto", host_compute_copy=True,
                       host_memory_limit=limit, seq_len=8)


def test_placement_names_the_fraction_without_a_batch(monkeypatch):
    """Without the batch, ``placement()`` says the reserve is the 20% share and how many bytes it kept."""
    free, _ = _fake_device(monkeypatch)
    model = megatrain.wrap(_model(), device="cpu", device_state_layers="auto", host_compute_copy=True,
                           host_memory_limit=_need(2) - 1)
    pl = model.megatrain.placement()
    assert pl["exclusive_share"] == "capacity" and pl["activation_reserve"] == "20% of free memory"
    assert pl["activation_reserve_bytes"] == int(dsp.CAPACITY_ACTIVATION_RESERVE_FRACTION * free)
    model.megatrain.close()


@pytest.mark.parametrize("name,value,what", [
    ("micro_batch_size", 0, "sequences per micro-batch"), ("micro_batch_size", True, "sequences per micro-batch"),
    ("micro_batch_size", 2.0, "sequences per micro-batch"), ("seq_len", -1, "tokens per sequence"),
    ("seq_len", "4096", "tokens per sequence")])
def test_a_bad_batch_is_refused_in_one_line_before_anything_is_built(name, value, what):
    model = _model()
    with pytest.raises(ValueError) as info:
        megatrain.wrap(model, device="cpu", **{name: value})
    assert str(info.value) == f"megatrain.wrap: {name} must be an int >= 1 ({what}) or None, got {value!r}"
    assert getattr(model, "megatrain", None) is None
    with pytest.raises(ValueError, match=f"^megatrain.from_config: {name} must be an int >= 1"):
        megatrain.from_config(model.config, device="cpu", **{name: value})


@pytest.mark.parametrize("given,value,missing", [("micro_batch_size", 4, "seq_len"), ("seq_len", 4096, "micro_batch_size")])
def test_one_of_the_batch_alone_is_refused_in_one_line_before_anything_is_built(given, value, missing):
    """``micro_batch_size`` without ``seq_len`` (or the reverse) meant the batch to count: it would not (the
    reserve would silently be 20% of the free memory), so wrap, from_config and WrapOptions refuse it, naming the
    missing one, before the model is touched."""
    msg = (f"{given}={value} was given without {missing}; pass both (the batch the capacity share reserves "
           "activations for) or neither")
    model = _model()
    with pytest.raises(ValueError) as info:
        megatrain.wrap(model, device="cpu", **{given: value})
    assert str(info.value) == f"megatrain.wrap: {msg}"
    assert getattr(model, "megatrain", None) is None
    with pytest.raises(ValueError) as info:
        megatrain.from_config(model.config, device="cpu", **{given: value})
    assert str(info.value) == f"megatrain.from_config: {msg}"
    with pytest.raises(ValueError) as info:
        megatrain.WrapOptions(**{given: value})
    assert str(info.value) == f"megatrain.WrapOptions: {msg}"


def test_a_seq_len_above_the_models_positions_warns():
    """``seq_len`` above ``max_position_embeddings`` (which ``megatrain train`` refuses) is wrapped with a one-line
    warning naming both; within the limit, no warning."""
    model = _model()
    limit = model.config.max_position_embeddings
    above = rf"seq_len={limit + 1} is above the model's max_position_embeddings \({limit}\)"
    with pytest.warns(UserWarning, match=above):
        megatrain.wrap(model, device="cpu", micro_batch_size=1, seq_len=limit + 1).megatrain.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        megatrain.wrap(_model(), device="cpu", micro_batch_size=1, seq_len=limit).megatrain.close()
