"""Summarise a torch.profiler (Kineto) Chrome trace of one training step: stream overlap and idle gaps.

What it reports (all times in seconds, from the GPU activity records of the trace):

* ``window_s``: first GPU activity start to last GPU activity end;
* per stream: ``busy_s`` (union of its kernels / copies), number of kernels and copies, and which
  copy directions it carries (H2D, D2H);
* ``compute_stream``: the stream with the most kernel time; its ``idle_s`` inside the window,
  the number of idle gaps longer than ``gap_threshold_s`` and the largest ones;
* ``h2d_busy_s`` / ``d2h_busy_s``: union of the copies in each direction, and how much of it
  ran while the compute stream was busy (``h2d_overlapped_s``, ``d2h_overlapped_s``): the
  fraction of transfer time hidden behind compute;
* host-side synchronization: count and total time of ``cudaDeviceSynchronize``,
  ``cudaStreamSynchronize`` and ``cudaEventSynchronize`` calls, per CPU thread (the training
  thread should issue none in the steady state; megatrain's CPU worker waits on events by design).

    python benchmarks/trace_summary.py trace.json        # prints the summary as JSON
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")


def _union(intervals):
    """Merge [start, end) intervals; returns the sorted disjoint list."""
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _length(merged) -> float:
    return sum(e - s for s, e in merged)


def _intersection(a, b) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _direction(name: str):
    n = name.replace(" ", "").lower()
    if "htod" in n:
        return "H2D"
    if "dtoh" in n:
        return "D2H"
    return None


def summarize(trace: dict, gap_threshold_s: float = 100e-6, top_gaps: int = 5) -> dict:
    """Summary of a Kineto Chrome trace (the dict of ``prof.export_chrome_trace``'s JSON).

    Raises:
        ValueError: if the trace holds no GPU activity (profiled without ProfilerActivity.CUDA).
    """
    us = 1e-6
    per_stream = defaultdict(lambda: dict(intervals=[], kernels=0, copies=0, kernel_time=0.0, directions=set()))
    copies = {"H2D": [], "D2H": []}
    syncs = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        ts, dur = float(ev.get("ts", 0.0)) * us, float(ev.get("dur", 0.0)) * us
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = (ev.get("args") or {}).get("stream", ev.get("tid"))
            st = per_stream[stream]
            st["intervals"].append((ts, ts + dur))
            if cat == "kernel":
                st["kernels"] += 1
                st["kernel_time"] += dur
            else:
                st["copies"] += 1
                d = _direction(ev.get("name", ""))
                if d:
                    st["directions"].add(d)
                    copies[d].append((ts, ts + dur))
        elif cat in ("cuda_runtime", "cuda_driver") and ev.get("name") in SYNC_CALLS:
            rec = syncs[str(ev.get("tid"))][ev["name"]]
            rec[0] += 1
            rec[1] += dur
    if not per_stream:
        raise ValueError("trace_summary: the trace has no GPU kernels or copies (profile with ProfilerActivity.CUDA)")
    merged = {k: _union(v["intervals"]) for k, v in per_stream.items()}
    start = min(m[0][0] for m in merged.values())
    end = max(m[-1][1] for m in merged.values())
    compute = max(per_stream, key=lambda k: per_stream[k]["kernel_time"])
    cm = merged[compute]
    gaps = [b[0] - a[1] for a, b in zip(cm, cm[1:])] + [cm[0][0] - start, end - cm[-1][1]]
    gaps = sorted((g for g in gaps if g > 0), reverse=True)
    h2d, d2h = _union(copies["H2D"]), _union(copies["D2H"])
    return dict(
        window_s=end - start,
        compute_stream=str(compute),
        compute_busy_s=_length(cm),
        compute_idle_s=(end - start) - _length(cm),
        compute_idle_gaps_over_threshold=sum(1 for g in gaps if g > gap_threshold_s),
        gap_threshold_s=gap_threshold_s,
        largest_idle_gaps_s=gaps[:top_gaps],
        h2d_busy_s=_length(h2d), h2d_overlapped_s=_intersection(h2d, cm),
        d2h_busy_s=_length(d2h), d2h_overlapped_s=_intersection(d2h, cm),
        streams={str(k): dict(busy_s=_length(merged[k]), kernels=v["kernels"], copies=v["copies"],
                              directions=sorted(v["directions"])) for k, v in per_stream.items()},
        host_syncs={tid: {name: dict(count=c, total_s=t) for name, (c, t) in calls.items()}
                    for tid, calls in syncs.items()},
    )


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python benchmarks/trace_summary.py TRACE.json")
    with open(sys.argv[1]) as f:
        print(json.dumps(summarize(json.load(f)), indent=1))


if __name__ == "__main__":
    main()
