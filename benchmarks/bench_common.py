"""What every benchmark records about the tree it ran, and how a child reports (shared by the bench_*.py scripts)."""
import json
import os
import subprocess
import sys
import traceback

GiB = 1024 ** 3


def git_commit() -> str | None:
    """HEAD (+ "-dirty"), or ``$MEGATRAIN_GIT_COMMIT`` when set (a copied tree whose ``.git`` is stale,
    e.g. the device machine's copy); None when neither is known."""
    if os.environ.get("MEGATRAIN_GIT_COMMIT"):
        return os.environ["MEGATRAIN_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        c = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True).stdout.strip()
        return c + ("-dirty" if dirty else "") if c else None
    except OSError:
        return None


def proc_status_bytes(field: str) -> int | None:
    """A kB field of ``/proc/self/status`` (``"VmHWM"``: peak RSS, ``"VmRSS"``: RSS) in bytes; None where missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_peak_rss_gib() -> float | None:
    """This process's peak resident set size (VmHWM), GiB; None where /proc is missing."""
    peak = proc_status_bytes("VmHWM")
    return None if peak is None else peak / GiB


def report_child(row: dict, run, device: str, tag: str) -> None:
    """Fill ``row`` from ``run()`` and print it as one ``tag + json`` line (a benchmark child's result).

    A CUDA out-of-memory error becomes status ``oom``, any other exception ``error: <type>: <first
    line>`` (its traceback goes to stderr); GPU peak / reserved memory, the caching allocator's retries and
    cudaMalloc calls, and the host peak RSS are added.
    """
    import torch
    try:
        row.update(run())
    except torch.OutOfMemoryError as e:
        row["status"] = "oom"
        print(f"OOM: {str(e).splitlines()[0]}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - reported as the row's status
        traceback.print_exc()
        row["status"] = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
    if device.startswith("cuda") and torch.cuda.is_initialized():
        row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        row["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        # the caching allocator's retries (free every cached block, then cudaMalloc again: device-wide
        # synchronisations) and its cudaMalloc calls over the whole run: memory pressure that costs time
        ms = torch.cuda.memory_stats()
        row["gpu_alloc_retries"] = ms.get("num_alloc_retries")
        row["gpu_cuda_mallocs"] = ms.get("num_device_alloc")
    row["host_peak_gib"] = host_peak_rss_gib()
    print(tag + json.dumps(row), flush=True)
