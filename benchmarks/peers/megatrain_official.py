"""bench_train system ``megatrain_official``: the official MegaTrain code (github.com/DLYuanGod/MegaTrain).

Driven through its own single-GPU API, as its trainer ``examples/sft/train.py`` does: ``CPUMasterModel(
hf_model, CPUMasterConfig)``, then per micro-batch ``forward_and_backward(input_ids, attention_mask,
labels)``, and per optimizer step ``clip_grad_norm_`` + ``optimizer.step()`` + ``_sync_params_to_gpu()``
+ ``zero_grad()`` (train.py:262-272). Line numbers refer to commit 919520f0 (2026-04-18).

What it keeps, read from its code:

* precision: **bf16 master weights**. The trainer loads the model with ``torch_dtype=config.dtype``
  (train.py:166), ``bfloat16`` by default (infinity/config/training.py:45) and in every shipped config
  (examples/sft/configs/*.yaml ``dtype: "bfloat16"``); the CPU parameters the optimizer updates are
  those bf16 tensors, the pinned layer copies and gradient slabs are ``config.dtype``
  (infinity/model/cpu_master.py:450, 587, 598, 604) and a parameter's ``.grad`` is allocated like the
  bf16 slab (cpu_master.py:810). (cpu_master.py:5 says "FP32 master parameters", the code does not;
  SlideFormer's README says the same of this path.) Adam state: fp32 under DeepSpeedCPUAdam (its
  ``fp32_optimizer_states`` default), bf16 under the torch.optim.AdamW fallback (train.py:195), which the
  trainer takes when deepspeed is not importable (train.py:37-44) -- the GPU machine has no deepspeed.
* clipping: **always** -- ``torch.nn.utils.clip_grad_norm_(model.get_parameters(), config.max_grad_norm)``
  before every optimizer step (train.py:268), ``max_grad_norm = 1.0`` by default (training.py:69).
  Here it clips only when the spec has a ``max_grad_norm`` (bench_train: the same in every system).
* gradient accumulation: the trainer steps every ``gradient_accumulation_steps`` micro-batches and does
  not scale their losses (train.py:262-268): gradients are the sum of the micro-batch means. Same here.

Shims (the smallest needed; said in the row's settings):

* a model from a config: bench_train's seeded fp32 Llama (SDPA), its parameters cast to bf16 as
  ``from_pretrained(torch_dtype=bfloat16)`` would load them (buffers such as RoPE's ``inv_freq`` stay fp32,
  as from_pretrained leaves them); ``CPUMasterConfig`` requires a dataset name, given a placeholder.
* attention mask: ``forward_and_backward`` hands the 2-D ``[B, T]`` padding mask straight to every
  decoder layer (cpu_master.py:932); the shipped configs use flash_attention_2, which reads it as a
  padding mask on top of causal attention. Flash-attn is not installed on the GPU machine and SDPA would
  take the 2-D long mask as an additive, non-causal mask, so ``_build_layer_kwargs`` is overridden to pass
  ``attention_mask=None``: causal SDPA with no padding, which is what an all-ones mask means (the random
  token batches have no padding).
"""
from __future__ import annotations

import importlib.util
import sys

NAME = "megatrain_official"


def unsupported(spec: dict) -> str | None:
    """Why ``spec`` cannot run on this peer, or None (it needs CUDA)."""
    if not str(spec.get("device", "cuda")).startswith("cuda"):
        return f"{NAME} needs CUDA (its streams, events and pinned buffers)"
    return None


def _cast_params(model, dtype) -> None:
    """Parameters (not buffers) to ``dtype`` in place: what ``from_pretrained(torch_dtype=dtype)`` loads."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


def run(spec: dict, bench, src: str) -> dict:
    """One bench_train child: build, train ``warmup + steps`` optimizer steps, return the partial row."""
    import torch
    if src not in sys.path:
        sys.path.insert(0, src)
    from infinity import CPUMasterConfig, CPUMasterModel

    class CausalNoPaddingMaster(CPUMasterModel):
        """CPUMasterModel whose layers get ``attention_mask=None`` (causal SDPA; see the module docstring)."""

        def _build_layer_kwargs(self, mask, cache_position, position_ids, position_embeddings):
            kwargs = super()._build_layer_kwargs(mask, cache_position, position_ids, position_embeddings)
            kwargs["attention_mask"] = None
            return kwargs

    clip, ga = bench.clip_and_accum(spec)
    opt_cfg = bench.OPT
    model = bench.build_model(spec["model"], spec["seq"], spec["device"])
    n_params = sum(p.numel() for p in model.parameters())
    _cast_params(model, torch.bfloat16)
    config = CPUMasterConfig(
        model_name="bench_train config-built Llama", device=torch.cuda.current_device(), dtype=torch.bfloat16,
        attn_implementation="sdpa", dataset_name="random-tokens (unused)", max_seq_len=spec["seq"],
        batch_size=spec["batch"], gradient_accumulation_steps=ga, learning_rate=opt_cfg["lr"],
        weight_decay=opt_cfg["weight_decay"], beta1=opt_cfg["betas"][0], beta2=opt_cfg["betas"][1],
        eps=opt_cfg["eps"], max_grad_norm=clip if clip else 1.0)
    master = CausalNoPaddingMaster(model, config)
    del model
    params = master.get_parameters()
    if importlib.util.find_spec("deepspeed") is not None:  # the trainer's default optimizer type, train.py:183-192
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        optimizer = DeepSpeedCPUAdam(params, lr=opt_cfg["lr"], betas=opt_cfg["betas"], eps=opt_cfg["eps"],
                                     weight_decay=opt_cfg["weight_decay"], adamw_mode=True)
        opt_name, adam_state = "DeepSpeedCPUAdam(adamw_mode=True)", "fp32"
    else:  # train.py:194-201, what the trainer does without deepspeed
        optimizer = torch.optim.AdamW(params, lr=opt_cfg["lr"], betas=opt_cfg["betas"], eps=opt_cfg["eps"],
                                      weight_decay=opt_cfg["weight_decay"])
        opt_name, adam_state = "torch.optim.AdamW (defaults; CPU bf16 params)", "bf16"
    batches = bench.make_batches(spec, "cpu")  # the trainer hands CPU batches; forward_and_backward moves them
    ones = torch.ones_like(batches[0][0])

    def step(xs):
        for x in xs:
            loss, _, _ = master.forward_and_backward(x, ones, x)  # labels = input_ids; it shifts them itself
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        master._sync_params_to_gpu()
        master.zero_grad()
        optimizer.zero_grad()
        return loss  # a float: forward_and_backward returns loss.item()

    try:
        r = bench.timed_loop(step, batches, spec, torch.cuda.synchronize)
    finally:
        master.cleanup()
    r.update(
        n_params=n_params, precision="bf16", clips=bool(clip),
        clip_support="yes: its trainer always clips, clip_grad_norm_(max_grad_norm=1.0) (examples/sft/train.py:268, "
                     "infinity/config/training.py:69)",
        settings=dict(peer=NAME, api="infinity.CPUMasterModel.forward_and_backward + clip_grad_norm_ + optimizer.step + "
                                     "_sync_params_to_gpu (examples/sft/train.py:262-272)",
                      master_weights="bf16 on CPU (examples/sft/train.py:166, infinity/model/cpu_master.py:450,810)",
                      gradients="bf16 (pinned slabs, cpu_master.py:587)", adam_state=adam_state, optimizer=opt_name,
                      **opt_cfg, max_grad_norm=clip, grad_accum=ga,
                      grad_accum_scaling="none: micro-batch gradients summed (examples/sft/train.py:262-268)",
                      checkpoint_interval=config.checkpoint_interval, num_grad_slabs=config.num_grad_slabs,
                      attention="sdpa, attention_mask=None (shim: the shipped configs use flash_attention_2 with an "
                                "all-ones 2-D mask)",
                      model="bench_train seeded Llama, parameters cast to bf16 (shim for from_pretrained(torch_dtype=bf16))"))
    return r
