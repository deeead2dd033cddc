"""Project a whole model's training step from a few of its decoder layers, measured.

A model too large for the machine at hand (the paper's ~120B Llama: hidden 10240, MLP 28672, 108
layers, 80 heads / 8 KV heads, vocab 32000) is trained here at two depths of the SAME shape: K
decoder layers (``--measure-layers``, default 4) and ``--base-layers`` (default 1), each wrapped with
megatrain and trained for a few timed steps (CPUAdamW, ``--max-grad-norm`` 1.0, 4 x 4096 tokens
by default). Step time is linear in depth for a streamed model (each layer is streamed, computed,
its gradient copied out and its state updated in turn), so

    per_layer  = (t(K) - t(base)) / (K - base)
    head_part  = t(base) - base * per_layer       (embedding, final norm, LM head + loss: measured)
    projected  = head_part + L * per_layer

and the projected model TFLOP/s is bench_train's FLOP count of the whole model (6*N*T + causal
attention, recompute not counted) over the projected step time.

Both depths run with the activation policy ``megatrain.estimate`` picks for the WHOLE model on the
assumed machine (``--policy`` overrides) and, on CUDA, ``device_state_layers=0``: every layer is
streamed from host memory as in the whole model, which keeps at most a few of its 108 layers'
state on the GPU (the projection is therefore slightly conservative). The JSON also records the
estimate's per-tier bytes of the whole model on the assumed machine (``--host-memory`` /
``--gpu-memory``; the paper120b preset assumes 1.5 TiB and one 141 GB H200) and whether it fits.

    python benchmarks/bench_projection.py --preset paper120b --out docs/benchmarks/projection_paper120b_h200.json
    python benchmarks/bench_projection.py --preset tiny --device cpu --steps 1 --warmup 1 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import git_commit  # noqa: E402
from bench_train import (PRESETS, build_model, llama_params, machine_info, make_batches,  # noqa: E402
                         model_flops_per_step, timed_loop, versions)

# hidden, layers, intermediate, vocab, heads, kv heads; batch, seq; the machine the estimate assumes
PROJECTION_PRESETS = {
    "paper120b": dict(hidden=10240, layers=108, inter=28672, vocab=32000, heads=80, kv_heads=8, batch=4, seq=4096,
                      host_memory="1.5TiB", gpu_memory="141GB"),
    "tiny": dict(PRESETS["tiny"], host_memory=None, gpu_memory=None),
}
SHAPE_KEYS = ("hidden", "layers", "inter", "vocab", "heads", "kv_heads")
OPT = dict(lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)


def projection(times: dict, layers: int) -> dict:
    """The whole model's step from the mean step times ``{depth: seconds}`` of two depths.

    Returns ``per_layer_s``, ``head_part_s`` (the step less its decoder layers: embedding, final
    norm, LM head, loss, and the optimizer's fixed cost) and ``step_s`` for ``layers`` decoder layers.

    Raises:
        ValueError: not exactly two distinct depths.
    """
    if len(times) != 2:
        raise ValueError(f"projection needs the step times of two depths, got {sorted(times)}")
    (d0, t0), (d1, t1) = sorted(times.items())
    per_layer = (t1 - t0) / (d1 - d0)
    head = t0 - d0 * per_layer
    return dict(per_layer_s=per_layer, head_part_s=head, step_s=head + layers * per_layer)


def full_estimate(m: dict, device: str, batch: int, seq: int, max_grad_norm, host_memory, gpu_memory):
    """``megatrain.estimate`` of the whole model (a meta ``LlamaConfig``: nothing allocated) on the assumed machine."""
    import megatrain
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["inter"],
                                   num_hidden_layers=m["layers"], num_attention_heads=m["heads"],
                                   num_key_value_heads=m["kv_heads"], max_position_embeddings=max(seq, 2048),
                                   tie_word_embeddings=False)
    gpu = gpu_memory if device.startswith("cuda") else None  # gpu_memory describes a CUDA device
    return megatrain.estimate(cfg, device=device, micro_batch_size=batch, seq_len=seq, max_grad_norm=max_grad_norm,
                              host_memory=host_memory, gpu_memory=gpu)


def chosen_policy(est) -> str:
    """The activation policy the estimate picked for the whole model: ``"auto (recompute)"`` -> ``"recompute"``."""
    p = est.activation_policy
    return p[p.index("(") + 1:p.rindex(")")] if "(" in p else p


def measure(m: dict, depth: int, args, policy: str) -> dict:
    """Train ``depth`` decoder layers of shape ``m`` wrapped with megatrain; timed_loop's timings and n_params."""
    import megatrain
    import torch

    shape = dict(m, layers=depth)
    spec = dict(model=shape, batch=args.batch, seq=args.seq, warmup=args.warmup, steps=args.steps, seed=args.seed)
    model = build_model(shape, args.seq, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    cuda = args.device.startswith("cuda")
    kw = dict(device_state_layers=0) if cuda else {}
    model = megatrain.wrap(model, device=args.device, activation_policy=policy, **kw)
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), max_grad_norm=args.max_grad_norm, **OPT)
    batches = make_batches(spec, args.device)

    def step(xs):
        for x in xs:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    try:
        r = timed_loop(step, batches, spec, sync, drain=opt.wait)
        r.update(activation_policy=str(eng.activation_policy), host_bytes_per_param=eng.stats()["bytes_per_param"])
    finally:
        eng.close()
    del model, opt, eng, batches
    gc.collect()
    if cuda:
        r["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    r.update(layers=depth, n_params=n_params, tokens_per_step=args.batch * args.seq)
    return r


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PROJECTION_PRESETS), default="paper120b")
    for k in SHAPE_KEYS:
        ap.add_argument("--" + k.replace("_", "-"), type=int, help=f"override the preset's {k}"
                        + (" (decoder layers of the WHOLE model projected to)" if k == "layers" else ""))
    ap.add_argument("--measure-layers", type=int, default=4, help="K: decoder layers measured (default 4)")
    ap.add_argument("--base-layers", type=int, default=1, help="the second, smaller depth measured (default 1)")
    ap.add_argument("--batch", type=int, help="sequences per step (preset default)")
    ap.add_argument("--seq", type=int, help="tokens per sequence (preset default)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per depth")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--policy", help="activation_policy of both depths (default: the estimate's choice for the whole model)")
    ap.add_argument("--host-memory", help="host memory the estimate assumes, e.g. 1.5TiB (preset default; none: this machine)")
    ap.add_argument("--gpu-memory", help="free GPU memory the estimate assumes, e.g. 141GB (CUDA only; preset default)")
    ap.add_argument("--device", default="cuda", help="cuda | cpu (cpu: a smoke test)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the token batches")
    ap.add_argument("--out", help="JSON path")
    args = ap.parse_args(argv)
    p = PROJECTION_PRESETS[args.preset]
    args.shape = {k: getattr(args, k) if getattr(args, k) is not None else p[k] for k in SHAPE_KEYS}
    args.batch = args.batch or p["batch"]
    args.seq = args.seq or p["seq"]
    args.host_memory = args.host_memory or p["host_memory"]
    args.gpu_memory = args.gpu_memory or p["gpu_memory"]
    K, base, L = args.measure_layers, args.base_layers, args.shape["layers"]
    if not 1 <= base < K <= L:
        ap.error(f"need 1 <= --base-layers < --measure-layers <= layers of the model, got {base}, {K}, {L}")
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"need --steps >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    return args


def run(args) -> dict:
    """Estimate the whole model, measure both depths, project; the JSON document."""
    m = args.shape
    est = full_estimate(m, args.device, args.batch, args.seq, args.max_grad_norm, args.host_memory, args.gpu_memory)
    print(est, flush=True)
    policy = args.policy or chosen_policy(est)
    measured = [measure(m, d, args, policy) for d in (args.base_layers, args.measure_layers)]
    proj = projection({r["layers"]: r["step_s"] for r in measured}, m["layers"])
    n_full = llama_params(m)
    flops = model_flops_per_step(n_full, m, args.batch, args.seq)
    proj.update(layers=m["layers"], n_params=n_full, model_flops_per_step=flops, model_tflops=flops / proj["step_s"] / 1e12,
                tokens_per_s=args.batch * args.seq / proj["step_s"])
    for r in measured:
        r["model_tflops"] = model_flops_per_step(r["n_params"], dict(m, layers=r["layers"]), args.batch,
                                                 args.seq) / r["step_s"] / 1e12
    gpu = None
    if args.device.startswith("cuda"):
        import torch
        gpu = torch.cuda.get_device_name(0)
    tiers = {k: v for k, v in est.to_dict().items() if k not in ("reasons", "advice", "notes")}
    return dict(benchmark="bench_projection", date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                git_commit=git_commit(), machine=machine_info(), gpu=gpu, versions=versions(), device=args.device,
                preset=args.preset, shape=m, batch=args.batch, seq=args.seq, max_grad_norm=args.max_grad_norm,
                optimizer="megatrain.optim.CPUAdamW", opt=OPT, activation_policy=policy,
                measured_layers=[args.base_layers, args.measure_layers], measured=measured, projection=proj,
                flops_formula="6*N*T + 6*L*B*S^2*H*D (N = all params; causal attention; recompute not counted)",
                estimate=dict(tiers, fits=est.fits, reason=est.reason(), table=str(est)))


def main(argv=None) -> None:
    args = parse_args(argv)
    doc = run(args)
    p = doc["projection"]
    for r in doc["measured"]:
        print(f"{r['layers']} layers: {r['step_s']:.3f} s/step (min {r['step_min_s']:.3f}), "
              f"{r['model_tflops']:.3g} TFLOP/s, {r['activation_policy']}")
    print(f"projected {p['layers']} layers ({p['n_params'] / 1e9:.3g}B params): {p['step_s']:.3f} s/step "
          f"= {p['head_part_s']:.3f} s + {p['layers']} x {p['per_layer_s']:.4f} s/layer, "
          f"{p['model_tflops']:.3g} TFLOP/s, {p['tokens_per_s']:.0f} tokens/s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
