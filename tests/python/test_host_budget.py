"""wrap() refuses a model whose host store does not fit, before touching the model."""

import os

import pytest
import torch
import transformers

import megatrain
from megatrain.runtime.placement import host_memory


def _tiny():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def test_wrap_raises_host_memory_error_naming_bytes(monkeypatch):
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    limits = dict(mem_available_bytes=4096, cgroup_limit_bytes=None, cgroup_usage_bytes=None, memlock_bytes=None,
                  cgroup_path=None)
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: limits)
    model = _tiny()
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    with pytest.raises(MemoryError, match=r"needs \d+ bytes .* only 4096 bytes .*MemAvailable"):
        megatrain.wrap(model, device="cpu")
    # nothing was moved or replaced: the model still trains the ordinary way
    w = model.model.layers[0].mlp.up_proj.weight
    assert w.device.type == "cpu" and torch.equal(w.detach(), before)


def test_cgroup_limit_is_checked(monkeypatch):
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    limits = dict(mem_available_bytes=None, cgroup_limit_bytes=10_000, cgroup_usage_bytes=9_000, memlock_bytes=None,
                  cgroup_path="/sys/fs/cgroup/x/memory.max")
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: limits)
    with pytest.raises(MemoryError, match="only 1000 bytes .*cgroup"):
        host_memory.check_host_budget(5_000, 0, "test")


def test_limits_read_from_this_machine():
    lim = host_memory.host_memory_limits()
    assert lim["mem_available_bytes"] is None or lim["mem_available_bytes"] > 0


class _EnvSpy(dict):
    """os.environ stand-in recording the names written."""

    def __init__(self, env):
        super().__init__(env)
        self.written = []

    def __setitem__(self, key, value):
        self.written.append(key)
        super().__setitem__(key, value)


def test_wrap_checks_the_budget_once_without_toggling_an_environment_switch(monkeypatch):
    # The store's own C++ check is skipped by an explicit argument (the engine checked with the
    # credit of the model's weights), not by setting MEGATRAIN_SKIP_HOST_MEMORY_CHECK around it.
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    spy = _EnvSpy(os.environ)
    monkeypatch.setattr(os, "environ", spy)
    calls = []
    real = host_memory.check_host_budget
    monkeypatch.setattr(host_memory, "check_host_budget", lambda *a, **k: calls.append(a) or real(*a, **k))
    import megatrain.runtime.engine.core as engine
    monkeypatch.setattr(engine, "check_host_budget", host_memory.check_host_budget)
    model = megatrain.wrap(_tiny(), device="cpu")
    assert [k for k in spy.written if k.startswith("MEGATRAIN_")] == []
    assert [c[2] for c in calls] == ["host store"]
    assert model.megatrain.store.total_bytes > 0
