"""A host_memory_limit the model cannot meet is refused in one line that names only changes that would work, and
says what megatrain.estimate says: on the CPU backend (whose "device" is host memory) no device_state_layers
advice unless the user placed layers there; offload_dir only when the disk tier would make it fit."""

import pytest
import torch

import megatrain
from megatrain import _C


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96))


def _refusal(limit, **kw) -> str:
    with pytest.raises(_C.HostMemoryError) as info:
        megatrain.wrap(_model(), device="cpu", host_memory_limit=limit, **kw)
    msg = str(info.value)
    assert "\n" not in msg and msg.endswith("Nothing was allocated.")
    return msg


def test_cpu_refusal_names_offload_dir_only_when_the_disk_tier_fits(tmp_path):
    full = megatrain.estimate(_model(), device="cpu").host_bytes
    # far too small: even with every layer's fp32 state on disk the compute copies and the rest exceed it
    msg = _refusal(full // 2)
    assert "device_state_layers" not in msg  # the CPU backend's "device" is host memory: no help there
    assert "offload_dir cannot help" in msg and "pass offload_dir" not in msg
    assert "offload_dir cannot help" in megatrain.estimate(_model(), device="cpu", host_memory_limit=full // 2).reason()
    # a little short: the disk tier holds the rest, as the refusal and the estimate say, and wrap then fits
    limit = int(full * 0.75)
    msg = _refusal(limit)
    assert "device_state_layers" not in msg and "pass offload_dir=" in msg and "cannot help" not in msg
    assert "pass offload_dir" in megatrain.estimate(_model(), device="cpu", host_memory_limit=limit).reason()
    m = megatrain.wrap(_model(), device="cpu", host_memory_limit=limit, offload_dir=str(tmp_path / "tier"))
    assert m.megatrain.placement()["disk_layers"]
    m.megatrain.close()


def test_cpu_refusal_with_layers_placed_on_the_device_names_how_many():
    """With device_state_layers=K given on the CPU backend (the path the CPU tests of exclusive layers take), the
    refusal still says how many layers' fp32 state would have to be on the device only."""
    full = megatrain.estimate(_model(), device="cpu").host_bytes
    msg = _refusal(int(full * 0.75), device_state_layers=1)
    assert "wrap with device_state_layers=" in msg


def test_estimate_with_an_explicit_k_advises_the_k_that_fits_and_says_device_on_the_cpu():
    full = megatrain.estimate(_model(), device="cpu").host_bytes
    limit = int(full * 0.75)
    est = megatrain.estimate(_model(), device="cpu", device_state_layers=1, host_memory_limit=limit)
    text = est.reason()
    assert not est.fits and "GPU" not in text and "gpu_memory_limit" not in text
    assert "would have to live on the device only" in text
    k = est.exclusive_needed
    assert f"device_state_layers={k} (the fp32 state of layers 0..{k - 1} then lives on the device only)" in text
    m = megatrain.wrap(_model(), device="cpu", device_state_layers=k, host_memory_limit=limit)  # the advice works
    assert m.megatrain.placement()["exclusive_layers"] == list(range(k))
    m.megatrain.close()


def test_explicit_k_advice_leaves_out_offload_dir_where_it_cannot_help():
    """Half the host need with device_state_layers=1: more exclusive layers would fit, the disk tier would not (the
    compute copies alone exceed it): the estimate's advice and wrap's refusal name device_state_layers, and neither
    suggests offload_dir."""
    full = megatrain.estimate(_model(), device="cpu").host_bytes
    est = megatrain.estimate(_model(), device="cpu", device_state_layers=1, host_memory_limit=full // 2)
    k = est.exclusive_needed
    assert k and any(a.startswith(f"device_state_layers={k} ") for a in est.advice)
    assert not any("pass offload_dir" in a for a in est.advice)
    msg = _refusal(full // 2, device_state_layers=1)
    assert f"wrap with device_state_layers={k} " in msg and "offload_dir cannot help" in msg
    assert "pass offload_dir" not in msg
