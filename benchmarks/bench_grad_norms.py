"""Per-layer gradient squared norms: one ``vector_norm`` launch per tensor (what ``submit_grads``
stacks today) against one fused ``torch._foreach_norm`` launch, side by side in one run.

    python benchmarks/bench_grad_norms.py [--hidden 3072 --intermediate 8192 --layers 28 --reps 50]

Gradients: the weight shapes of one Llama decoder layer (q, k, v, o, gate, up, down, two norms),
bf16 on the GPU; norms reduced in float64 as the engine does. Prints one JSON line: milliseconds
per layer for each way (CUDA events, after warm-up), the ratio, and the largest relative
difference of the squared norms between them (the fused kernel may sum in another order).
Without a CUDA device it prints a skip line and exits 0.
"""
import argparse
import json
import sys
import time

import torch

from bench_common import git_commit


def layer_grads(hidden: int, intermediate: int, kv_hidden: int, device) -> list:
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(hidden, hidden), (kv_hidden, hidden), (kv_hidden, hidden), (hidden, hidden),
              (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [torch.randn(s, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16) for s in shapes]


def per_tensor(grads):
    return torch.stack([torch.linalg.vector_norm(x, dtype=torch.float64) for x in grads])


def fused(grads):
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))


def time_ms(fn, grads, reps: int) -> float:
    for _ in range(5):
        fn(grads)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(grads)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--kv-hidden", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=28, help="layers per step (scales the per-step figure)")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "grad_norms", "skipped": "no CUDA device"}))
        return 0
    dev = torch.device("cuda")
    grads = layer_grads(args.hidden, args.intermediate, args.kv_hidden, dev)
    a, b = per_tensor(grads), fused(grads)
    rel = ((a ** 2 - b ** 2).abs() / (a ** 2)).max().item()
    rows = {}
    for name, fn in (("per_tensor", per_tensor), ("foreach", fused), ("per_tensor_again", per_tensor)):
        rows[name] = time_ms(fn, grads, args.reps)
    per = min(rows["per_tensor"], rows["per_tensor_again"])
    print(json.dumps({
        "bench": "grad_norms", "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "tensors_per_layer": len(grads), "per_tensor_ms_per_layer": round(per, 4),
        "foreach_ms_per_layer": round(rows["foreach"], 4), "ratio_per_tensor_over_foreach": round(per / rows["foreach"], 3),
        "per_step_saving_ms": round((per - rows["foreach"]) * args.layers, 3),
        "max_rel_diff_sq_norm": rel,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
