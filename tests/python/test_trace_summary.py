"""benchmarks/trace_summary.py on a synthetic Kineto trace (numbers checked by hand)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from trace_summary import summarize  # noqa: E402


def _ev(cat, name, ts, dur, stream=None, tid=1):
    ev = dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, pid=0, tid=tid)
    if stream is not None:
        ev["args"] = {"stream": stream}
    return ev


def test_overlap_gaps_and_syncs():
    trace = {"traceEvents": [
        _ev("kernel", "gemm", 0, 100, stream=7),          # compute: [0,100) [150,300) [800,1000)
        _ev("kernel", "gemm", 150, 150, stream=7),
        _ev("kernel", "gemm", 800, 200, stream=7),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 200, stream=20),   # [50,250): 150 overlapped
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 400, 100, stream=21),  # [400,500): none overlapped
        _ev("cuda_runtime", "cudaStreamSynchronize", 10, 30, tid=5),
        _ev("cuda_runtime", "cudaEventSynchronize", 10, 5, tid=6),
        _ev("cuda_runtime", "cudaEventSynchronize", 20, 5, tid=6),
        _ev("cuda_runtime", "cudaLaunchKernel", 0, 1, tid=5),
    ]}
    s = summarize(trace, gap_threshold_s=100e-6)
    assert s["compute_stream"] == "7"
    assert s["window_s"] == pytest.approx(1000e-6)
    assert s["compute_busy_s"] == pytest.approx(450e-6)
    assert s["compute_idle_s"] == pytest.approx(550e-6)
    assert s["largest_idle_gaps_s"][:2] == pytest.approx([500e-6, 50e-6])
    assert s["compute_idle_gaps_over_threshold"] == 1
    assert s["h2d_busy_s"] == pytest.approx(200e-6) and s["h2d_overlapped_s"] == pytest.approx(150e-6)
    assert s["d2h_busy_s"] == pytest.approx(100e-6) and s["d2h_overlapped_s"] == 0
    assert s["streams"]["20"]["directions"] == ["H2D"]
    assert s["host_syncs"]["5"]["cudaStreamSynchronize"]["count"] == 1
    assert s["host_syncs"]["6"]["cudaEventSynchronize"] == dict(count=2, total_s=pytest.approx(10e-6))
    assert "cudaLaunchKernel" not in s["host_syncs"]["5"]


def test_idle_gaps_are_located():
    k = _ev("kernel", "gemm_b", 800, 200, stream=7)
    k["args"]["correlation"] = 42
    launch = _ev("cuda_runtime", "cudaLaunchKernel", 700, 2, tid=5)
    launch["args"] = {"correlation": 42}
    trace = {"traceEvents": [
        _ev("kernel", "gemm_a", 0, 300, stream=7), k,
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 400, 100, stream=21),
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 50, stream=20),  # after the last kernel
        launch,
        _ev("cpu_op", "autograd::backward", 0, 1000, tid=5),
        _ev("cpu_op", "aten::mm", 690, 20, tid=5),
        _ev("cpu_op", "aten::add", 100, 20, tid=5),  # not enclosing the launch
    ]}
    gaps = summarize(trace)["idle_gaps"]
    assert [round(g["dur_s"] * 1e6) for g in gaps] == [500, 50]
    g = gaps[0]
    assert g["offset_s"] == pytest.approx(300e-6) and (g["before"], g["after"]) == ("gemm_a", "gemm_b")
    assert g["launch_late_s"] == pytest.approx(400e-6)  # launched at 700, the stream was free at 300
    assert g["d2h_s"] == pytest.approx(100e-6) and g["h2d_s"] == 0
    assert g["cpu_ops"] == ["autograd::backward", "aten::mm"]
    assert (gaps[1]["before"], gaps[1]["after"]) == ("gemm_b", "window end") and gaps[1]["h2d_s"] == pytest.approx(50e-6)
    assert "launch_late_s" not in gaps[1]


def test_trace_without_gpu_activity_is_refused():
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize({"traceEvents": [_ev("cpu_op", "aten::mm", 0, 10)]})


def test_step_span_counts_the_host_wait_before_the_first_gpu_activity():
    trace = {"traceEvents": [
        _ev("user_annotation", "ProfilerStep#3", 0, 2000, tid=5),  # the step starts on the host at 0
        _ev("kernel", "gemm", 300, 400, stream=7),                 # first GPU work at 300
        _ev("kernel", "gemm", 800, 200, stream=7),
    ]}
    s = summarize(trace)
    assert s["window_s"] == pytest.approx(700e-6) and s["compute_idle_s"] == pytest.approx(100e-6)
    assert s["step_span_s"] == pytest.approx(1000e-6) and s["host_lead_s"] == pytest.approx(300e-6)
    assert s["compute_idle_step_s"] == pytest.approx(400e-6)
    assert summarize({"traceEvents": trace["traceEvents"][1:]})["compute_idle_step_s"] is None
