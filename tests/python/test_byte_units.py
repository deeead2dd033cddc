"""megatrain.byte_units: format_bytes (the one byte formatter, and the exact texts its callers print) and
parse_bytes (the one size reader: the CLI config and megatrain.estimate(host_memory=, gpu_memory=))."""

import pytest


@pytest.mark.parametrize("n, text", [(None, "n/a"), (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"),
                                     (2**20 - 1, "1024.00 KiB"), (3 * 2**29, "1.50 GiB"),
                                     (3 * 2**40, "3072.00 GiB"), (-2**31, "-2.00 GiB")])
def test_estimate_table_text(n, text):
    from megatrain.byte_units import format_bytes
    from megatrain.runtime.placement import disk_plan, estimate

    assert format_bytes(n) == text
    assert estimate._fmt(n) == text and disk_plan._gib(n) == text


@pytest.mark.parametrize("n, text", [(None, "n/a"), (1023.7, "1023 B"), (1536, "1.5 KiB"),
                                     (5 * 2**40, "5.0 TiB"), (2**52, "4096.0 TiB")])
def test_log_line_text(n, text):
    from megatrain.train.metrics import fmt_bytes

    assert fmt_bytes(n) == text


@pytest.mark.parametrize("n, text", [(None, "unlimited"), (1000, "0.0 MiB"), (2**30 - 2**19, "1023.5 MiB"),
                                     (2**30, "1.0 GiB"), (2**42, "4096.0 GiB")])
def test_info_text(n, text):
    from megatrain import info

    assert info._gib(n) == text


def test_unknown_unit_is_refused():
    from megatrain.byte_units import format_bytes

    with pytest.raises(ValueError):
        format_bytes(1, largest="PiB")
    with pytest.raises(ValueError):
        format_bytes(1, largest="MiB", smallest="GiB")


@pytest.mark.parametrize("value, n", [("1.5TiB", 3 * 2**39), ("141GB", 141 * 10**9), ("120 gib", 120 * 2**30),
                                      (4096, 4096), (2.0, 2), ("1e3", 1000), ("0.5KiB", 512)])
def test_parse_bytes_reads_sizes(value, n):
    from megatrain.byte_units import parse_bytes
    assert parse_bytes(value) == n


@pytest.mark.parametrize("value", [0, -1, True, 0.5, "0.5", "lots", "5 parsecs", None, "", 2**63, 1e30, "9EiB", "1e30GB",
                                   float("inf"), "inf", float("nan")])
def test_parse_bytes_refuses_what_is_not_a_size(value):
    from megatrain.byte_units import parse_bytes
    with pytest.raises(ValueError, match="not a number of bytes"):
        parse_bytes(value)


def test_the_config_reads_sizes_with_the_same_parser_and_messages():
    from megatrain.train.config import ByteSize, UsageError
    from megatrain.train.config_checks import coerce
    assert coerce("runtime.host_memory_limit", "1.5TiB", ByteSize) == 3 * 2**39
    # no limit beyond the machine's, as megatrain.wrap(host_memory_limit=) reads these
    from megatrain.byte_units import MAX_BYTES
    for unlimited in ("inf", 1e30, float("inf"), "1e30GB"):
        assert coerce("runtime.host_memory_limit", unlimited, ByteSize) == MAX_BYTES
    with pytest.raises(UsageError) as exc:
        coerce("runtime.host_memory_limit", "lots", ByteSize)
    assert str(exc.value) == ("runtime.host_memory_limit must be a number of bytes > 0, e.g. 120GiB or 128000000000 "
                              "(inf: no limit), got 'lots'")
    with pytest.raises(UsageError) as exc:
        coerce("runtime.host_memory_limit", True, ByteSize)
    assert str(exc.value) == "runtime.host_memory_limit must be a number of bytes (e.g. 120GiB), got True"
