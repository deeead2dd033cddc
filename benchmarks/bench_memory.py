"""GPU memory vs depth: peak allocated for L1 vs L2 layers of the same width at the same tokens/step.

Everything except the saved layer inputs (one B x T x hidden activation per layer, L/K of them)
must not grow with depth. Prints a breakdown and writes JSON.

    python benchmarks/bench_memory.py --layers 28 112 --out docs/benchmarks/memory_depth.json
"""

import argparse
import datetime
import json
import platform

import torch
import transformers

import megatrain

from bench_common import git_commit


def measure(layers: int, hidden: int, inter: int, batch: int, seq: int, steps: int = 2) -> dict:
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=hidden // 128,
                                   num_key_value_heads=max(1, hidden // 256), max_position_embeddings=seq,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model = megatrain.wrap(model, device="cuda", compute_dtype=torch.bfloat16)
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 32000, (batch, seq), device="cuda")
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
    opt.wait()
    peak = torch.cuda.max_memory_allocated() - base
    slot_bytes = sum(s.buf.numel() * s.buf.element_size() for ss in eng.slots.values() for s in ss)
    resident_bytes = eng.resident_buf.numel() * eng.resident_buf.element_size()
    saved_inputs = layers * batch * seq * hidden * 2 // eng.block_k
    out = dict(layers=layers, hidden=hidden, params=nparams, tokens=batch * seq, peak_allocated=peak,
               slots=slot_bytes, resident=resident_bytes, saved_layer_inputs=saved_inputs,
               other=peak - slot_bytes - resident_bytes - saved_inputs, loss=float(loss))
    eng.close()
    del model, opt, eng
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, nargs=2, default=[28, 112])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [measure(L, a.hidden, a.intermediate, a.batch, a.seq) for L in a.layers]
    gib = 1024 ** 3
    print(f"{'layers':>6} {'params':>8} {'peak GiB':>9} {'slots':>7} {'resident':>9} {'saved in':>9} {'other':>7}")
    for r in rows:
        print(f"{r['layers']:>6} {r['params']/1e9:>7.2f}B {r['peak_allocated']/gib:>9.2f} {r['slots']/gib:>7.2f} "
              f"{r['resident']/gib:>9.2f} {r['saved_layer_inputs']/gib:>9.2f} {r['other']/gib:>7.2f}")
    a_, b_ = rows
    non_saved = [r["peak_allocated"] - r["saved_layer_inputs"] for r in rows]
    ratio = non_saved[1] / non_saved[0]
    print(f"peak excluding saved layer inputs: {non_saved[0]/gib:.2f} vs {non_saved[1]/gib:.2f} GiB (ratio {ratio:.3f})")
    if a.out:
        meta = dict(machine=platform.node(), gpu=torch.cuda.get_device_name(), date=str(datetime.date.today()),
                    commit=git_commit(), torch=torch.__version__)
        with open(a.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows, non_saved_ratio=ratio), f, indent=2)
    return ratio


if __name__ == "__main__":
    main()
