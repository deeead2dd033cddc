"""_C.DiskTier binding: round trip through the files, zero-copy section tensors, errors."""

import errno
import os

import pytest
import torch

from megatrain import _C

UNITS = [[4000, 4000, 4000], [100 * 1024 + 4, 100 * 1024 + 4, 100 * 1024 + 4], [12]]


def _fill(tier, unit, seed):
    """Acquire, write random float32 values into every section, release dirty; returns them."""
    g = torch.Generator().manual_seed(seed)
    tier.acquire(unit)
    values = []
    for s in range(len(tier.layout(unit))):
        t = tier.section_tensor(unit, s)
        t.copy_(torch.randn(t.numel(), generator=g))
        values.append(t.clone())
    tier.release(unit, True)
    return values


def test_round_trip_through_the_files_is_bit_exact(tmp_path):
    tier = _C.DiskTier(str(tmp_path / "tier"), UNITS, num_buffers=2, io_threads=2, chunk_bytes=8192)
    assert tier.num_units == 3
    assert tier.buffer_bytes == _C.DiskTier.bytes_required([UNITS[1]])
    expected = {u: _fill(tier, u, 100 + u) for u in range(3)}
    tier.flush()
    tier.drop_cached()
    assert [tier.unit_state(u) for u in range(3)] == ["on_disk"] * 3
    for u in (2, 0, 1):
        tier.prefetch(u)
        addrs = tier.acquire(u)
        assert all(a % 4096 == 0 for a in addrs)
        for s, want in enumerate(expected[u]):
            got = tier.section_tensor(u, s)
            assert got.dtype == torch.float32 and got.data_ptr() == addrs[s]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (u, s)
        tier.release(u, False)
    st = tier.stats()
    assert st["unit_reads"] == 3 and st["unit_writes"] == 3
    assert st["bytes_read"] == _C.DiskTier.bytes_required(UNITS)


def test_bytes_sections_and_never_written_units_are_zero(tmp_path):
    tier = _C.DiskTier(str(tmp_path), [[10, 5000]])
    tier.acquire(0)
    assert tier.read_section(0, 1) == bytes(5000)
    tier.write_section(0, 0, b"0123456789")
    with pytest.raises(ValueError, match="has 10 bytes, got 3"):
        tier.write_section(0, 0, b"abc")
    with pytest.raises(ValueError, match="not a multiple of 4"):
        tier.section_tensor(0, 0)
    assert tier.section_tensor(0, 0, torch.uint8).tolist() == list(b"0123456789")
    tier.release(0, True)
    tier.flush()
    tier.drop_cached()
    tier.acquire(0)
    assert tier.read_section(0, 0) == b"0123456789"
    tier.release(0, False)
    with pytest.raises(ValueError, match="not acquired"):
        tier.read_section(0, 0)


def test_free_space_check_raises_before_creating_anything(tmp_path):
    target = tmp_path / "missing"
    huge = [[1 << 49]]
    with pytest.raises(_C.DiskSpaceError) as info:
        _C.DiskTier(str(target), huge)
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC
    assert info.value.needed_bytes == _C.DiskTier.bytes_required(huge)
    assert 0 <= info.value.free_bytes < info.value.needed_bytes
    assert "Nothing was written" in str(info.value)
    assert not target.exists()
    assert _C.DiskTier.free_bytes(str(target)) > 0


def test_injected_write_error_is_sticky_and_names_the_file(tmp_path):
    tier = _C.DiskTier(str(tmp_path), [[4096], [4096]], _fault=("write", 1, errno.EIO))
    _fill(tier, 0, 1)
    tier.flush()
    _fill(tier, 1, 2)
    with pytest.raises(_C.DiskTierError, match="EIO") as info:
        tier.flush()
    assert info.value.errno == errno.EIO
    assert tier.unit_path(1) in str(info.value)
    with pytest.raises(_C.DiskTierError, match="restart from the last checkpoint"):
        tier.acquire(0)


def test_stale_files_and_misuse(tmp_path):
    tier = _C.DiskTier(str(tmp_path), [[100], [100]], num_buffers=1)
    with pytest.raises(_C.DiskTierError, match="in use by another disk tier"):
        _C.DiskTier(str(tmp_path), [[100]])
    tier.acquire(0)
    with pytest.raises(RuntimeError, match="acquired already"):
        tier.acquire(0)
    with pytest.raises(RuntimeError, match="all 1 buffers are acquired"):
        tier.acquire(1)
    tier.release(0, False)
    with pytest.raises(ValueError, match="stale must be"):
        _C.DiskTier(str(tmp_path / "x"), [[1]], stale="keep")
    path = tier.unit_path(0)
    del tier
    assert not os.path.exists(path)
    # A file with a tier name that is not a tier file is never deleted.
    with open(path, "w") as f:
        f.write("mine")
    with pytest.raises(_C.DiskTierError, match="not a disk-tier file"):
        _C.DiskTier(str(tmp_path), [[100]])
    assert open(path).read() == "mine"


def test_bench_disk_writes_its_table_and_json(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_disk", Path(__file__).resolve().parents[2] / "benchmarks" / "bench_disk.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "disk"
    assert bench.main(["--dir", str(tmp_path), "--unit-gb", "0.003", "--total-gb", "0.006",
                       "--threads", "1,2", "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    tiers = [r for r in data["results"] if r["tool"] == "DiskTier"]
    assert [r["threads"] for r in tiers] == [1, 2]
    for r in tiers:
        assert r["bytes"] == data["num_units"] * _C.DiskTier.bytes_required([[data["unit_bytes"] // 3] * 3])
        assert r["write_GBps"] > 0 and r["read_GBps"] > 0
    assert "DiskTier" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("megatrain_bench_disk_")] == []


def test_a_read_ahead_keeps_the_units_it_names_that_are_already_in_ram(tmp_path):
    """The training interleaving that read a layer's state twice in one step (2 buffers): the update of
    unit 0 holds one buffer, unit 1 is still cached from the last step, unit 2 is on disk. The
    read-ahead of the next two updates, prefetch(1) then prefetch(2), used to evict unit 1 (a cached unit
    was not kept for its prefetch) to read unit 2; the update of unit 1 then read it again, evicting unit
    2 (read ahead but not yet taken), which its own update read a second time: 3 reads for 2 units.
    Now unit 1 keeps its buffer, unit 2 waits for one, and each is read at most once."""
    tier = _C.DiskTier(str(tmp_path / "tier"), UNITS, num_buffers=2, io_threads=2, chunk_bytes=8192)
    expected = {u: _fill(tier, u, 200 + u) for u in range(3)}
    tier.flush()
    tier.drop_cached()
    tier.acquire(1)
    tier.release(1, False)  # cached from the last step
    tier.acquire(0)  # the update running now holds the other buffer
    assert [tier.unit_state(u) for u in range(3)] == ["acquired", "cached", "on_disk"]
    reads = tier.stats()["unit_reads"]
    tier.prefetch(1)
    tier.prefetch(2)
    assert tier.unit_state(1) == "cached"  # kept: unit 2's read waits for a buffer
    for u in (1, 2):  # the next updates, in read-ahead order
        tier.acquire(u)
        for s, want in enumerate(expected[u]):
            assert torch.equal(tier.section_tensor(u, s).view(torch.int32), want.view(torch.int32)), (u, s)
        if u == 1:
            tier.release(0, False)
        tier.release(u, True)
    tier.flush()
    assert tier.stats()["unit_reads"] - reads == 1  # unit 2 only
