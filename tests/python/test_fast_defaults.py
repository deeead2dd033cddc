"""The default schedule and the GPU memory cap: with no placement option, ``wrap`` / ``from_config`` /
``from_pretrained`` / ``estimate`` / ``megatrain train`` use ``activation_policy="auto"`` on CUDA (the
placement planner) and the streamed ``recompute`` on the CPU backend (unchanged); ``gpu_memory_limit``
(bytes or a fraction of the device) caps the free memory every placement decision reads.

CUDA is mocked (no GPU here): ``torch.cuda`` queries are monkeypatched and the engine is replaced by a
stub that records what ``wrap`` built it with.
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

import megatrain
from megatrain.runtime.placement import device_state_plan as dsp
from megatrain.runtime.engine.memory import free_device_bytes
from megatrain.runtime.activations.policies import default_activation_policy

GiB = 1 << 30
wrap_mod = importlib.import_module("megatrain.runtime.model.wrap")  # (megatrain.runtime.model.wrap is also the function)


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


def _tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config())


class _Built(Exception):
    pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """A visible CUDA device 0 with 141 GiB of memory, and an engine stub that records its arguments."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: types.SimpleNamespace(total_memory=141 * GiB))
    seen = {}

    def engine(model, layers_name, layers, device, compute_dtype, activation_policy, num_slots, **kw):
        seen.update(device=device, activation_policy=activation_policy, **kw)
        raise _Built

    monkeypatch.setattr(wrap_mod, "WrappedEngine", engine)
    return seen


def test_default_policy_is_auto_on_cuda_and_recompute_on_cpu():
    assert default_activation_policy(torch.device("cuda", 0)) == "auto"
    assert default_activation_policy("cuda") == "auto"
    assert default_activation_policy(torch.device("cpu")) == "recompute"


def test_wrap_with_no_option_on_cuda_runs_the_planner(fake_cuda):
    with pytest.raises(_Built):
        megatrain.wrap(_tiny_llama())
    assert fake_cuda["device"] == torch.device("cuda", 0)
    assert str(fake_cuda["activation_policy"]) == "auto"  # the string or the parsed ActivationPolicy
    assert fake_cuda["device_state_layers"] == "auto"  # the planner's device-state placement
    assert fake_cuda["gpu_memory_limit"] is None


def test_from_config_with_no_option_on_cuda_runs_the_planner(fake_cuda):
    with pytest.raises(_Built):
        megatrain.from_config(_llama_config(), seed=0)
    assert str(fake_cuda["activation_policy"]) == "auto" and fake_cuda["device_state_layers"] == "auto"


def test_streamed_schedule_stays_available_by_name_on_cuda(fake_cuda):
    with pytest.raises(_Built):
        megatrain.wrap(_tiny_llama(), activation_policy="recompute", device_state_layers=0)
    assert str(fake_cuda["activation_policy"]) == "recompute" and fake_cuda["device_state_layers"] == 0


def test_cpu_default_is_the_streamed_recompute_engine_as_before():
    model = megatrain.wrap(_tiny_llama(), device="cpu")
    try:
        pl = model.megatrain.placement()
        assert model.megatrain.activation_policy == "recompute" and not model.megatrain.auto_policy
        assert pl["device_state_layers"] == 0 and pl["activations"] is None and pl["gpu_memory_limit_bytes"] is None
    finally:
        model.megatrain.close()


@pytest.mark.parametrize("limit, want", [(0.5, int(0.5 * 141 * GiB)), (1.0, 141 * GiB), (40 * GiB, 40 * GiB),
                                         ("40GiB", 40 * GiB), ("1.5TB", 1_500_000_000_000)])
def test_gpu_memory_limit_reaches_the_engine_in_bytes(fake_cuda, limit, want):
    with pytest.raises(_Built):
        megatrain.wrap(_tiny_llama(), gpu_memory_limit=limit)
    assert fake_cuda["gpu_memory_limit"] == want


def test_estimate_on_cuda_defaults_to_auto_and_takes_the_cap():
    est = megatrain.estimate(_llama_config(), device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit=0.5)
    assert est.activation_policy.startswith("auto")
    assert megatrain.estimate(_llama_config(), device="cpu").activation_policy.startswith("recompute")


@pytest.mark.parametrize("bad", [0, -1, 100, (1 << 20) - 1, 0.0, -0.5, 1.5, 2.0, float("nan"), float("inf"), True,
                                 "40 gigs", "0.5", "1KiB", [1]])
def test_bad_gpu_memory_limit_raises_one_line_before_anything_is_built(bad):
    model = _tiny_llama()
    before = type(model.model.layers[0])
    with pytest.raises(ValueError) as info:
        megatrain.wrap(model, device="cpu", gpu_memory_limit=bad)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("megatrain.wrap: gpu_memory_limit must be a number of bytes")
    assert repr(bad) in msg
    assert getattr(model, "megatrain", None) is None and type(model.model.layers[0]) is before
    with pytest.raises(ValueError, match="megatrain.estimate: gpu_memory_limit must be"):
        megatrain.estimate(_llama_config(), device="cpu", gpu_memory_limit=bad)


def test_small_int_limit_says_an_int_is_bytes():
    with pytest.raises(ValueError, match=r"an int is bytes: for a share of the device write a float, e\.g\. 1\.0"):
        dsp.check_gpu_memory_limit(1)


def test_capped_free_bytes_is_the_cap_less_what_the_process_holds():
    assert dsp.capped_free_bytes(100 * GiB, 5 * GiB, None) == 100 * GiB
    assert dsp.capped_free_bytes(100 * GiB, 5 * GiB, 40 * GiB) == 35 * GiB
    assert dsp.capped_free_bytes(20 * GiB, 5 * GiB, 40 * GiB) == 20 * GiB  # the device has less than the cap
    assert dsp.capped_free_bytes(100 * GiB, 50 * GiB, 40 * GiB) == 0  # already over it


def test_the_cap_reaches_the_planner_through_free_device_bytes(monkeypatch):
    """The engine's one free-memory reader (device-state layers, kept graphs, replan, chunked loss and
    tiling all read it) returns the capped figure; the device-state planner then places fewer layers."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (100 * GiB, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 3 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 2 * GiB)
    free = free_device_bytes(torch.device("cuda", 0), None)
    capped = free_device_bytes(torch.device("cuda", 0), 12 * GiB)
    assert free == 101 * GiB and capped == 10 * GiB
    # ten layers of 1 GiB of device state each (bf16 copy 0.25 + 3 fp32 sections 0.75): half of the free
    # memory holds all ten uncapped, five under the cap
    layers = [types.SimpleNamespace(numel=1 << 27, state_numel=1 << 26) for _ in range(10)]
    assert dsp.unit_device_bytes(layers[0], torch.bfloat16) == GiB
    assert dsp.plan_device_state_layers(layers, torch.bfloat16, free) == 10
    assert dsp.plan_device_state_layers(layers, torch.bfloat16, capped) == 5


@pytest.mark.parametrize("text, want", [("40GiB", 40 * GiB), ("0.5", 0.5), ("1.0", 1.0), (0.25, 0.25),
                                        (2 * GiB, 2 * GiB), ("none", None)])
def test_cli_gpu_memory_limit_takes_bytes_or_a_fraction(text, want):
    from megatrain.train import config_build

    got = config_build.build_config(overrides=[("runtime", "gpu_memory_limit", text)]).runtime.gpu_memory_limit
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("bad", ["1", "0", "-0.5", "1.5", "lots", "0.5KiB", True])
def test_cli_bad_gpu_memory_limit_is_one_line(bad):
    from megatrain.train import config_build
    from megatrain.train.config import UsageError

    with pytest.raises(UsageError) as info:
        config_build.build_config(overrides=[("runtime", "gpu_memory_limit", bad)])
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("runtime.gpu_memory_limit must be GPU bytes")


@pytest.mark.parametrize("text, want", [("auto", None), ("true", True), ("false", False), (False, False)])
def test_cli_liger_kernel_switch(text, want):
    from megatrain.train import config, config_build

    value = config_build.build_config(overrides=[("runtime", "liger_kernel", text)]).runtime.liger_kernel
    assert config.wrap_auto_switch(value) is want
    with pytest.raises(config.UsageError, match="runtime.liger_kernel must be auto, true or false, got 'maybe'"):
        config_build.build_config(overrides=[("runtime", "liger_kernel", "maybe")])


def test_cli_run_passes_the_defaults_and_the_cap_to_wrap(monkeypatch, tmp_path):
    """``megatrain train`` builds the model with no activation_policy (wrap's default) and its cap / switch."""
    from megatrain.train import config_build, model_build, run_plan

    seen = {}

    def from_config(model_config, seed=None, **kw):
        seen.update(kw)
        raise _Built

    monkeypatch.setattr(megatrain, "from_config", from_config)
    cfg = config_build.build_config(overrides=[("runtime", "gpu_memory_limit", "0.75"), ("runtime", "liger_kernel", "false"),
                                         ("log", "out", str(tmp_path / "run"))])
    plan = run_plan.prepare(cfg)
    with pytest.raises(_Built):
        model_build.build_wrapped_model(plan)
    assert seen["activation_policy"] is None and seen["device_state_layers"] is None
    assert seen["gpu_memory_limit"] == 0.75 and seen["liger_kernel"] is False


def _wide_vocab_llama():
    """A Llama whose resident unit (8192 x 64 embedding and LM head, untied) is ~4 MiB in bf16 with its gradients:
    a cap of a few MiB (the least an int cap may be is 1 MiB) can be too small for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg), cfg


def _streamed_minimum(model, num_slots=2):
    """(slot bytes, resident bytes) of ``model`` in bf16, by the estimator's own arithmetic (megatrain.estimate)."""
    est = megatrain.estimate(model, gpu_memory="141GiB", compute_dtype=torch.bfloat16, num_slots=num_slots)
    return est.slot_bytes, est.resident_bytes


@pytest.fixture
def no_host_store(monkeypatch):
    """``_C.HostStore`` that fails when constructed (its planning, ``layout_required``, still works)."""
    from megatrain.runtime.engine import core

    real = core._C.HostStore

    class NoStore:
        layout_required = staticmethod(real.layout_required)

        def __init__(self, *a, **k):
            raise AssertionError("the host store was allocated")

    monkeypatch.setattr(core._C, "HostStore", NoStore)


def test_streamed_minimum_counts_the_slots_and_the_resident_unit_with_its_gradients():
    model, cfg = _wide_vocab_llama()
    slots, resident = _streamed_minimum(model)
    h, v, i, kv = 64, 8192, 128, 32
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h  # q, o; k, v (one kv head of 32); gate, up, down; 2 norms
    assert 2 * 2 * layer <= slots < 2 * 2 * layer + 2 * 2 * 4096  # 2 slots of bf16, each padded to at most 4 KiB
    assert 2 * 2 * (2 * v * h + h) <= resident < 2 * 2 * (2 * v * h + h) + 2 * 4096 * 4  # compute copy + gradients
    assert slots * 3 // 2 == _streamed_minimum(model, num_slots=3)[0]


@pytest.mark.parametrize("limit", [2 << 20, 1e-5])  # 2 MiB; 1e-5 of the fake 141 GiB device (1.5 MB)
def test_cap_below_the_streamed_minimum_is_refused_before_the_store_is_allocated(fake_cuda, no_host_store, limit):
    model, _ = _wide_vocab_llama()
    slots, resident = _streamed_minimum(model)
    need = slots + resident
    before = type(model.model.layers[0])
    with pytest.raises(ValueError) as info:
        megatrain.wrap(model, gpu_memory_limit=limit)
    msg = str(info.value)
    assert isinstance(info.value, megatrain.runtime.placement.streamed_minimum.GpuMemoryLimitError)
    assert "\n" not in msg and msg.startswith(f"megatrain.wrap: gpu_memory_limit={limit!r} (")
    assert "cannot hold even the streamed schedule" in msg and "the layer slots (2 per layer shape, " in msg
    assert msg.endswith(f"raise gpu_memory_limit to at least {need} bytes ({megatrain.byte_units.format_bytes(need)}), "
                        "or drop it")
    assert fake_cuda == {}  # the engine was never built
    assert getattr(model, "megatrain", None) is None and type(model.model.layers[0]) is before


def test_cap_at_the_streamed_minimum_is_accepted(fake_cuda, no_host_store):
    model, _ = _wide_vocab_llama()
    need = sum(_streamed_minimum(model))
    with pytest.raises(_Built):  # reached the engine (the stub)
        megatrain.wrap(model, gpu_memory_limit=need + 1)
    assert fake_cuda["gpu_memory_limit"] == need + 1
    with pytest.raises(ValueError, match=f"at least {need} bytes"):
        megatrain.wrap(_wide_vocab_llama()[0], gpu_memory_limit=need - 1)


def test_estimate_refuses_the_cap_and_adds_the_activations_floor_with_a_batch():
    model, cfg = _wide_vocab_llama()
    slots, resident = _streamed_minimum(model)
    need = slots + resident
    with pytest.raises(ValueError, match=r"^megatrain\.estimate: gpu_memory_limit=2097152 \(2\.00 MiB\) cannot hold"):
        megatrain.estimate(cfg, device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit=2 << 20)
    est = megatrain.estimate(cfg, device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit=need)
    assert est.slot_bytes + est.resident_bytes == need
    floor = 2 * 4 * 64 * 64 * 2  # a layer's input and its gradient: 2 x tokens x hidden x bf16
    with pytest.raises(ValueError) as info:
        megatrain.estimate(cfg, device="cuda", compute_dtype=torch.bfloat16, gpu_memory_limit=need,
                           micro_batch_size=4, seq_len=64)
    assert f"activations' floor for one micro-batch ({megatrain.byte_units.format_bytes(floor)})" in str(info.value)
    assert f"at least {need + floor} bytes" in str(info.value)
    # a fraction of an assumed GPU is resolved against its size
    with pytest.raises(ValueError, match=r"gpu_memory_limit=0\.0001 \("):
        megatrain.estimate(cfg, gpu_memory="16GiB", gpu_memory_limit=1e-4)


def test_cli_refuses_the_cap_in_one_line_before_the_model_is_built(fake_cuda, monkeypatch, tmp_path):
    from megatrain.train import config_build, run_plan
    from megatrain.train.config import UsageError

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (140 * GiB, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "fake GPU")

    monkeypatch.setattr(megatrain, "from_config", lambda *a, **k: pytest.fail("the model was built"))
    cfg = config_build.build_config(overrides=[("runtime", "gpu_memory_limit", "1MiB"), ("runtime", "device", "cuda"),
                                               ("log", "out", str(tmp_path / "run"))])
    with pytest.raises(UsageError) as info:
        run_plan.prepare(cfg)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("megatrain train: runtime.gpu_memory_limit=1048576 (1.00 MiB) cannot hold")
    assert "raise runtime.gpu_memory_limit to at least" in msg
    assert not (tmp_path / "run").exists()
