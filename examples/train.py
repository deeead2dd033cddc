"""Train a small Llama on the Python standard library with megatrain, in a plain PyTorch loop.

    python examples/train.py [steps]

The same recipe as `megatrain train` (the CLI adds validation, metrics, TensorBoard and a summary):
fp32 master weights and Adam moments stay in host memory; decoder layers stream through the GPU
(or run on the CPU when there is none).
"""

import math
import sys

import torch
import transformers

import megatrain
from megatrain.train.config import DataConfig
from megatrain.train.data import load_text_data

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
seq_len, micro_batch_size, lr, warmup = 256, 8, 3e-3, 20
torch.manual_seed(0)

# Data: stdlib *.py files, byte tokenizer (256 bytes + EOS), packed rows, 5% of files held out.
data = load_text_data(DataConfig(path="stdlib", seq_len=seq_len, eval_fraction=0.05), seed=0)
batches = data.train_batches(micro_batch_size, seed=0)
eval_batches = data.eval_batches(micro_batch_size, num_batches=8)

config = transformers.LlamaConfig(
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=704,
    vocab_size=320, max_position_embeddings=1024, bos_token_id=256, eos_token_id=256,
)  # fmt: skip
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = megatrain.wrap(model, device=device, compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
opt = megatrain.optim.CPUAdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
schedule = lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(1.0, s / steps)))  # noqa: E731
sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def evaluate():
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=x.to(device), labels=x.to(device)).loss.item() for x in eval_batches]
    model.train()
    return sum(losses) / len(losses)


print(f"step 0: eval loss {evaluate():.3f}")
for step in range(1, steps + 1):
    x = next(batches).to(device)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    if step % 20 == 0:
        print(f"step {step}: loss {loss.item():.3f}")
print(f"step {steps}: eval loss {evaluate():.3f}")
megatrain.export_pretrained(model, "runs/example/model")
data.tokenizer.save("runs/example/model")
print("saved to runs/example/model (load with transformers.AutoModelForCausalLM.from_pretrained)")
