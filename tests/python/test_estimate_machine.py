"""megatrain.estimate(host_memory=, gpu_memory=): the fit judged against a machine given by its sizes
(the paper's setting: one H200, 1.5 TiB of host memory) instead of this one."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig  # noqa: E402

import megatrain  # noqa: E402
from megatrain.byte_units import format_bytes  # noqa: E402
from megatrain.runtime.placement import host_memory  # noqa: E402
from parity import tiny_llama_config  # noqa: E402

TIB, GIB = 2**40, 2**30


def _limits(mem_available, memlock=None):
    return dict(mem_available_bytes=mem_available, cgroup_limit_bytes=None, cgroup_usage_bytes=None,
                memlock_bytes=memlock, cgroup_path=None)


def _host_msg(value):
    return (f"megatrain.estimate: host_memory must be a number of bytes > 0 (an int, or a string such as '1.5TiB' "
            f"or '141GB'), float('inf') or 'inf' for no host limit, or None for this machine's, got {value!r}")


def _gpu_msg(value):
    return (f"megatrain.estimate: gpu_memory must be a number of bytes > 0 (an int, or a string such as '1.5TiB' "
            f"or '141GB') or None for this machine's, got {value!r}")


_BAD = [0, -1, -1.5, "lots", "", "-2GiB", "1.5 parsecs", True, 0.5, [1], float("-inf"), float("nan"), "-inf"]


@pytest.mark.parametrize("value", _BAD + [1e30, 2**63, "1e30GB", float("inf"), "inf"])
def test_bad_sizes_are_refused_in_one_line_before_anything_is_computed(value):
    # object() is no model: an estimate that got as far as reading it would raise TypeError instead.
    if value in _BAD or value != value:  # (nan != nan)
        with pytest.raises(ValueError) as exc:
            megatrain.estimate(object(), host_memory=value)
        assert str(exc.value) == _host_msg(value)
    with pytest.raises(ValueError) as exc:  # a GPU of unlimited memory is no GPU: only the host may be unlimited
        megatrain.estimate(object(), gpu_memory=value)
    assert str(exc.value) == _gpu_msg(value)


@pytest.mark.parametrize("value", [float("inf"), "inf", "Infinity", 1e30, 2**63, "1e30GB"])
def test_an_infinite_host_memory_is_a_host_without_limit(monkeypatch, value):
    """``host_memory=float("inf")`` (wrap's spellings of "no limit" for ``host_memory_limit``: inf, "inf", any
    count above 2**63 - 1): the host is judged with no cap at all, whatever this machine has, and the table says so."""
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(1024, memlock=1))  # this machine: 1 KiB
    cfg = tiny_llama_config()
    assert not megatrain.estimate(cfg, device="cuda").host_fits
    est = megatrain.estimate(cfg, device="cuda", host_memory=value, host_compute_copy=True)
    assert est.host_fits and est.fits and est.reason() == "" and est.host_available_bytes is None
    assert est.host_memory_given == 2**63 - 1 and est.to_dict()["assumed_machine"]["host"] == "no limit (given)"
    text = str(est)
    assert "assumed machine: host no limit (given), GPU this machine" in text
    assert "  host check: none (host_memory given as unlimited: no host limit)" in text.splitlines()
    assert text.splitlines()[-1] == "fits the assumed machine"
    exact = megatrain.estimate(cfg, device="cuda", host_memory=est.host_bytes, host_compute_copy=True)
    assert exact.host_bytes == est.host_bytes and exact.host_fits  # the same bytes counted, only the cap differs


def test_gpu_memory_with_a_cpu_device_is_refused():
    with pytest.raises(ValueError) as exc:
        megatrain.estimate(tiny_llama_config(), device="cpu", gpu_memory="141GB")
    assert str(exc.value) == ("megatrain.estimate: gpu_memory describes a CUDA device, but device='cpu': leave device "
                              "unset (or 'cuda') to estimate for that GPU, or drop gpu_memory")


def test_given_host_memory_replaces_this_machines_limits(monkeypatch):
    """This machine (patched) has 1 KiB available and a 1-byte memlock: a given host is judged alone."""
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(1024, memlock=1))
    monkeypatch.setenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", "1")  # a given host is judged even so
    cfg = tiny_llama_config()
    here = megatrain.estimate(cfg, device="cuda")
    assert here.host_available_bytes is None  # skipped for this machine
    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK")
    here = megatrain.estimate(cfg, device="cuda")
    assert not here.host_fits and "MemAvailable" in here.reason()
    big = megatrain.estimate(cfg, device="cuda", host_memory="1GiB")
    assert big.host_fits and big.host_available_bytes == GIB and big.pinned_bytes > 0  # no memlock there
    assert big.host_memory_given == GIB and big.to_dict()["assumed_machine"]["host"] == "1.00 GiB (given)"
    assert "assumed machine: host 1.00 GiB (given), GPU this machine" in str(big)
    small = megatrain.estimate(cfg, device="cuda", host_memory=big.host_bytes - 1, host_compute_copy=True)
    assert not small.host_fits and not small.fits
    line = small.reason()
    given = format_bytes(big.host_bytes - 1, largest="TiB")
    assert "\n" not in line and f"available under the host_memory given ({given})" in line
    assert "assumed machine" in str(small) and str(small).splitlines()[-1].startswith("does not fit: ")
    assert megatrain.estimate(cfg, device="cuda", host_memory=big.host_bytes).host_fits  # the boundary: exactly


def test_given_gpu_memory_makes_the_device_cuda_with_that_free_memory():
    cfg = tiny_llama_config()
    est = megatrain.estimate(cfg, gpu_memory="141GB", host_memory="1.5TiB", micro_batch_size=2, seq_len=16)
    assert est.device.startswith("cuda") and est.compute_dtype == "bfloat16"
    assert est.activation_policy.startswith("auto")
    assert est.pinned_bytes == est.store_bytes + est.staging_bytes  # pinned staging, as on a GPU
    assert est.gpu_free_bytes == 141 * 10**9 and est.gpu_fits is True and est.fits
    assert est.device_name == "the given GPU (gpu_memory 131.32 GiB)"
    assert est.to_dict()["assumed_machine"] == {"host": "1.50 TiB (given)", "gpu": "131.32 GiB (given)"}
    text = str(est)
    assert "CUDA is not available" not in text and text.splitlines()[-1] == "fits the assumed machine"
    few = est.slot_bytes - 1  # not even the layer slots fit
    tight = megatrain.estimate(cfg, gpu_memory=few, host_memory="1.5TiB", micro_batch_size=2, seq_len=16)
    assert tight.gpu_fits is False and not tight.fits and tight.gpu_free_bytes == few
    assert f"of GPU memory on the given GPU (gpu_memory {format_bytes(few)})" in tight.reason()
    half = megatrain.estimate(cfg, gpu_memory="100GiB", gpu_memory_limit=0.5)  # a fraction of the given GPU
    assert half.gpu_free_bytes == 50 * GIB


def test_default_names_this_machine_and_prints_no_machine_line():
    est = megatrain.estimate(tiny_llama_config(), device="cpu")
    assert "assumed machine" not in str(est)
    assert est.to_dict()["assumed_machine"] == {"host": "this machine", "gpu": "none (CPU device)"}
    assert est.host_memory_given is None and est.gpu_memory_given is None


def _llama_params(h, inter, layers, heads, kv, vocab):
    """Parameters of a Llama (untied embedding and head, no biases), counted from the shapes."""
    d = h // heads
    attn = h * heads * d + 2 * h * kv * d + heads * d * h
    return 2 * vocab * h + h + layers * (attn + 3 * h * inter + 2 * h)


def test_the_paper_setting_on_one_h200_with_1_5_tib():
    """~120B Llama (hidden 10240, MLP 28672, 108 layers, 80/8 heads, vocab 32000) on one H200 (141 GB)
    with 1.5 TiB of host memory: read from a LlamaConfig on the meta device (its fp32 weights alone
    would be ~483 GB: nothing is allocated), today's layout is 14 B/param (bf16 compute copy 2 + fp32
    master, exp_avg, exp_avg_sq 4 each) plus staging and padding."""
    shape = dict(h=10240, inter=28672, layers=108, heads=80, kv=8, vocab=32000)
    cfg = LlamaConfig(hidden_size=10240, intermediate_size=28672, num_hidden_layers=108, num_attention_heads=80,
                      num_key_value_heads=8, vocab_size=32000)
    auto = megatrain.estimate(cfg, host_memory="1.5TiB", gpu_memory="141GB", micro_batch_size=4, seq_len=4096)
    # the default (host_compute_copy="auto"): the deepest layers drop their bf16 host copy (12 B/param): it fits
    assert auto.fits and auto.master_streamed_layers > 0 and auto.exclusive_layers == 0
    assert f"({auto.master_streamed_layers} master-streamed: no compute copy)" in str(auto)
    # today's layout (a compute copy per layer), as before:
    est = megatrain.estimate(cfg, host_memory="1.5TiB", gpu_memory="141GB", micro_batch_size=4, seq_len=4096,
                             host_compute_copy=True)
    n = _llama_params(**shape)
    assert est.num_params == n and est.trainable_params == n
    sections = est.host_sections
    # the GPU's "auto" share holds the whole state of 3 layers (14 B/param without accumulation), its capacity
    # share (the free GPU memory less the streamed schedule and this batch's activations) 5: they are exclusive
    # device-state layers, and 5 are enough (at 18 B/param, with an fp32 gradient buffer, 4 fit and 5 were needed)
    assert est.exclusive_max == 3 and est.capacity_max == est.exclusive_layers == 5 and est.exclusive_needed is None
    assert est.exclusive_share == "capacity"
    excl = est.exclusive_bytes  # 14 B/param of layers 0..4 (fp32 state and compute copy): out of the host store
    excl_numel = excl // 14
    assert excl == 14 * excl_numel
    scratch = 12 * excl_numel // est.exclusive_layers  # one exclusive layer's fp32 state: a device-tier window's buffer
    assert sections["compute"] + 2 * excl_numel >= 2 * n and sections["master"] + 4 * excl_numel >= 4 * n
    assert sections["exp_avg"] == sections["exp_avg_sq"] == sections["master"]
    assert sum(sections.values()) + excl - 14 * n < 4096 * 4 * (len(est.host_sections) * (shape["layers"] + 1))
    assert est.host_bytes == est.store_bytes + est.staging_bytes + scratch and est.accumulator_bytes == 0
    assert 14.0 < est.bytes_per_param + (excl - scratch) / n < 14.2
    assert est.host_available_bytes == int(1.5 * TIB)
    assert est.host_fits == (est.host_bytes <= 1.5 * TIB) and est.host_bytes <= 1.5 * TIB  # so: it fits
    assert est.fits is True
    assert est.gpu_free_bytes == 141 * 10**9 and est.gpu_fits is True  # the GPU part fits
    assert "assumed machine: host 1.50 TiB (given), GPU 131.32 GiB (given)" in str(est)
    assert torch.tensor([], dtype=torch.bfloat16).element_size() == 2


def test_a_host_below_the_full_need_moves_the_fewest_layers_fp32_state_to_the_gpu():
    """~14B Llama (hidden 5120, MLP 13824, 48 layers, 40/8 heads): with the host one byte short of the whole
    model's need, the estimate plans wrap's exclusive device-state layers (layer 0 alone): its fp32 state
    and compute copy (14 B/param) leave the host store, and its whole device state (14 B/param: the bf16 compute copy and 3 fp32
    sections, as DeviceUnit allocates them without accumulation) joins the GPU total, exactly; at 70 GiB of host and 141 GiB of
    GPU the auto rule's device budget holds 18 layers, the capacity share (no batch given: 20% of the GPU kept
    for activations) 30, but 32 would have to be exclusive: it says so."""
    cfg = LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                      num_key_value_heads=8, vocab_size=32000)
    full = megatrain.estimate(cfg, host_memory="1TiB", gpu_memory="141GiB")
    assert full.exclusive_layers == 0 and full.exclusive_bytes == 0 and "tiers:" not in str(full)
    one = megatrain.estimate(cfg, host_memory=full.host_bytes - 1, gpu_memory="141GiB", host_compute_copy=True)
    assert one.exclusive_layers == 1 and one.fits
    layer_state = one.exclusive_bytes
    layer_params = (_llama_params(5120, 13824, 48, 40, 8, 32000) - _llama_params(5120, 13824, 0, 40, 8, 32000)) // 48
    assert 14 * layer_params <= layer_state < 14 * layer_params + 4096 * 64  # 14 B/param (padded sections)
    scratch = 12 * (layer_state // 14)  # a device-tier window's host buffer: master, exp_avg, exp_avg_sq
    assert 14 * layer_params <= one.exclusive_device_bytes < 14 * layer_params + 4096 * 64
    assert one.gpu_bytes - full.gpu_bytes == one.exclusive_device_bytes  # the device total grows by exactly those
    assert one.exclusive_share == "auto" and one.capacity_max is None  # the "auto" share held it
    moved = full.store_bytes - one.store_bytes  # the host store loses them (and their sections' page alignment)
    assert 0 <= moved - layer_state < 4096 * 64
    # the host total keeps one layer's scratch buffer (a device-tier window: master, exp_avg, exp_avg_sq)
    assert full.host_bytes - one.host_bytes == moved - scratch
    assert "device-state exclusive layers 1 (layers 0..0" in str(one) and "host + device hold it" in str(one)
    # 70 GiB of host (85 GiB fits since an exclusive layer holds no fp32 gradient buffer on the device and no
    # compute copy on the host)
    est = megatrain.estimate(cfg, host_memory="70GiB", gpu_memory="141GiB", host_compute_copy=True)
    assert est.exclusive_max == 18 and est.exclusive_layers == est.capacity_max == 30 and est.exclusive_needed == 32
    assert not est.fits and est.exclusive_share == "capacity"
    assert est.activation_reserve_bytes == int(0.2 * 141 * 2**30)
    assert est.exclusive_bytes == 30 * layer_state and 0 <= full.store_bytes - est.store_bytes - est.exclusive_bytes < 4096 * 64 * 30
    assert est.gpu_bytes - full.gpu_bytes == est.exclusive_device_bytes == 30 * one.exclusive_device_bytes
    assert "32 would have to be, the device budget holds 18 ('auto' share), 30 (capacity share" in str(est)
    assert "the fp32 state of 32 decoder layers would have to live on the GPU only" in est.reason()
