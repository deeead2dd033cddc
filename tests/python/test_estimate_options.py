"""``megatrain.estimate`` and ``wrap`` read their shared options alike: ``device_state_layers`` (an estimate
option: it changes the exclusive layers and the device bytes counted), ``host_memory_limit`` as a float count
of bytes (a huge one is no limit beyond the machine's, not "must be > 0"), a small host shortfall printed in
the unit that shows it, and the accumulator's refusal naming the options that make room for it."""

import os
import sys

import pytest
import torch

import megatrain
from megatrain import _C
from megatrain.byte_units import MAX_BYTES, parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
from test_device_exclusive import _full_host  # noqa: E402
from test_disk_offload import _config, _model  # noqa: E402


def test_estimate_takes_device_state_layers_and_plans_the_exclusive_layers_wrap_makes():
    """An explicit ``device_state_layers=2`` with a host limit one byte short: wrap makes layer 0 exclusive; the
    estimate with the same keywords plans the same layer and the same host bytes (it took no such option before:
    the keyword went to the model and was refused)."""
    kw = dict(device="cpu", device_state_layers=2, host_memory_limit=_full_host() - 1)
    est = megatrain.estimate(_model(), **kw)
    model = megatrain.wrap(_model(), **kw)
    assert model.megatrain.placement()["exclusive_layers"] == [0] == list(range(est.exclusive_layers))
    assert est.host_bytes == model.megatrain.offload_plan.host_bytes and est.host_fits
    model.megatrain.close()
    assert megatrain.estimate(_model(), device="cpu", host_memory_limit=_full_host() - 1).exclusive_layers == 0


def test_estimate_counts_an_explicit_k_of_device_state_layers_on_the_gpu():
    """On a GPU, ``device_state_layers=K`` puts layers 0..K-1's whole state on the device: the estimate's device
    bytes grow by exactly their compute copy + 3 fp32 sections (no fp32 gradient buffer at one backward per step) (``device_state_bytes``)."""
    from megatrain.runtime.placement.device_state_plan import unit_device_bytes

    kw = dict(gpu_memory="80GiB", host_memory="1TiB", activation_policy="recompute")
    none = megatrain.estimate(_config(), device_state_layers=0, **kw)
    two = megatrain.estimate(_config(), device_state_layers=2, **kw)
    eng = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.bfloat16, device_state_layers=0).megatrain
    layer_bytes = [unit_device_bytes(u, torch.bfloat16) for u in eng.layers[:2]]
    eng.close()
    assert none.device_state_bytes == 0 and two.device_state_bytes == sum(layer_bytes)
    assert two.gpu_bytes - none.gpu_bytes == sum(layer_bytes)


@pytest.mark.parametrize("value", [1e30, float("inf"), "1e30", "inf", " INF "])
def test_a_huge_host_memory_limit_is_no_limit_beyond_the_machine(value):
    """A float count of bytes > 0 is not refused as "must be > 0": above 2**63 - 1 it reads as that (no limit
    beyond the machine's), in wrap and estimate alike; the string "inf" too. The estimate's table says "none"
    rather than printing 2**63 - 1 bytes as a limit."""
    assert megatrain.WrapOptions(host_memory_limit=value).host_memory_limit == MAX_BYTES
    model = megatrain.wrap(_model(), device="cpu", host_memory_limit=value)
    assert model.megatrain.offload_plan.host_memory_limit == MAX_BYTES and not model.megatrain.offload_plan.disk_units
    model.megatrain.close()
    est = megatrain.estimate(_model(), device="cpu", host_memory_limit=value)
    assert est.host_fits and est.host_memory_limit == MAX_BYTES
    assert "  host_memory_limit: none (no limit beyond the machine's)" in str(est).splitlines()
    with pytest.raises(ValueError, match=r"^not a number of bytes > 0 and <= 2\*\*63 - 1: 1e\+30$"):
        parse_bytes(1e30)  # a count itself (not a limit) is still refused, for the true reason
    with pytest.raises(ValueError, match="host_memory_limit must be a number of bytes > 0"):
        megatrain.WrapOptions(host_memory_limit=-1e30)


def test_a_host_shortfall_under_10_mib_prints_in_mib_not_as_0_00_gib():
    """3 MiB short of a host it does not fit: the advice says "3.00 MiB more", not "0.00 GiB more"."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                         vocab_size=32000)  # ~0.5 GiB of host store, built on the meta device
    host = megatrain.estimate(config, device="cpu").host_bytes  # (with compute copies: no layer streamed from its master)
    est = megatrain.estimate(config, device="cpu", host_memory=host - 3 * 2**20, host_compute_copy=True)
    assert not est.host_fits
    assert "needs 3.00 MiB more host RAM" in est.advice and not any("0.00 GiB" in a for a in est.advice)


def test_an_accumulator_over_the_limit_with_exclusive_layers_names_what_makes_room():
    """Layers made exclusive at wrap (no accumulator planned), then accumulation: the refusal names
    grad_accumulator=True (the planner then makes more leading layers exclusive: their accumulator is on the device
    too), host_memory_limit and offload_dir, in one line; and grad_accumulator=True under the same limit wraps."""
    limit = _full_host() - 1
    model = megatrain.wrap(_model(), device="cpu", device_state_layers=4, host_memory_limit=limit)
    assert model.megatrain.placement()["exclusive_layers"] == [0]
    with pytest.raises(_C.HostMemoryError) as info:
        megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=2)
        x = torch.randint(0, 96, (1, 8))
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
    msg = str(info.value)
    assert "\n" not in msg and "wrap with grad_accumulator=True (the planner then counts it: more leading layers" in msg
    assert "raise host_memory_limit" in msg and "offload_dir=<a local disk> with grad_accumulator=True" in msg
    model.megatrain.close()
    fixed = megatrain.wrap(_model(), device="cpu", device_state_layers=4, host_memory_limit=limit,
                           grad_accumulator=True)
    assert len(fixed.megatrain.placement()["exclusive_layers"]) > 1
    fixed.megatrain.close()


def test_clipping_counts_the_master_streamed_layers_held_gradients_on_the_gpu():
    """With max_grad_norm at one backward per step, a master-streamed layer's bf16 gradient waits on the GPU for the
    global norm: the estimate's GPU total grows by exactly those layers' compute-dtype bytes (none without clipping,
    none with every compute copy in the host store, none with accumulation: the host accumulator takes them)."""
    kw = dict(device="cuda", gpu_memory="80GiB", host_memory="1TiB", seq_len=64, micro_batch_size=2)
    streamed = megatrain.estimate(_config(), host_compute_copy=False, max_grad_norm=1.0, **kw)
    assert streamed.held_grad_bytes > 0
    layers = streamed.num_layers
    per_layer = streamed.held_grad_bytes // layers
    assert per_layer * layers == streamed.held_grad_bytes and per_layer % 2 == 0  # bf16, every layer alike
    unclipped = megatrain.estimate(_config(), host_compute_copy=False, **kw)
    assert unclipped.held_grad_bytes == 0 and streamed.gpu_bytes - unclipped.gpu_bytes == streamed.held_grad_bytes
    assert megatrain.estimate(_config(), host_compute_copy=True, max_grad_norm=1.0, **kw).held_grad_bytes == 0
    accumulating = megatrain.estimate(_config(), host_compute_copy=False, max_grad_norm=1.0,
                                      gradient_accumulation_steps=2, **kw)
    assert accumulating.held_grad_bytes == 0
    assert "held gradients" in str(streamed) and "held gradients" not in str(unclipped)


def test_the_planner_reserves_the_master_streamed_layers_held_gradients_before_exclusive_layers():
    """``held_free``: the device memory the exclusive layers are planned in is the free memory less each master-streamed
    layer's compute-dtype bytes (its gradient waits there for the global norm); nothing to reserve without them."""
    from megatrain.runtime.placement.master_streamed import held_free

    layout = {"unit_numel": [100, 200, 300]}
    assert held_free(None, layout, [1], torch.bfloat16) is None
    assert held_free(10_000, layout, [], torch.bfloat16) == 10_000
    assert held_free(10_000, layout, [1, 2], torch.bfloat16) == 10_000 - 2 * (200 + 300)
    assert held_free(10_000, layout, [2], torch.float32) == 10_000 - 4 * 300
    assert held_free(100, layout, [2], torch.float32) == 0


@pytest.mark.parametrize("layers", ["auto", "boundary"])
def test_estimate_plans_the_exclusive_layers_wrap_makes_under_a_string_device_state_layers_on_the_cpu(layers):
    """On the CPU backend ``wrap(device_state_layers="auto" | "boundary", host_memory_limit=...)`` plans exclusive
    layers in the host's available memory (its free device bytes there); the estimate with the same keywords
    plans the same layers and host bytes (it planned none before and said the model did not fit)."""
    streamed = megatrain.estimate(_model(), device="cpu", host_compute_copy=False).host_bytes  # every layer 12 B/param
    kw = dict(device="cpu", device_state_layers=layers, host_memory_limit=streamed - 1)
    est = megatrain.estimate(_model(), **kw)
    model = megatrain.wrap(_model(), **kw)
    placed = model.megatrain.placement()
    assert placed["exclusive_layers"] and placed["exclusive_layers"] == list(range(est.exclusive_layers))
    assert len(placed["master_streamed_layers"]) == est.master_streamed_layers
    assert est.host_bytes == model.megatrain.offload_plan.host_bytes and est.fits
    model.megatrain.close()


def test_estimate_refuses_more_device_state_layers_than_the_model_has_as_wrap_does():
    """``device_state_layers=K`` above the model's layer count: wrap refuses it in one line; the estimate with the
    same keyword refuses it alike (it said the model fits, for a call wrap then refuses)."""
    n = _config().num_hidden_layers
    for fn in (megatrain.wrap, megatrain.estimate):
        with pytest.raises(ValueError, match=f"device_state_layers={n + 1}, but the model has {n} decoder layers"):
            fn(_model(), device="cpu", device_state_layers=n + 1)


@pytest.mark.parametrize("value", [-1, 0, float("nan"), "1.0", True])
def test_estimate_refuses_a_max_grad_norm_that_cpuadamw_refuses(value):
    """``max_grad_norm`` not a number > 0: ``CPUAdamW`` refuses it in one line; the estimate refuses it alike
    (it estimated as if clipping, and said the model fits)."""
    with pytest.raises(ValueError, match=r"^megatrain.estimate: max_grad_norm must be a number > 0 or None, got "):
        megatrain.estimate(_config(), device="cpu", max_grad_norm=value)
    assert megatrain.estimate(_config(), device="cpu", max_grad_norm=float("inf")).fits


def test_a_seq_len_above_max_position_embeddings_is_estimated_with_a_note():
    cfg = _config()
    mpe = cfg.max_position_embeddings
    notes = megatrain.estimate(cfg, device="cpu", seq_len=mpe + 1).notes
    assert [n for n in notes if n.startswith(f"seq_len {mpe + 1} is above the model's max_position_embeddings ({mpe})")]
    assert not [n for n in megatrain.estimate(cfg, device="cpu", seq_len=mpe).notes if "max_position" in n]
