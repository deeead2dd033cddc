"""Sweep over transformers' causal-LM mapping: a tiny model of each type trained with megatrain and with plain PyTorch.

Used by ``tests/python/test_model_sweep.py`` (a CI sample and the ``slow`` full sweep) and by
``scripts/model_support_table.py`` (``docs/models.md``). megatrain is imported from ``sys.path``
(``PYTHONPATH``), so the same sweep runs against any checkout.

For one ``model_type`` (a key of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), :func:`run_type`:

1. builds a tiny config (:func:`tiny_config`: ``AutoConfig.for_model`` shrunk to hidden 64, 2 layers,
   4 heads / 2 KV heads, vocab 128, dropout 0; per-layer lists such as ``layer_types`` trimmed
   consistently; nested ``text_config`` / ``vision_config`` shrunk the same way; ``OVERRIDES`` where
   the generic shrinking is not enough) and an fp32 model from it (``AutoModelForCausalLM.from_config``,
   seed 0);
2. trains a deep copy with plain PyTorch (``torch.optim.AdamW`` + ``clip_grad_norm_``) in fp32 and
   another in fp64, and the model itself with ``megatrain.wrap`` + ``megatrain.optim.CPUAdamW``
   (fp32 compute on the CPU), ``STEPS`` steps of random token batches, ``labels=input_ids``;
3. compares the loss of every step and every parameter after the steps, per element
   (:func:`compare`).

Outcome (``SweepResult.status``):

- ``pass``: parity holds.
- ``refused``: ``megatrain.wrap`` raised its own one-line error (a message that starts with
  ``megatrain``); ``detail`` is that line.
- ``fail``: anything else: an exception in wrap / forward / backward / step, or a parity miss.
- ``skipped``: the tiny model cannot be built, or plain PyTorch does not train it here (it needs
  inputs other than ``input_ids``, ...): not counted against megatrain.
"""

from __future__ import annotations

import copy
import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

STEPS = 3
BATCH, SEQ = 2, 16
LR, WD, BETAS, MAX_GRAD_NORM = 1e-3, 0.1, (0.9, 0.95), 1.0
# Adam's eps of the project's parity runs (see parity.PARITY_EPS): keeps Adam from turning fp32
# noise on gradients that are zero in exact arithmetic into lr-sized updates.
EPS = 1e-6
# Per element: |megatrain - plain fp32| <= RTOL * |plain fp32| + RTOL * max|tensor| ...
RTOL = 1e-5
# ... or megatrain is no farther from the fp64 run than NOISE_K times plain fp32's own largest
# distance from it in that tensor: the element's difference is fp32 rounding noise that plain
# PyTorch has as well (e.g. an attention key bias, whose gradient is zero in exact arithmetic and
# fp32 noise in practice). Losses: per step, NOISE_K times plain fp32's distance at that step.
NOISE_K = 2.0

HIDDEN, LAYERS, HEADS, KV_HEADS, INTER, VOCAB, POSITIONS = 64, 2, 4, 2, 64, 128, 64

# Config keys (any family's spelling) and the tiny value they get.
_SIZE_KEYS = {
    # width
    "hidden_size": HIDDEN, "n_embd": HIDDEN, "d_model": HIDDEN, "n_embed": HIDDEN, "dim": HIDDEN,
    "embed_dim": HIDDEN, "model_dim": HIDDEN, "word_embed_proj_dim": HIDDEN, "embedding_size": HIDDEN,
    # depth
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "num_layers": LAYERS, "n_layers": LAYERS,
    "decoder_layers": LAYERS, "num_decoder_layers": LAYERS, "encoder_layers": LAYERS,
    # heads
    "num_attention_heads": HEADS, "n_head": HEADS, "num_heads": HEADS, "n_heads": HEADS,
    "decoder_attention_heads": HEADS, "encoder_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "n_kv_heads": KV_HEADS,
    "multi_query_group_num": KV_HEADS, "num_key_value_groups": None,
    # feed-forward
    "intermediate_size": INTER, "n_inner": INTER, "ffn_dim": INTER, "decoder_ffn_dim": INTER,
    "encoder_ffn_dim": INTER, "d_ff": INTER, "ffn_hidden_size": INTER, "inner_hidden_size": INTER,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    # vocabulary / positions
    "vocab_size": VOCAB, "decoder_vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "n_positions": POSITIONS, "n_ctx": POSITIONS,
    "max_seq_len": POSITIONS, "seq_length": POSITIONS, "max_sequence_length": POSITIONS,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    # multi-head latent attention
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    # state-space layers
    "mamba_d_state": 8, "ssm_state_size": 8, "state_size": 8, "mamba_dt_rank": 8, "time_step_rank": 8,
    "mamba_num_heads": 8, "mamba_n_heads": 8, "mamba_head_dim": 16, "mamba_d_head": 16, "mamba_d_ssm": 128,
    "mamba_chunk_size": 16, "chunk_size": 16, "n_mamba_heads": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "num_expert_group": 1, "num_experts_per_token": 2, "num_shared_experts": 1,
    # sparse-attention indexers (DeepSeek-V3.2 style)
    "index_head_dim": 16, "index_n_heads": 4, "index_topk": 8,
    # misc
    "sliding_window": 8, "attention_window_size": 8, "window_size": 8, "num_nextn_predict_layers": 0,
}
# Keys that only shrink (a model with 1 KV head or top-1 routing keeps it); the others are set.
_AT_MOST = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_experts_per_tok",
            "moe_topk", "moe_k", "n_group", "topk_group", "first_k_dense_replace", "num_expert_group",
            "num_experts_per_token", "num_shared_experts", "num_nextn_predict_layers", "sliding_window",
            "attention_window_size", "window_size"}
# Derived values recomputed from the tiny sizes when the config has them.
_DERIVED = ("head_dim", "kv_channels", "attention_head_size", "qk_head_dim")


@dataclass
class SweepResult:
    """One model type's outcome. ``max_rel_diff``: the largest relative difference between megatrain and
    plain fp32 PyTorch over the per-step losses (relative to the loss) and the parameters after the
    steps (per element, relative to the tensor's max |value|; elements judged rounding noise by the
    fp64 run left out); ``None`` when training did not finish."""

    model_type: str
    status: str  # pass | refused | fail | skipped
    detail: str = ""
    max_rel_diff: Optional[float] = None
    loss_rel_diff: Optional[float] = None
    worst: str = ""  # the parameter (or "loss") with the largest excess over the tolerance
    seconds: float = 0.0
    model_class: str = ""
    params: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def causal_lm_types() -> List[str]:
    """The model types of the installed transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, in its order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# Per-type config values applied after the generic shrinking (keys of the top-level config dict;
# "text_config.x" for a nested one). Only where the generic shrinking builds no model.
OVERRIDES: Dict[str, dict] = {
    # layer pattern from period / offset: layer 0 Mamba + dense MLP, layer 1 attention + MoE
    # the default config has no RoPE parameters per layer type
    "cohere_compass_text": {"rope_parameters": {t: {"rope_type": "default", "rope_theta": 10000.0}
                                                for t in ("full_attention", "sliding_attention")}},
    # MoE sizes left None by the default config
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # its sliding-window layers' head_dim is qk_nope_head_dim + qk_rope_head_dim
    "dots3_note_text": {"head_dim": 16},
    "dots3_note": {"text_config.head_dim": 16},
    # input / recurrent / output layer groups add up to the layer count
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "num_hidden_layers": 3},
    # Mamba-2 heads x head_dim = expand x hidden_size
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    # every layer is a Mamba layer by default (and plain HF training then fails on its cache)
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # no attention layer at all by default (attn_layer_indices None): layer 1 attention
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    # ReformerModelWithLMHead asserts is_decoder; in training the axial position shape multiplies to the
    # sequence length (4 x 4 = 16)
    "reformer": {"is_decoder": True, "attn_layers": ["local", "lsh"], "num_hidden_layers": 2, "axial_pos_shape": [4, 4],
                 "axial_pos_embds_dim": [32, 32], "max_position_embeddings": 16,
                 "local_attn_chunk_length": 8, "lsh_attn_chunk_length": 8, "num_buckets": 2},
}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def _n_layers(d: dict) -> Optional[int]:
    for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
        if isinstance(d.get(k), int):
            return d[k]
    return None


def _per_layer(key: str, value, n: int) -> bool:
    """Whether config entry ``key`` holds one value per layer (a list, or a pattern string like
    nemotron_h's ``hybrid_override_pattern``) of a model with ``n`` layers."""
    if n < 2 or not isinstance(value, (list, str)) or len(value) != n:
        return False
    return isinstance(value, list) or "pattern" in key or "layer" in key


def _pick_layers(d: dict, n: int) -> Optional[List[int]]:
    """Indices of the original ``n`` layers that the tiny model keeps: the first layer of every distinct
    value in each per-layer list (so sliding and full attention, attention and state-space layers all
    stay), at least ``LAYERS`` of them, in order. ``None`` if the config has no per-layer list."""
    lists = [v for k, v in d.items() if _per_layer(k, v, n)]
    if not lists:
        return None
    keep = set()
    for v in lists:
        seen = set()
        for i, x in enumerate(v):
            key = repr(x)
            if key not in seen:
                seen.add(key)
                keep.add(i)
    i = 0
    while len(keep) < min(LAYERS, n):
        keep.add(i)
        i += 1
    return sorted(keep)


def _shrink_values(v):
    """One layer's settings of a per-layer dict, with the tiny sizes."""
    if not isinstance(v, dict):
        return v
    return {k: (min(x, _SIZE_KEYS[k]) if k in _AT_MOST else _SIZE_KEYS[k])
            if k in _SIZE_KEYS and isinstance(x, int) and not isinstance(x, bool) and _SIZE_KEYS[k] is not None
            else x for k, x in v.items()}


def _shrink(d: dict) -> dict:
    """Shrink one config dict in place (and its nested sub-config dicts); returns it."""
    for k, v in list(d.items()):
        if isinstance(v, dict) and "model_type" in v:
            _shrink(v)
    n = _n_layers(d)
    # hybrids whose layer count is the length of their pattern list (nemotron_h: layers_block_type)
    keep = _pick_layers(d, n) if n else None
    for k, v in list(d.items()):
        if isinstance(v, dict) or isinstance(v, bool):
            continue
        low = k.lower()
        if isinstance(v, float) and ("dropout" in low or "pdrop" in low or "layerdrop" in low or "jitter" in low):
            d[k] = 0.0
        elif k in _SIZE_KEYS and isinstance(v, int) and _SIZE_KEYS[k] is not None:
            d[k] = min(v, _SIZE_KEYS[k]) if k in _AT_MOST else _SIZE_KEYS[k]
    if keep is not None:
        for k, v in list(d.items()):
            if _per_layer(k, v, n):
                d[k] = type(v)([v[i] for i in keep]) if isinstance(v, list) else "".join(v[i] for i in keep)
            elif isinstance(v, dict) and v and all(str(i).isdigit() for i in v):
                # per-layer settings keyed by layer index (gemma4, dots3: per_layer_config)
                d[k] = {type(next(iter(v)))(pos): _shrink_values(v[type(next(iter(v)))(i)])
                        for pos, i in enumerate(keep) if type(next(iter(v)))(i) in v}
        for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"):
            if isinstance(d.get(k), int):
                d[k] = len(keep)
    heads = next((d[k] for k in ("num_attention_heads", "n_head", "num_heads", "n_heads") if isinstance(d.get(k), int)), None)
    width = next((d[k] for k in ("hidden_size", "n_embd", "d_model", "dim") if isinstance(d.get(k), int)), None)
    if heads and width:
        for k in _DERIVED:
            if isinstance(d.get(k), int) or (k == "head_dim" and k in d and d[k] is None):
                d[k] = width // heads
        if isinstance(d.get("qk_head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int):
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d.get("qk_nope_head_dim", 0)
        if isinstance(d.get("head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int) and "kv_lora_rank" in d:
            d["head_dim"] = d["qk_rope_head_dim"]
        if "kv_lora_rank" in d and isinstance(d.get("num_key_value_heads"), int):
            d["num_key_value_heads"] = heads  # multi-head latent attention: one KV head per query head
        if isinstance(d.get("rotary_dim"), int):
            d["rotary_dim"] = min(d["rotary_dim"], width // heads // 2)
    for k in ("query_pre_attn_scalar",):
        if isinstance(d.get(k), (int, float)) and d.get("head_dim"):
            d[k] = d["head_dim"]
    vocab = d.get("vocab_size")
    if isinstance(vocab, int):
        special = 0
        for k, v in list(d.items()):
            if not (k.endswith("_token_id") or k.endswith("_token_ids") or k.endswith("_token_index")):
                continue
            if isinstance(v, int) and v >= vocab:
                special += 1
                d[k] = vocab - special
            elif isinstance(v, list):
                d[k] = [x if not isinstance(x, int) or x < vocab else vocab - 1 for x in v]
    return d


def _set_path(d: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        d = d[p]
    d[last] = value


def tiny_config(model_type: str):
    """A tiny, dropout-free config of ``model_type`` (see the module docstring). Raises whatever transformers raises."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    d = _shrink(default.to_dict())
    for path, value in OVERRIDES.get(model_type, {}).items():
        _set_path(d, path, value)
    d.pop("transformers_version", None)
    return type(default).from_dict(d)


def tiny_model(model_type: str):
    """An fp32 ``AutoModelForCausalLM`` built from :func:`tiny_config` with seed 0, in train mode."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.float().train()


def _batches(vocab: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    # ids from 3: special ids (pad / bos / eos, often 0..2) never appear in the batch
    return [torch.randint(3, vocab, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _vocab(model) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None) or emb.weight.shape[0]
    cfg = model.config
    v = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", None) or n
    return min(int(n), int(v))


def train_plain(model, batches, dtype=torch.float32):
    """Plain PyTorch: ``torch.optim.AdamW`` + ``clip_grad_norm_``. Returns ``(losses, {name: tensor})``."""
    model = model.to(dtype)
    if dtype == torch.float64 and hasattr(model, "set_experts_implementation"):
        try:  # torch's grouped_mm (transformers' default MoE kernel) has no fp64
            model.set_experts_implementation("eager")
        except Exception:  # noqa: BLE001 - a model without MoE experts
            pass
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    losses = []
    for x in batches:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_megatrain(wrapped, batches):
    """megatrain: ``CPUAdamW`` with the same hyperparameters. Returns ``(losses, {name: fp32 master})``."""
    import megatrain

    opt = megatrain.optim.CPUAdamW([p for p in wrapped.parameters() if p.requires_grad], lr=LR, betas=BETAS,
                                   eps=EPS, weight_decay=WD, max_grad_norm=MAX_GRAD_NORM)
    losses = []
    for x in batches:
        loss = wrapped(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().item())
    return losses, megatrain.master_state_dict(wrapped)


def compare(got_losses, got, ref_losses, ref, ref64_losses=None, ref64=None):
    """Per-step losses and every parameter, per element (see ``RTOL`` / ``NOISE_K``).

    Returns ``(ok, max_rel_diff, loss_rel_diff, worst_name, message)``.
    """
    worst_name, worst_excess, max_rel, loss_rel = "", -math.inf, 0.0, 0.0
    msgs = []
    for i, (a, b) in enumerate(zip(got_losses, ref_losses)):
        rel = abs(a - b) / max(abs(b), 1e-30)
        loss_rel = max(loss_rel, rel)
        ok = rel <= RTOL
        if not ok and ref64_losses is not None:
            c = ref64_losses[i]
            ok = abs(a - c) <= NOISE_K * abs(b - c) + RTOL * abs(c)
        if not math.isfinite(a) or not ok:
            msgs.append(f"step {i} loss {a:.8g} vs plain {b:.8g}")
            if rel > worst_excess:
                worst_name, worst_excess = "loss", rel
    missing = sorted(set(ref) - set(got))
    if missing:
        msgs.append(f"parameters missing from megatrain.master_state_dict: {missing[:3]}")
    for name, b in ref.items():
        if name not in got:
            continue
        a = got[name].double()
        b = b.double()
        if a.shape != b.shape:
            msgs.append(f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            continue
        if b.numel() == 0:
            continue
        scale = float(b.abs().max())
        atol = RTOL * scale + 1e-12
        diff = (a - b).abs()
        bad = diff > RTOL * b.abs() + atol
        counted = diff
        if bad.any() and ref64 is not None and name in ref64:
            c = ref64[name].double()
            noise = float((b - c).abs().max())  # plain fp32's own rounding error in this tensor
            noise_ok = (a - c).abs() <= NOISE_K * noise + RTOL * c.abs() + atol
            counted = torch.where(bad & noise_ok, torch.zeros_like(diff), diff)  # rounding noise: not counted
            bad = bad & ~noise_ok
        max_rel = max(max_rel, float(counted.max()) / max(scale, 1e-30))
        if not torch.isfinite(a).all():
            bad = torch.ones_like(bad)
        if bad.any():
            excess = float(((diff - RTOL * b.abs() - atol) / max(scale, 1e-30))[bad].max())
            msgs.append(f"{name}: {int(bad.sum())}/{b.numel()} elements differ (max |diff| {float(diff.max()):.3e}, "
                        f"max |plain| {scale:.3e})")
            if excess > worst_excess:
                worst_name, worst_excess = name, excess
    max_rel = max(max_rel, loss_rel)
    return not msgs, max_rel, loss_rel, worst_name, "; ".join(msgs)


def run_type(model_type: str) -> SweepResult:
    """Train a tiny ``model_type`` with megatrain and with plain PyTorch; classify it (see the module docstring).

    Never raises for a model's failure: every outcome is a :class:`SweepResult`.
    """
    import megatrain

    t0 = time.time()
    res = SweepResult(model_type, "fail")
    try:
        try:
            model = tiny_model(model_type)
        except Exception as exc:  # noqa: BLE001 - any transformers failure: the type has no tiny model here
            res.status, res.detail = "skipped", f"no tiny model: {_first_line(exc)}"
            return res
        res.model_class = type(model).__name__
        res.params = sum(p.numel() for p in model.parameters())
        batches = _batches(_vocab(model))
        ref_model = copy.deepcopy(model)
        ref64_model = copy.deepcopy(model)
        try:
            ref_losses, ref = train_plain(ref_model, batches)
            if not all(math.isfinite(v) for v in ref_losses):
                raise RuntimeError(f"non-finite loss {ref_losses}")
        except Exception as exc:  # noqa: BLE001
            res.status = "skipped"
            res.detail = f"plain PyTorch does not train it here: {_first_line(exc)}"
            return res
        del ref_model
        try:
            ref64_losses, ref64 = train_plain(ref64_model, batches, torch.float64)
        except Exception:  # noqa: BLE001 - no fp64 judge: strict fp32 comparison only
            ref64_losses, ref64 = None, None
        del ref64_model
        try:
            wrapped = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
        except Exception as exc:  # noqa: BLE001
            line = _first_line(exc)
            msg = str(exc).strip()
            if msg.startswith("megatrain") and "\n" not in msg:
                res.status, res.detail = "refused", msg[:300]
            else:
                res.detail = f"at wrap: {line}"
            return res
        try:
            got_losses, got = train_megatrain(wrapped, batches)
        except Exception as exc:  # noqa: BLE001
            tb = traceback.extract_tb(exc.__traceback__)
            where = f" ({tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
            res.detail = f"in training: {_first_line(exc)}{where}"
            return res
        ok, res.max_rel_diff, res.loss_rel_diff, res.worst, msg = compare(got_losses, got, ref_losses, ref,
                                                                           ref64_losses, ref64)
        res.status = "pass" if ok else "fail"
        res.detail = "" if ok else f"parity: {msg}"[:500]
        return res
    finally:
        res.seconds = round(time.time() - t0, 2)
