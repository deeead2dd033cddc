"""One data parallel rank of the tests in test_data_parallel.py (run under torchrun or with RANK / WORLD_SIZE set).

``python dp_rank.py OUT_DIR JSON_ARGS``: trains the tiny Llama of ``parity.tiny_llama_config`` on this
rank's slice of every global micro-batch and writes ``OUT_DIR/rank{R}.pt`` (losses, per-step update
check, final fp32 masters, PSS).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import megatrain  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402
from parity import PARITY_EPS, make_batches, tiny_llama_config  # noqa: E402


def pss_bytes() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return -1


def build(args):
    cfg = tiny_llama_config(tied=args.get("tied", False))
    for k, v in args.get("config", {}).items():
        setattr(cfg, k, v)
    torch.manual_seed(args.get("seed", 0))
    model = LlamaForCausalLM(cfg).float()
    if args.get("freeze"):
        for n, p in model.named_parameters():
            if any(s in n for s in args["freeze"]):
                p.requires_grad_(False)
    return model


def main():
    out_dir, args = sys.argv[1], json.loads(sys.argv[2])
    cuda = args.get("device") == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.get("pg_timeout", 30)))
    rank, world = dist.get_rank(), dist.get_world_size()
    pss0 = pss_bytes()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.get("from_pretrained"):
        model = megatrain.from_pretrained(args["from_pretrained"], device=device, compute_dtype=dtype)
    elif args.get("from_config"):  # initialised straight into the (shared) store
        model = megatrain.from_config(tiny_llama_config(), seed=args.get("seed", 0), device=device,
                                      compute_dtype=dtype)
    else:
        model = megatrain.wrap(build(args), device=device, compute_dtype=dtype, **args.get("wrap", {}))
    ga = args["ga"]
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=args.get("lr", 1e-3), weight_decay=0.1, eps=PARITY_EPS,
                                   max_grad_norm=args.get("max_grad_norm"), gradient_accumulation_steps=ga)
    if args.get("load"):
        megatrain.load_checkpoint(args["load"], model, opt)
    b = args["b"]
    batches = make_batches(cfg_vocab(model), args["steps"], ga, b * world, args.get("seq", 8), seed=args.get("data_seed", 1))
    losses, changed = [], []
    prev = megatrain.master_state_dict(model) if args.get("check_updates") else None
    loaded = None
    for step, micro in enumerate(batches):
        if args.get("stop_at") == [step, rank]:
            print(f"DIVERGES {time.time()}", flush=True)
            break  # a rank that stops early (it still saves at the end with save_end)
        spec = args.get("load_sd")
        if spec and step == spec["step"] and rank in spec["ranks"]:
            sd = torch.load(spec["path"], weights_only=True)
            print(f"DIVERGES {time.time()}", flush=True)
            if "model" in spec.get("what", ["model", "optimizer"]):
                model.load_state_dict(sd["model"])
            if "optimizer" in spec.get("what", ["model", "optimizer"]):
                opt.load_state_dict(sd["optimizer"])
            loaded = dict(params=megatrain.master_state_dict(model), optimizer=clone(opt.state_dict()))
            if prev is not None:
                prev = megatrain.master_state_dict(model)
        total = 0.0
        for x in micro:
            x = x[rank * b:(rank + 1) * b].to(device)
            loss = model(input_ids=x, labels=x).loss / ga
            loss.backward()
            total += loss.item()
            if args.get("die_at") == [step, rank]:
                os._exit(17)  # a rank that dies mid-step (after its backward, before step())
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if prev is not None:
            cur = megatrain.master_state_dict(model)
            # per parameter and per rank piece: some element changed (every rank's update landed)
            ok = {}
            named = dict(model.named_parameters(remove_duplicate=False))
            for n, t in cur.items():
                if not named[n].requires_grad:
                    ok[n] = bool(torch.equal(t, prev[n]))  # frozen: unchanged
                    continue
                d = (t - prev[n]).reshape(-1)
                c = -(-d.numel() // world)
                ok[n] = all(bool(d[k * c:(k + 1) * c].abs().max() > 0) for k in range(world) if k * c < d.numel())
            changed.append(ok)
            prev = cur
        if args.get("save_at") == step:
            megatrain.save_checkpoint(os.path.join(out_dir, "ckpt"), model, opt)
    res = dict(losses=losses, changed=changed, pss0=pss0, pss=pss_bytes(), time=time.time(), loaded=loaded)
    if rank == 0 or args.get("all_params"):
        res["params"] = megatrain.master_state_dict(model)
    if args.get("save_end") is True or rank in (args.get("save_end") or ()):
        megatrain.save_checkpoint(os.path.join(out_dir, "ckpt_end"), model, opt)
    elif args.get("save_end"):
        print(f"DIVERGES {time.time()}", flush=True)  # a rank that does not save at the end (the others do)
    dist.barrier()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def clone(obj):
    """A deep copy of a state dict whose tensors may be views of the host store."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    return obj


def cfg_vocab(model):
    return model.config.vocab_size


if __name__ == "__main__":
    main()
