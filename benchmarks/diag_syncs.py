"""Where do host synchronizations and memcpys in a megatrain step come from?

Profiles one step (after warm-up) of a wrapped Llama with Python stacks, then prints, for every
memcpy direction and stream on the GPU, how many there were, and for each host-side event named in
``--find`` (default: cudaStreamSynchronize, cudaDeviceSynchronize and the memcpy launches) the
innermost Python frames that enclosed it, grouped and counted.

    python benchmarks/diag_syncs.py --layers 4 --out /tmp/diag.json
"""
import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def python_stacks(trace: dict, names: tuple, depth: int) -> dict:
    """``{name: Counter(stack tuple -> count)}`` for host events whose name starts with one of ``names``.

    A stack is the ``depth`` innermost ``python_function`` events of the same thread whose interval
    contains the event's start (Kineto traces with ``with_stack=True``)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    py = collections.defaultdict(list)
    for e in evs:
        if e.get("cat") == "python_function":
            py[e["tid"]].append(e)
    out = collections.defaultdict(collections.Counter)
    for e in evs:
        name = e.get("name", "")
        if e.get("cat") == "python_function" or not name.startswith(names):
            continue
        t = e["ts"]
        frames = [f for f in py.get(e["tid"], []) if f["ts"] <= t < f["ts"] + f.get("dur", 0)]
        frames.sort(key=lambda f: f["ts"])  # outermost first
        out[name][tuple(f["name"] for f in frames[-depth:])] += 1
    return out


def gpu_copies(trace: dict) -> collections.Counter:
    """``Counter((stream, memcpy name) -> count)`` of the GPU-side memcpy events."""
    c = collections.Counter()
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "Memcpy"):
            c[(e.get("args", {}).get("stream", e.get("tid")), e.get("name"))] += 1
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policy", default="recompute")
    ap.add_argument("--depth", type=int, default=6, help="innermost Python frames shown per event")
    ap.add_argument("--find", nargs="*", default=["cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                  "cudaMemcpy", "aten::_local_scalar_dense"])
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench_train
    import megatrain
    m = dict(bench_train.PRESETS[args.preset], layers=args.layers)
    model = bench_train.build_model(m, args.seq, args.device)
    cuda = args.device.startswith("cuda")
    model = megatrain.wrap(model, device=args.device, activation_policy=args.policy,
                           compute_dtype=torch.bfloat16 if cuda else torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, m["vocab"], (args.batch, args.seq), generator=g).to(args.device) for _ in range(4)]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    for x in batches[:3]:
        step(x)
    sync()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "diag_syncs_trace.json")
    with profile(activities=acts, with_stack=True) as prof:
        step(batches[3])
        sync()
    prof.export_chrome_trace(path)
    model.megatrain.close()
    with open(path) as f:
        trace = json.load(f)
    stacks = python_stacks(trace, tuple(args.find), args.depth)
    copies = gpu_copies(trace)
    print("GPU memcpys per (stream, kind):")
    for (s, n), k in copies.most_common():
        print(f"  stream {s}: {k:5d} x {n}")
    for name, ctr in stacks.items():
        print(f"\n{name}: {sum(ctr.values())} calls")
        for st, k in ctr.most_common(8):
            print(f"  {k:5d} x " + "\n          <- ".join(reversed(st)) if st else f"  {k:5d} x (no Python frame)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copies={f"{s} {n}": k for (s, n), k in copies.items()},
                           stacks={n: [dict(count=k, stack=list(st)) for st, k in c.most_common()]
                                   for n, c in stacks.items()}), f, indent=1)


if __name__ == "__main__":
    main()
