"""What ``bench_scale.py`` and ``bench_scale_pool.py`` share: the child-process protocol (``spawn``: one
``bench_scale.py --_child SPEC`` per case, its row printed after ``TAG``), the Llama config of a shape, the
timed training loop, and RSS readings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench_common import GiB, proc_status_bytes  # noqa: F401  (GiB: for the scripts that import it from here)

TAG = "BENCH_SCALE_RESULT "
BENCH_SCALE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_scale.py")


def _config(m: dict, seq: int):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
                                   num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                                   num_key_value_heads=m["kv_heads"], max_position_embeddings=max(seq, 2048),
                                   tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


def _peak_rss() -> int:
    return proc_status_bytes("VmHWM") or 0


def _rss() -> int:
    return proc_status_bytes("VmRSS") or 0


def _attn_flops(m, batch, seq):
    return 6.0 * m["layers"] * batch * seq ** 2 * m["heads"] * (m["hidden"] // m["heads"])


def _train_steps(model, opt, spec, device):
    import torch
    g = torch.Generator().manual_seed(0)
    times = []
    for s in range(spec["steps"] + 1):  # the first step warms up (not timed)
        x = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if s > 0:
            times.append(time.perf_counter() - t0)
    opt.wait()
    return times, float(loss)


def spawn(spec: dict, env_extra: dict | None = None, timeout: float = 600, stream_stderr: bool = False) -> dict:
    cmd = [sys.executable, BENCH_SCALE, "--_child", json.dumps(spec)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    print(f"==== {spec['case']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if stream_stderr else subprocess.PIPE, text=True,
                           env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(case=spec["case"], status=f"timeout after {timeout} s")
    row = None
    for line in p.stdout.splitlines():
        if line.startswith(TAG):
            row = json.loads(line[len(TAG):])
    if row is None:
        err = p.stderr or ""
        sys.stderr.write(p.stdout[-4000:] + err[-4000:])
        row = dict(case=spec["case"], status=f"error rc={p.returncode}: {(err.strip().splitlines() or [''])[-1][:300]}")
    row["wall_s"] = time.perf_counter() - t0
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row
