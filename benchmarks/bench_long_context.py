"""Long-context training on one GPU: a Llama at batch 1 and very long sequences, one optimizer step each.

Every length runs in its own subprocess (a CUDA OOM in one cannot pollute the next). A child builds
the model with its weights initialised on the GPU (bench_train.build_model: seconds instead of a
minute of CPU ``normal_``), wraps it with ``megatrain.wrap(bf16, grad_accumulator=False,
chunked_loss / tile_mlp "auto")`` and times ONE training step with no warm-up step before it:
``model(input_ids=x, labels=x).loss.backward(); opt.step(); opt.wait()`` then a device sync. At
these lengths a step is minutes of attention work and the first-call costs (allocator growth,
kernel selection, page faults of the host store) are a small part of it; they are included.

Activation policy: ``block:K`` with K from ``megatrain.runtime.activations.long_context.checkpoint_spacing``
(the smallest K whose ceil(L/K) + K - 1 saved layer inputs fit in --ckpt-fraction of the GPU's
memory), or ``--policy`` (``auto``: chosen by megatrain.wrap from the measured first layer call,
``auto_decisions`` in the JSON; ``offload``: every layer input parked in pinned host memory,
``offload_host_gib`` in the JSON; compare its step time with ``--policy recompute`` at the same length).

FLOPs (bench_train.py's convention, recompute NOT counted), per step of B sequences of S tokens:

    model_flops = 6 * N * B * S  +  6 * L * B * S^2 * (H * D)      (causal attention: half of 12*L*H*D*S^2)

    python benchmarks/bench_long_context.py --preset 7b --seq 262144 524288 --out docs/benchmarks/long_context_h200.json
    python benchmarks/bench_long_context.py --preset 1b --find-max 262144 --out docs/benchmarks/long_context_max_1b_h200.json
    python benchmarks/bench_long_context.py --loss-only --seq 32768 131072 --out docs/benchmarks/long_context_loss_h200.json
    python benchmarks/bench_long_context.py --preset tiny --device cpu --seq 256 --out /tmp/lc.json   # CPU smoke test

``--find-max S``: doubles S until a length fails (OOM or timeout), then bisects between the last
length that fit and the first that did not, to a 1/8 step (multiples of 4096 tokens).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit, report_child  # noqa: E402
from bench_train import (PRESETS, SIZE_SHAPES, build_model, llama_params,  # noqa: E402
                         machine_info, model_flops_per_step, versions)

GiB = 1024 ** 3
RESULT_TAG = "BENCH_RESULT "
SHAPES = {"7b": SIZE_SHAPES["7b"], "1b": PRESETS["1b"], "3b": PRESETS["3b"], "tiny": PRESETS["tiny"]}


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------

def _policy_for(spec, m) -> str:
    if spec.get("policy"):
        return spec["policy"]
    import torch
    from megatrain.runtime.activations.long_context import checkpoint_spacing
    total = torch.cuda.get_device_properties(0).total_memory if spec["device"].startswith("cuda") else 64 * GiB
    ckpt = spec["batch"] * spec["seq"] * m["hidden"] * (2 if spec["dtype"] == "bf16" else 4)
    k = checkpoint_spacing(m["layers"], ckpt, spec["ckpt_fraction"] * total)
    return "recompute" if k == 1 else f"block:{k}"


def run_train(spec) -> dict:
    import torch
    import megatrain
    m = dict(SHAPES[spec["preset"]])
    if spec.get("layers"):
        m["layers"] = spec["layers"]
    dev = spec["device"]
    cdt = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    policy = _policy_for(spec, m)
    t0 = time.perf_counter()
    model = build_model(m, spec["seq"], dev)
    n_params = sum(p.numel() for p in model.parameters())
    model = megatrain.wrap(model, device=dev, compute_dtype=cdt, activation_policy=policy, grad_accumulator=False,
                           chunked_loss=spec["chunked_loss"], tile_mlp=spec["tile_mlp"],
                           reuse_attention=spec.get("reuse_attention", True))
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=None)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, m["vocab"], (spec["batch"], spec["seq"]), generator=g).to(dev)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    setup_s = time.perf_counter() - t0
    try:
        sync()
        if dev.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt.wait()
        sync()
        step_s = time.perf_counter() - t1
        last = dict(eng.long_context.last)
        auto = [dict(d) for d in eng.auto_decisions.values()]  # --policy auto: what it chose (block_k, ...)
        parked = eng.offload.peak_parked_bytes / GiB if eng.offload is not None else None  # --policy offload
        reuse = eng.attention_reuse  # block:K: attention outputs of the block re-runs kept for the layers' backward
        attention = None if reuse is None else dict(kept=reuse.kept_calls, reused=reuse.reused_calls,
                                                     skipped=reuse.skipped, backends=dict(reuse.backends))
        loss = float(loss.detach())
    finally:
        eng.close()
    fl = model_flops_per_step(n_params, m, spec["batch"], spec["seq"])
    return dict(step_s=step_s, setup_s=setup_s, loss=loss, n_params=n_params, policy=policy,
                model_flops_per_step=fl, model_tflops=fl / step_s / 1e12, tokens_per_s=spec["batch"] * spec["seq"] / step_s,
                loss_rows=last.get("loss_rows"), mlp_rows=last.get("mlp_rows"), norm_rows=last.get("norm_rows"), layers=m["layers"], hidden=m["hidden"],
                auto_decisions=auto, offload_host_gib=parked, reuse_attention=attention)


def _loss_methods():
    """name -> fn(hidden [N, H], weight [V, H], shifted labels [N]) -> loss; those importable here."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss
    from megatrain.runtime.activations.long_context import _rows_for, chunked_causal_lm_loss

    def ours(h, w, y):
        free, _ = torch.cuda.mem_get_info() if h.is_cuda else (16 * GiB, 0)
        rows = _rows_for(min(2 * GiB, free / 16), w.shape[0] * (2 * h.element_size() + 20))
        return chunked_causal_lm_loss(h, w, None, None, rows, shift_labels=y)

    out = {"megatrain_chunked": ours,  # first: the others are compared with it
           "torch_full_logits": lambda h, w, y: ForCausalLMLoss(torch.nn.functional.linear(h, w), None, w.shape[0],
                                                                 shift_labels=y)}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="mean")
        out["liger_fused_linear_ce"] = lambda h, w, y: liger(w, h, y)
    except Exception as e:  # noqa: BLE001
        out["liger_fused_linear_ce"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from cut_cross_entropy import linear_cross_entropy
        out["cut_cross_entropy"] = lambda h, w, y: linear_cross_entropy(h, w, y, shift=False, reduction="mean")
    except Exception as e:  # noqa: BLE001
        out["cut_cross_entropy"] = f"unavailable: {type(e).__name__}: {e}"
    return out


def run_loss(spec) -> dict:
    """LM head + loss alone at hidden 4096, vocab 32000 (the 6.74B head): time fwd+bwd, peak, agreement."""
    import torch
    dev = spec["device"]
    dt = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    m = SHAPES[spec["preset"]]
    n, hd, v = spec["seq"], m["hidden"], m["vocab"]
    g = torch.Generator(device=dev).manual_seed(0)
    h0 = (torch.randn(n, hd, device=dev, generator=g) * 1.0).to(dt)
    w0 = (torch.randn(v, hd, device=dev, generator=g) * 0.02).to(dt)
    y = torch.randint(0, v, (n,), device=dev, generator=g)
    y[::97] = -100
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    rows, ref = {}, None
    for name, fn in _loss_methods().items():
        if isinstance(fn, str):
            rows[name] = dict(status=fn)
            continue
        h = h0.clone().requires_grad_(True)
        w = w0.clone().requires_grad_(True)
        try:
            times = []
            for i in range(1 + spec["steps"]):
                h.grad = w.grad = None
                sync()
                if dev.startswith("cuda"):
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
                t = time.perf_counter()
                loss = fn(h, w, y)
                loss.backward()
                sync()
                times.append(time.perf_counter() - t)
            r = dict(status="ok", time_s=min(times[1:]), loss=float(loss.detach()),
                     peak_extra_gib=(torch.cuda.max_memory_allocated() - base) / GiB if dev.startswith("cuda") else None)
            got = (float(loss.detach()), h.grad.float(), w.grad.float())
            if name == "megatrain_chunked":
                ref = got
            elif ref is not None:
                r["vs_megatrain"] = dict(loss_rel=abs(got[0] - ref[0]) / abs(ref[0]),
                                         grad_hidden_rel=float((got[1] - ref[1]).abs().max() / ref[1].abs().max()),
                                         grad_weight_rel=float((got[2] - ref[2]).abs().max() / ref[2].abs().max()))
            rows[name] = r
        except torch.OutOfMemoryError as e:
            rows[name] = dict(status=f"oom: {str(e).splitlines()[0][:120]}")
        except Exception as e:  # noqa: BLE001
            rows[name] = dict(status=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        del h, w
    return dict(methods=rows, tokens=n, hidden=hd, vocab=v)


def child_main(spec: dict) -> None:
    row = dict(status="ok")
    report_child(row, lambda: run_loss(spec) if spec["mode"] == "loss" else run_train(spec), spec["device"], RESULT_TAG)


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------

def spawn(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", json.dumps(spec)]
    print(f"==== {spec['mode']} {spec['preset']}: batch {spec['batch']} x seq {spec['seq']}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    result = {}
    try:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                           env=dict(os.environ, PYTHONUNBUFFERED="1"))
        out = p.stdout
        rc = p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
        result["status"] = f"error: timeout after {timeout:.0f} s"
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result.update(json.loads(line[len(RESULT_TAG):]))
        else:
            print(f"  [{spec['seq']}] {line}", file=sys.stderr)
    if not result:
        tail = [l for l in out.splitlines() if l.strip()][-1:] or [f"exit code {rc}"]
        result = dict(status=f"error: {tail[0]}"[:300])
    result.update(seq=spec["seq"], batch=spec["batch"], preset=spec["preset"], child_wall_s=time.perf_counter() - t0)
    return result


def find_max(base: dict, start: int, timeout: float) -> tuple:
    """Doubling from ``start`` until a failure, then bisection to 1/8 of the last fitting length."""
    rows, ok, bad = [], None, None
    s = start
    while bad is None:
        r = spawn(dict(base, seq=s), timeout)
        rows.append(r)
        if r.get("status") == "ok":
            ok, s = s, s * 2
        else:
            bad = s
    if ok is None:
        return rows, None
    while bad - ok > max(4096, ok // 8):
        mid = (ok + bad) // 2 // 4096 * 4096
        r = spawn(dict(base, seq=mid), timeout)
        rows.append(r)
        if r.get("status") == "ok":
            ok = mid
        else:
            bad = mid
    return rows, ok


def plot(rows: list, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = sorted((r for r in rows if r.get("status") == "ok" and "step_s" in r), key=lambda r: r["seq"])
    if not ok:
        return
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    xs = [r["seq"] / 1024 for r in ok]
    for a, key, lab in zip(ax, ["step_s", "model_tflops", "gpu_peak_gib"], ["step time (s)", "model TFLOP/s", "GPU peak (GiB)"]):
        a.plot(xs, [r.get(key) or 0 for r in ok], "o-")
        a.set_xscale("log", base=2)
        a.set_xlabel("tokens per sequence (K), batch 1")
        a.set_title(lab)
        for x, r in zip(xs, ok):
            a.annotate(f"{r.get(key) or 0:.0f}", (x, r.get(key) or 0), textcoords="offset points", xytext=(0, 5), ha="center",
                       fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _reuse_str(d) -> str:
    return "off" if d is None else f"{d['kept']}/{d['reused']} {d['backends']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--seq", type=int, nargs="+", default=[262144, 524288])
    ap.add_argument("--find-max", type=int, metavar="S", help="longest length that fits, searching from S")
    ap.add_argument("--loss-only", action="store_true", help="LM head + loss alone: ours vs full logits vs libraries")
    ap.add_argument("--policy", help="activation_policy (default: block:K from checkpoint_spacing)")
    ap.add_argument("--ckpt-fraction", type=float, default=0.35, help="GPU memory share for saved layer inputs")
    ap.add_argument("--chunked-loss", default="auto")
    ap.add_argument("--tile-mlp", default="auto")
    ap.add_argument("--no-reuse-attention", action="store_true",
                    help="wrap(reuse_attention=False): block:K re-runs every layer's attention in its own backward")
    ap.add_argument("--steps", type=int, default=3, help="--loss-only: timed repetitions after one warm-up")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--timeout", type=float, default=560.0, help="seconds per child")
    ap.add_argument("--out", help="JSON path (a PNG of the same name is written next to it)")
    a = ap.parse_args()
    if a._child:
        child_main(json.loads(a._child))
        return

    def mode(v):  # --chunked-loss / --tile-mlp: auto | true | false | rows
        return int(v) if v.isdigit() else {"true": True, "false": False}.get(v.lower(), v)

    base = dict(mode="loss" if a.loss_only else "train", preset=a.preset, layers=a.layers, batch=1, device=a.device,
                dtype=a.dtype, policy=a.policy, ckpt_fraction=a.ckpt_fraction, chunked_loss=mode(a.chunked_loss),
                tile_mlp=mode(a.tile_mlp), steps=a.steps, reuse_attention=not a.no_reuse_attention)
    longest = None
    if a.find_max:
        rows, longest = find_max(base, a.find_max, a.timeout)
    else:
        rows = [spawn(dict(base, seq=s), a.timeout) for s in a.seq]
    m = dict(SHAPES[a.preset], **({"layers": a.layers} if a.layers else {}))
    doc = dict(benchmark="bench_long_context", mode=base["mode"], date=datetime.datetime.now().isoformat(timespec="seconds"),
               commit=git_commit(), machine=machine_info(), versions=versions(), model=dict(m, params=llama_params(m)),
               settings={k: v for k, v in base.items() if k != "mode"},
               timing="one optimizer step, no warm-up step before it" if base["mode"] == "train" else
               f"min of {a.steps} fwd+bwd after one warm-up", longest_fitting_seq=longest, rows=rows)
    print(f"{'seq':>8} {'status':>8} {'step s':>8} {'TFLOP/s':>8} {'GPU GiB':>8} {'policy':>10} {'loss rows':>9} {'mlp rows':>8}")
    for r in rows:
        if base["mode"] == "loss":
            for name, mr in (r.get("methods") or {}).items():
                print(f"{r['seq']:>8} {name:>24} {mr.get('status'):>8} {mr.get('time_s') or 0:8.3f} s "
                      f"{mr.get('peak_extra_gib') or 0:8.2f} GiB extra  {mr.get('vs_megatrain') or ''}")
            continue
        print(f"{r['seq']:>8} {str(r.get('status'))[:8]:>8} {r.get('step_s') or 0:8.1f} {r.get('model_tflops') or 0:8.1f} "
              f"{r.get('gpu_peak_gib') or 0:8.1f} {str(r.get('policy')):>10} {str(r.get('loss_rows')):>9} {str(r.get('mlp_rows')):>8}"
              f"  attention kept/reused {_reuse_str(r.get('reuse_attention'))}")
    if longest:
        print(f"longest length that fits: {longest} tokens")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        if base["mode"] == "train":
            try:
                plot(rows, os.path.splitext(a.out)[0] + ".png",
                     f"megatrain, Llama {llama_params(m) / 1e9:.2f}B, batch 1, {a.dtype} ({doc['commit']})")
            except ImportError:
                print("matplotlib missing: no PNG", file=sys.stderr)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
