"""megatrain._C.HostStore / pinned_empty from Python: layout, zero-copy views, accounting, budget."""

import gc
import os

import pytest
import torch

from megatrain._ext import _C as C

UNITS = [
    [("q_proj.weight", [33, 17]), ("q_proj.bias", [33]), ("norm.weight", [5])],
    [("embed.weight", [101, 3])],
    [("scalar", []), ("w", [1000, 3]), ("empty", [0, 4])],
]
SECTIONS = ["compute", "master", "exp_avg", "exp_avg_sq", "grad_accum"]


def _round_up(x, m):
    return (x + m - 1) // m * m


def _expected_unit_numel(unit):
    total = 0
    for _, shape in unit:
        numel = 1
        for d in shape:
            numel *= d
        total += _round_up(numel, 64)
    return total


@pytest.fixture(params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def store(request):
    return C.HostStore(UNITS, request.param, with_grad_accum=True, pin=False)


def test_sections_are_4kib_aligned_with_expected_dtype_and_length(store):
    for u in range(store.num_units):
        assert store.unit_numel(u) == _expected_unit_numel(UNITS[u])
        for name in SECTIONS:
            t = store.section(u, name)
            assert t.data_ptr() % 4096 == 0, (u, name)
            assert t.dtype == (store.compute_dtype if name == "compute" else torch.float32)
            assert t.shape == (store.unit_numel(u),) and t.device.type == "cpu"
            assert t.is_contiguous()
        for name, shape, numel, offset in store.entries(u):
            assert offset % 64 == 0, name
            assert list(shape) == dict(UNITS[u])[name]


def test_sections_of_a_unit_follow_each_other_in_order(store):
    for u in range(store.num_units):
        ptrs = [store.section(u, s).data_ptr() for s in SECTIONS]
        sizes = [store.section(u, s).numel() * store.section(u, s).element_size() for s in SECTIONS]
        for k in range(len(SECTIONS) - 1):
            assert ptrs[k + 1] == ptrs[k] + _round_up(sizes[k], 4096)


def test_views_are_zero_copy_and_writes_are_visible_everywhere(store):
    u, i = 2, 1  # "w" [1000, 3]
    name, shape, numel, offset = store.entries(u)[i]
    for sec in SECTIONS:
        section = store.section(u, sec)
        view = store.view(u, i, sec)
        assert list(view.shape) == shape
        assert view.data_ptr() == section.data_ptr() + offset * section.element_size()
        assert section.data_ptr() <= view.data_ptr() < section.data_ptr() + section.numel() * section.element_size()
        view.fill_(1.5)
        assert torch.all(section[offset:offset + numel] == 1.5)
        assert torch.count_nonzero(section[:offset]) == 0  # neighbours untouched
        assert torch.count_nonzero(section[offset + numel:]) == 0  # padding stays zero
        section[offset] = -2.0
        assert store.view(u, i, sec)[0, 0].item() == -2.0  # a fresh view sees it too


def test_accounting_equals_layout_arithmetic():
    s = C.HostStore(UNITS, torch.bfloat16, with_grad_accum=False, pin=False)
    numels = [_expected_unit_numel(u) for u in UNITS]
    expect = {
        "compute": sum(_round_up(n * 2, 4096) for n in numels),
        "master": sum(_round_up(n * 4, 4096) for n in numels),
    }
    expect["exp_avg"] = expect["exp_avg_sq"] = expect["master"]
    assert s.section_bytes == expect
    assert s.total_bytes == sum(expect.values())
    params = 33 * 17 + 33 + 5 + 101 * 3 + 1 + 3000 + 0
    assert s.total_numel == params
    assert s.bytes_per_param == pytest.approx(s.total_bytes / params, rel=1e-15)
    assert C.HostStore.bytes_required(UNITS, torch.bfloat16, False) == s.total_bytes
    assert s.pinned_bytes == (s.total_bytes if s.is_pinned else 0)


def test_large_units_cost_14_bytes_per_param_and_18_with_accumulation():
    units = [[("w", [1024, 1024])]] * 2
    assert C.HostStore.bytes_required(units, torch.bfloat16, False) / (2 * 2**20) == 14.0
    assert C.HostStore.bytes_required(units, torch.bfloat16, True) / (2 * 2**20) == 18.0
    assert C.HostStore.bytes_required(units, torch.float32, False) / (2 * 2**20) == 16.0


def test_tiny_memory_limit_raises_host_memory_error_naming_needed_and_available():
    needed = C.HostStore.bytes_required(UNITS, torch.bfloat16, True)
    with pytest.raises(C.HostMemoryError) as exc:
        C.HostStore(UNITS, torch.bfloat16, with_grad_accum=True, pin=False, memory_limit_bytes=1024)
    msg = str(exc.value)
    assert f"needs {needed} bytes" in msg and "only 1024 bytes" in msg
    assert "memory_limit_bytes" in msg and "Nothing was allocated" in msg
    assert exc.value.needed_bytes == needed and exc.value.available_bytes == 1024
    assert isinstance(exc.value, MemoryError) and isinstance(exc.value, RuntimeError)


@pytest.mark.skipif(os.environ.get("MEGATRAIN_SKIP_HOST_MEMORY_CHECK") == "1",
                    reason="MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1 disables the system check")
def test_one_pebibyte_unit_raises_against_mem_available():
    with pytest.raises(C.HostMemoryError, match="MemAvailable|cgroup"):
        C.HostStore([[("huge", [2**24, 2**24])]], torch.bfloat16)


def test_views_keep_the_store_alive_after_del():
    s = C.HostStore(UNITS, torch.float32, with_grad_accum=False, pin=False)
    v = s.view(2, 1, "master")
    sec = s.section(0, "exp_avg")
    v.fill_(3.0)
    del s
    gc.collect()
    _churn = [torch.ones(1 << 16) for _ in range(32)]  # reuse freed memory if it had been freed
    assert torch.all(v == 3.0)
    v.add_(1.0)
    sec.fill_(2.0)
    assert torch.all(v == 4.0) and torch.all(sec == 2.0)


def test_bad_arguments_raise_clear_errors():
    s = C.HostStore(UNITS, torch.bfloat16)  # no grad_accum by default
    with pytest.raises(ValueError, match="with_grad_accum=False"):
        s.section(0, "grad_accum")
    with pytest.raises(ValueError, match="unknown host store section 'momentum'"):
        s.section(0, "momentum")
    with pytest.raises(IndexError, match="unit index 3 out of range"):
        s.section(3, "master")
    with pytest.raises(IndexError, match="entry index 5 out of range"):
        s.view(0, 5, "master")
    with pytest.raises(ValueError, match="compute_dtype must be torch.bfloat16 or torch.float32"):
        C.HostStore(UNITS, torch.float16)
    with pytest.raises(ValueError, match="negative dimension"):
        C.HostStore([[("w", [3, -1])]], torch.bfloat16)


def test_pin_flag_matches_build_and_device():
    s = C.HostStore(UNITS, torch.bfloat16, pin=True)
    can_pin = C.build_info()["with_cuda"] and torch.cuda.is_available()
    assert s.is_pinned == can_pin
    assert s.pinned_bytes == (s.total_bytes if can_pin else 0)
    if can_pin:
        assert s.section(0, "compute").is_pinned()


def test_pinned_empty_is_page_aligned_zeroed_and_outlives_python_refs():
    t = C.pinned_empty(10_000, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (10_000,)
    assert t.data_ptr() % 4096 == 0
    assert torch.count_nonzero(t) == 0
    v = t[5:]
    del t
    gc.collect()
    v.fill_(1.0)
    assert torch.all(v == 1.0)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        C.pinned_empty(-1, torch.float32)


def test_memory_available_reports_limits():
    m = C.memory_available()
    assert m["mem_available_bytes"] > 0
    assert m["cgroup_limit_bytes"] is None or m["cgroup_limit_bytes"] > 0
    assert m["memlock_bytes"] is None or m["memlock_bytes"] >= 0
