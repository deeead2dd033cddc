"""Shared helpers for parity tests: train a model the plain PyTorch way and with megatrain, side by side."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

import megatrain


@dataclass
class RunResult:
    losses: List[float] = field(default_factory=list)
    params: dict = field(default_factory=dict)  # name -> fp32 CPU tensor after training
    grad_norms: List[float] = field(default_factory=list)


def make_batches(vocab: int, steps: int, micro_batches: int, batch: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(micro_batches)] for _ in range(steps)]


def param_groups(model, mode: str, lr: float, wd: float):
    """``mode`` 'one': one group; 'two': decay / no-decay groups with different lr (norms and biases in the second)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if mode == "one":
        return [{"params": [p for _, p in named]}]
    decay = [p for n, p in named if p.ndim >= 2]
    no_decay = [p for n, p in named if p.ndim < 2]
    return [{"params": decay, "weight_decay": wd, "lr": lr},
            {"params": no_decay, "weight_decay": 0.0, "lr": lr * 0.5}]


# Adam's eps for parity runs. GPT-2's attention key bias has a gradient that is exactly zero in
# theory (softmax is shift-invariant) and ~1e-10 of fp32 noise in practice; with eps=1e-8 Adam
# turns that noise into updates of ~1% of lr whose sign differs between any two fp32 summation
# orders. eps=1e-6 keeps real updates (|grad| >> 1e-6) unchanged and that noise below 1e-5.
PARITY_EPS = 1e-6


def train_reference(model, batches, *, lr, wd, betas, max_grad_norm, groups, device="cpu", autocast=None):
    model = model.to(device)
    opt = torch.optim.AdamW(param_groups(model, groups, lr, wd), lr=lr, betas=betas, weight_decay=wd,
                            eps=PARITY_EPS, foreach=False)
    res = RunResult()
    for micro in batches:
        total = 0.0
        for x in micro:
            x = x.to(device)
            with torch.autocast(device_type="cuda", dtype=autocast) if autocast else _null():
                loss = model(input_ids=x, labels=x).loss / len(micro)
            loss.backward()
            total += loss.item()
        if max_grad_norm is not None:
            res.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        opt.zero_grad()
        res.losses.append(total)
    res.params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    return res


def train_megatrain(model, batches, *, lr, wd, betas, max_grad_norm, groups, device="cpu",
                    compute_dtype=torch.float32, activation_policy="recompute", **wrap_kw):
    model = megatrain.wrap(model, device=device, compute_dtype=compute_dtype, activation_policy=activation_policy,
                           **wrap_kw)
    opt = megatrain.optim.CPUAdamW(param_groups(model, groups, lr, wd), lr=lr, betas=betas, weight_decay=wd,
                                   eps=PARITY_EPS, max_grad_norm=max_grad_norm,
                                   gradient_accumulation_steps=len(batches[0]))
    res = RunResult()
    for micro in batches:
        total = 0.0
        for x in micro:
            x = x.to(device)
            loss = model(input_ids=x, labels=x).loss / len(micro)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        if max_grad_norm is not None:
            res.grad_norms.append(opt.last_grad_norm)
        res.losses.append(total)
    res.params = megatrain.master_state_dict(model)
    return res, model, opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, rtol: float, name: str, atol: float = 0.0):
    """Per element: |a - b| <= rtol * |b| + atol.

    ``atol`` defaults to ``rtol * max|b|``: elements near zero are held to the tensor's own scale
    (fp32 summation order, e.g. of the two contributions to a tied embedding's gradient, moves
    them by a few ulps of the tensor's magnitude, which Adam's m / sqrt(v) can enlarge).
    """
    a, b = a.double(), b.double()
    if atol == 0.0:
        atol = rtol * float(b.abs().max()) + 1e-12
    err = (a - b).abs() - (rtol * b.abs() + atol)
    worst = float(err.max())
    assert worst <= 0, f"{name}: max excess {worst:.3e} (max |a-b| {float((a-b).abs().max()):.3e})"


def run_cli(argv, capsys):
    """``megatrain.cli.main(argv)`` in this process: ``(exit code, stdout, stderr)`` (SystemExit caught)."""
    from megatrain.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def tiny_llama_config(tied: bool = False):
    """A 2-layer Llama config (hidden 32, GQA 4/2, vocab 96) for loading / estimate tests."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tied)


def tiny_gpt2_config():
    """A 2-layer GPT-2 config (tied embeddings, vocab 96, 64 positions)."""
    from transformers import GPT2Config
    return GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64, bos_token_id=0, eos_token_id=0)


def poison_gradient_at(layer):
    """Make the gradient that enters ``layer``'s output in backward NaN (a forward hook); returns its handle."""
    def poison(mod, args, out):
        t = out[0] if isinstance(out, tuple) else out
        t.register_hook(lambda g: g * float("nan"))

    return layer.register_forward_hook(poison)


def slow_checkpoint_writes(seconds: float) -> None:
    """Make ``megatrain.save_checkpoint`` sleep ``seconds`` after each unit file it writes.

    For tests that kill a process (or race another save) in the middle of a checkpoint save.
    """
    import time

    import megatrain.state.checkpoint.save as ck

    real = ck.write_state_safetensors

    def slow(*a, **k):
        out = real(*a, **k)
        time.sleep(seconds)
        return out

    ck.write_state_safetensors = slow


def limit_auto_room(monkeypatch, room: Callable[[int, int], float]) -> None:
    """Make ``activation_policy="auto"`` decide as if its budget were ``room(layer_bytes, input_bytes)``
    bytes: the free device memory it reads is set to that over ``AUTO_STORE_FRACTION`` when it decides
    (``layer_bytes``: the measured graph of one layer call; ``input_bytes``: its differentiable inputs)."""
    import importlib

    wrap_mod = importlib.import_module("megatrain.runtime.model.wrap")
    policies = importlib.import_module("megatrain.runtime.activations.policies")
    decide = policies.LayerActivations.decide_auto

    def limited(self, key, layer_bytes, input_bytes=0):
        budget = room(layer_bytes, input_bytes)
        self.engine.free_device_bytes = lambda: int(budget / wrap_mod.AUTO_STORE_FRACTION)
        decide(self, key, layer_bytes, input_bytes)

    monkeypatch.setattr(policies.LayerActivations, "decide_auto", limited)


def keep_compute_copy(fn):
    """``fn`` (``megatrain.wrap`` / ``estimate`` / ``from_pretrained`` / ``from_config``) with
    ``host_compute_copy=True``: for tests of the exclusive and disk tiers under a host limit, which the
    default ``"auto"`` reaches only after master-streaming every eligible layer."""
    import functools

    return functools.partial(fn, host_compute_copy=True)
