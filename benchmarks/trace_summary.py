"""Summarise a torch.profiler (Kineto) Chrome trace of one training step: stream overlap and idle gaps.

What it reports (all times in seconds, from the GPU activity records of the trace):

* ``window_s``: first GPU activity start to last GPU activity end;
* ``step_span_s``, ``host_lead_s``, ``compute_idle_step_s``: the same from the CPU start of the
  profiled step (its ``ProfilerStep#`` annotation; the device is idle there, the previous step
  having been synchronized) — ``host_lead_s`` is how long the step ran on the host before its
  first GPU activity (a host wait there, e.g. for a CPU optimizer update, is outside
  ``window_s`` but not outside the step), ``compute_idle_step_s`` the compute stream's idle time
  over the whole span (None when the trace has no such annotation);
* per stream: ``busy_s`` (union of its kernels / copies), number of kernels and copies, and which
  copy directions it carries (H2D, D2H);
* ``compute_stream``: the stream with the most kernel time; its ``idle_s`` inside the window,
  the number of idle gaps longer than ``gap_threshold_s`` and the largest ones;
* ``idle_gaps``: where the largest gaps are — offset from the window start, the compute kernels
  (or copies) before and after, how long the CPU launch of the next one came after the previous
  one ended (``launch_late_s``: > 0 means the launching thread was late, e.g. held by the GIL or a
  host sync; 0 means the stream waited on an event, i.e. on a copy or another stream), the H2D / D2H
  copy time inside the gap, and the CPU ops enclosing that launch (outermost first);
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


def _overlap(merged, s: float, e: float) -> float:
    """Length of ``[s, e)`` covered by the merged interval list ``merged``."""
    return sum(max(0.0, min(e, b) - max(s, a)) for a, b in merged if b > s and a < e)


def _locate_gaps(events, start, end, top, launches, cpu_ops, h2d, d2h):
    """The ``top`` largest idle gaps of the compute stream's sorted ``(start, end, name, correlation)``
    events, each with its neighbours, launch lateness, copy activity and enclosing CPU ops."""
    found, busy_end, prev = [], start, None
    for ev in events + [(end, end, "window end", None)]:
        if ev[0] > busy_end:
            found.append((ev[0] - busy_end, busy_end, prev, ev))
        if ev[1] > busy_end:
            busy_end, prev = ev[1], ev
    out = []
    for dur, gs, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        rec = dict(offset_s=gs - start, dur_s=dur, before=before[2][:80] if before else "window start",
                   after=after[2][:80], h2d_s=_overlap(h2d, gs, gs + dur), d2h_s=_overlap(d2h, gs, gs + dur))
        launch = launches.get(after[3]) if after[3] is not None else None
        if launch is not None:
            tid, lts = launch
            rec["launch_late_s"] = max(0.0, lts - gs)
            ops = sorted((o for o in cpu_ops.get(tid, ()) if o[0] <= lts <= o[1]), key=lambda o: (o[0], -o[1]))
            rec["cpu_ops"] = [o[2][:60] for o in ops[:4]]
        out.append(rec)
    return out


def summarize(trace: dict, gap_threshold_s: float = 100e-6, top_gaps: int = 5) -> dict:
    """Summary of a Kineto Chrome trace (the dict of ``prof.export_chrome_trace``'s JSON).

    Raises:
        ValueError: if the trace holds no GPU activity (profiled without ProfilerActivity.CUDA).
    """
    us = 1e-6
    per_stream = defaultdict(lambda: dict(intervals=[], kernels=0, copies=0, kernel_time=0.0, directions=set()))
    copies = {"H2D": [], "D2H": []}
    syncs = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    named = defaultdict(list)  # stream -> [(start, end, name, correlation)]
    launches = {}  # correlation id -> (cpu thread, launch ts)
    cpu_ops = defaultdict(list)  # cpu thread -> [(start, end, name)]
    step_starts = []  # CPU start of each ProfilerStep# annotation
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        ts, dur = float(ev.get("ts", 0.0)) * us, float(ev.get("dur", 0.0)) * us
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            stream = (ev.get("args") or {}).get("stream", ev.get("tid"))
            st = per_stream[stream]
            st["intervals"].append((ts, ts + dur))
            named[stream].append((ts, ts + dur, ev.get("name", ""), (ev.get("args") or {}).get("correlation")))
            if cat == "kernel":
                st["kernels"] += 1
                st["kernel_time"] += dur
            else:
                st["copies"] += 1
                d = _direction(ev.get("name", ""))
                if d:
                    st["directions"].add(d)
                    copies[d].append((ts, ts + dur))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = (ev.get("tid"), ts)
            if ev.get("name") in SYNC_CALLS:
                rec = syncs[str(ev.get("tid"))][ev["name"]]
                rec[0] += 1
                rec[1] += dur
        elif cat in ("cpu_op", "user_annotation", "python_function"):
            cpu_ops[ev.get("tid")].append((ts, ts + dur, ev.get("name", "")))
            if str(ev.get("name", "")).startswith("ProfilerStep#"):
                step_starts.append(ts)
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
    idle_gaps = _locate_gaps(sorted(named[compute]), start, end, top_gaps, launches, cpu_ops, h2d, d2h)
    step_start = max((t for t in step_starts if t <= start), default=None)  # the step holding the GPU work
    span = None if step_start is None else end - step_start
    return dict(
        window_s=end - start,
        step_span_s=span,
        host_lead_s=None if span is None else start - step_start,
        compute_idle_step_s=None if span is None else span - _length(cm),
        compute_stream=str(compute),
        compute_busy_s=_length(cm),
        compute_idle_s=(end - start) - _length(cm),
        compute_idle_gaps_over_threshold=sum(1 for g in gaps if g > gap_threshold_s),
        gap_threshold_s=gap_threshold_s,
        largest_idle_gaps_s=gaps[:top_gaps],
        idle_gaps=idle_gaps,
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
