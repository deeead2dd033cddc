#!/usr/bin/env python3
"""Run the model-type sweep (tests/python/model_sweep.py) and write the table of supported families.

Every type of the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` is trained as a tiny
model with megatrain and with plain PyTorch (see ``model_sweep.py``) and classified pass / refused /
fail / skipped. megatrain is imported from ``PYTHONPATH``, so this runs against any checkout::

    PYTHONPATH=/path/to/checkout/python python3 scripts/model_support_table.py \\
        --results sweep-results.json --out docs/models.md

Types run in worker processes (a crash or a hang of one type costs that type only: it is recorded as
``fail`` and a fresh worker goes on with the next). ``--results`` is rewritten after every type, so an
interrupted sweep keeps what it measured; ``--from-results`` only renders the table from such a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SWEEP_DIR = os.path.join(os.path.dirname(HERE), "tests", "python")

_WORKER = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
import model_sweep
for t in sys.argv[2:]:
    print("START " + t, flush=True)
    r = model_sweep.run_type(t)
    print("RESULT " + json.dumps(r.as_dict()), flush=True)
"""


def _reader(stream, q):
    for line in iter(stream.readline, ""):
        q.put(line)
    q.put(None)


def run_sweep(types, timeout, on_result):
    """Run ``types`` in worker processes; ``on_result(dict)`` after each. A type that crashes its worker or
    runs past ``timeout`` seconds is a ``fail``."""
    todo = list(types)
    while todo:
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, SWEEP_DIR, *todo], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=os.environ.copy())
        q: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, q), daemon=True).start()
        current, started = None, time.time()
        while True:
            try:
                line = q.get(timeout=max(1.0, timeout - (time.time() - started)) if current else timeout * 4)
            except queue.Empty:
                line = "TIMEOUT"
            if line is None or line == "TIMEOUT":
                if line == "TIMEOUT":
                    proc.kill()
                proc.wait()
                if current is None:  # the worker died before starting a type (import error): give up
                    raise SystemExit(f"model_support_table: the sweep worker exited with {proc.returncode} before "
                                     "running a type; check that megatrain and transformers import (PYTHONPATH)")
                why = f"timed out after {timeout} s" if line == "TIMEOUT" else f"worker exited with {proc.returncode}"
                on_result({"model_type": current, "status": "fail", "detail": f"crashed: {why}",
                           "max_rel_diff": None, "loss_rel_diff": None, "worst": "",
                           "seconds": round(time.time() - started, 2), "model_class": "", "params": 0})
                todo = todo[todo.index(current) + 1:]
                break
            if line.startswith("START "):
                current, started = line.split()[1], time.time()
            elif line.startswith("RESULT "):
                on_result(json.loads(line[len("RESULT "):]))
                todo = todo[todo.index(current) + 1:]
                current = None
                if not todo:
                    proc.wait()
                    break


def environment() -> dict:
    import torch
    import transformers

    import megatrain

    src = os.path.dirname(os.path.abspath(megatrain.__file__))
    try:
        commit = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": datetime.date.today().isoformat(), "megatrain_commit": commit, "megatrain_path": src,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()} CPU ({os.cpu_count()} cores)"}


def _fmt(x):
    return "" if x is None else f"{x:.1e}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(data: dict) -> str:
    """The markdown of ``docs/models.md`` from a results dict (``{"environment": ..., "results": [...]}``)."""
    import model_sweep as ms

    env, rows = data["environment"], sorted(data["results"], key=lambda r: r["model_type"])
    counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "refused", "fail", "skipped")}
    out = [
        "# Supported model families",
        "",
        "Every model type of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, trained as a tiny model "
        f"(hidden {ms.HIDDEN}, {ms.LAYERS} layers or one of each layer kind, {ms.HEADS} heads / {ms.KV_HEADS} KV "
        f"heads, vocab {ms.VOCAB}, fp32, seed 0) for {ms.STEPS} steps of random tokens (batch {ms.BATCH} x "
        f"{ms.SEQ}, `labels=input_ids`; AdamW lr {ms.LR:g}, weight decay {ms.WD:g}, max_grad_norm "
        f"{ms.MAX_GRAD_NORM:g}) with `megatrain.wrap` + `CPUAdamW` on the CPU and with plain PyTorch "
        "(`torch.optim.AdamW` + `clip_grad_norm_`), side by side.",
        "",
        f"- **pass**: the loss of every step and every parameter after the steps match per element (relative "
        f"{ms.RTOL:g}; an element further off passes only if megatrain is within {ms.NOISE_K:g}x plain fp32's own "
        "distance from an fp64 run of plain PyTorch in that tensor: rounding noise).",
        "- **refused**: `megatrain.wrap` raises its own one-line error (quoted).",
        "- **fail**: any other error, or a parity miss (first error line).",
        "- **skipped**: no tiny model could be built, or plain PyTorch itself does not train the model from "
        "`input_ids` alone; not counted against megatrain.",
        "",
        "*max rel diff*: the largest difference between megatrain and plain fp32 PyTorch, over the per-step "
        "losses (relative to the loss) and the parameters (relative to the tensor's largest |value|), leaving out "
        "the elements judged rounding noise.",
        "",
        f"Generated by `scripts/model_support_table.py` on {env['date']}: megatrain {env['megatrain_commit']}, "
        f"torch {env['torch']}, transformers {env['transformers']}, Python {env['python']}, {env['machine']}. "
        f"Run it again after a change (`PYTHONPATH=python python3 scripts/model_support_table.py --results "
        "sweep-results.json --out docs/models.md`); the `slow` test `tests/python/test_model_sweep.py` runs "
        "the same sweep and keeps the list of known failures.",
        "",
        f"**{len(rows)} types: {counts['pass']} pass, {counts['refused']} refused, {counts['fail']} fail, "
        f"{counts['skipped']} skipped.**",
        "",
        "| type | model class | status | max rel diff | note |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r['model_type']} | {r['model_class']} | {r['status']} | {_fmt(r['max_rel_diff'])} | "
                   f"{_cell(r['detail'][:240])} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="*", help="model types to run (default: the whole causal-LM mapping)")
    p.add_argument("--results", default="sweep-results.json", help="JSON written after every type")
    p.add_argument("--from-results", help="render the table from this results JSON without running anything")
    p.add_argument("--out", default=None, help="markdown table to write (e.g. docs/models.md)")
    p.add_argument("--update", action="store_true",
                   help="keep the other types' results already in --results (re-run only --types)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one type may take (default 600)")
    args = p.parse_args(argv)
    sys.path.insert(0, SWEEP_DIR)
    if args.from_results:
        with open(args.from_results) as f:
            data = json.load(f)
    else:
        import model_sweep

        types = args.types or model_sweep.causal_lm_types()
        data = {"environment": environment(), "results": []}
        if args.update and os.path.exists(args.results):
            with open(args.results) as f:
                data["results"] = [r for r in json.load(f)["results"] if r["model_type"] not in types]

        def on_result(r):
            data["results"].append(r)
            print(f"{r['model_type']:32s} {r['status']:8s} {r['seconds']:7.1f}s  {r['detail'][:150]}", flush=True)
            tmp = args.results + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, args.results)

        run_sweep(types, args.timeout, on_result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(render(data))
    counts = {s: sum(r["status"] == s for r in data["results"]) for s in ("pass", "refused", "fail", "skipped")}
    print(" ".join(f"{k} {v}" for k, v in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
