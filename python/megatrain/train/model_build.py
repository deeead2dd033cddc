"""The model of a ``megatrain train`` run: its config (``model.path`` or ``model.arch``), its weights
checked against it, and the wrapped model built straight into the host store.

:func:`load_model_config` and :func:`check_checkpoint` run in :func:`megatrain.train.run_plan.prepare`
(nothing is built); :func:`build_wrapped_model` and :func:`check_causal` start :func:`megatrain.train.trainer.run`.
"""

from __future__ import annotations

import math
import os

from megatrain.runtime.placement.estimate import has_weight_files
from megatrain.train.config import Config, UsageError
from megatrain.train.wrap_args import wrap_options
from megatrain.train.messages import first_line, warn


def _check_arch(arch: str) -> None:
    """Raises a one-line UsageError if ``arch`` is not a transformers ``model_type``."""
    from transformers import CONFIG_MAPPING

    if arch in CONFIG_MAPPING:
        return
    import difflib

    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm
    except ImportError:  # pragma: no cover - moved in some transformers version: no suggestion then
        causal_lm = {}
    close = difflib.get_close_matches(arch.lower(), list(causal_lm), n=3, cutoff=0.7)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise UsageError(
        f"model {arch!r} is neither a local model directory nor a transformers model_type{hint}; pass a local "
        "Hugging Face model directory (--model ./DIR, model.path) or an architecture such as llama, qwen2, "
        "mistral (model.arch)"
    )


def load_model_config(cfg: Config, vocab_size: int, eos_token_id: int, tokenizer: str = "the tokenizer",
                      weights: bool = True):
    """The HF config of the model to train (from ``model.path`` or built from ``model.arch``).

    Args:
        tokenizer: how the vocabulary check's error names the tokenizer.
        weights: require weights in ``model.path`` (False for ``--dry-run``: config.json is enough).

    Raises:
        UsageError: missing directory / config.json / weights, unknown architecture, bad sizes, a
            tokenizer with more tokens than the model's embedding has rows.
    """
    m = cfg.model
    if m.path is not None:
        config = _config_from_dir(m.path, weights)
    else:
        config = _config_from_arch(m, vocab_size, eos_token_id)
    _check_config(cfg, config, vocab_size, tokenizer)
    return config


def _config_from_dir(path: str, weights: bool):
    """The config.json of model directory ``path`` (its weights required unless ``weights`` is False)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise UsageError(f"model path {path!r} is not a directory; give a local Hugging Face model directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"model directory {path!r} has no config.json; save the model with save_pretrained")
    if weights and not has_weight_files(path):
        raise UsageError(
            f"model directory {path!r} has no weights (*.safetensors or pytorch_model.bin); "
            "save the model with save_pretrained or build one from model.arch (--dry-run estimates the memory "
            "from config.json alone)"
        )
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"cannot read the config of model {path!r} ({first_line(exc)})") from None


def _config_from_arch(m, vocab_size: int, eos_token_id: int):
    """The config ``model.arch`` and the sizes of section ``m`` (``cfg.model``) build; warns of
    ``model.extra`` keys no layer reads."""
    from transformers import AutoConfig

    vocab = m.vocab_size
    if vocab is None:
        mult = m.pad_vocab_to_multiple_of
        vocab = int(math.ceil(vocab_size / mult) * mult)
    kwargs = dict(
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        vocab_size=vocab,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
    )
    if m.num_kv_heads is not None:
        kwargs["num_key_value_heads"] = m.num_kv_heads
    if m.intermediate_size is not None:
        kwargs["intermediate_size"] = m.intermediate_size
    kwargs.update(m.extra)
    _check_arch(m.arch)
    try:
        config = AutoConfig.for_model(m.arch, **kwargs)
    except Exception as exc:  # noqa: BLE001
        raise UsageError(
            f"cannot build a {m.arch!r} model config ({first_line(exc)}); "
            "model.arch must be a transformers model_type such as llama, qwen2, mistral"
        ) from None
    # A key the config class consumes (transformers 5 folds rope_theta into rope_parameters) is read even
    # though it is no attribute; only a key the config stores as it came, unknown to its class, is read by nothing.
    known = set(type(config)().to_dict())
    stored = config.to_dict()
    unknown = sorted(k for k in m.extra if k not in known and k in stored)
    if unknown:
        warn(f"model.extra key(s) {', '.join(map(repr, unknown))} are not attributes of "
             f"{type(config).__name__} (a typo?); they are stored in config.json but no layer reads them")
    return config


def _check_config(cfg: Config, config, vocab_size: int, tokenizer: str) -> None:
    """Refuses a config with no causal-LM class, a limit below ``data.seq_len`` or too few embedding rows."""
    from transformers import AutoModelForCausalLM

    m = cfg.model
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise UsageError(
            f"model type {config.model_type!r} has no causal-LM class in transformers; use a decoder model such as llama"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and cfg.data.seq_len > limit:
        raise UsageError(
            f"data.seq_len ({cfg.data.seq_len}) is above the model's limit max_position_embeddings ({limit}); "
            "lower --seq-len"
        )
    model_vocab = getattr(config, "vocab_size", None)
    if model_vocab is not None and vocab_size > model_vocab:
        fix = ("pass the tokenizer the model was trained with: --tokenizer DIR" if m.path is not None
               else "raise model.vocab_size or pass a smaller tokenizer with --tokenizer")
        raise UsageError(
            f"{tokenizer} has {vocab_size} tokens but the model's embedding has {model_vocab} rows (vocab_size): "
            f"token ids past {model_vocab - 1} have no embedding; {fix}"
        )


def has_safetensors(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def check_checkpoint(path: str, model_config) -> None:
    """Refuse a model directory whose safetensors do not cover the model, from the headers alone
    (:func:`check_loading_info`'s messages; ``megatrain.from_pretrained`` refuses the same later).

    Raises:
        UsageError: a truncated / malformed file, a shard missing, a tensor missing or of the wrong shape.
    """
    from megatrain.state.loading import CheckpointError, CheckpointIndex, _aliases, meta_model

    try:
        index = CheckpointIndex(path)
        model = meta_model(model_config)
    except CheckpointError as exc:
        raise UsageError(f"cannot load model {path!r} ({first_line(exc, 300)})") from None
    except Exception as exc:  # noqa: BLE001
        raise UsageError(f"cannot build a model from this config ({first_line(exc)}); check the model sizes and "
                         "model.extra") from None
    prefix = getattr(model, "base_model_prefix", "")
    missing, mismatched, used = [], [], set()
    for first, names in _aliases(model).items():
        key = index.lookup(names, prefix)
        if key is None:
            missing.append(first)
            continue
        used.add(key)
        if tuple(index.tensors[key][1]["shape"]) != tuple(model.get_parameter(first).shape):
            mismatched.append(first)
    if mismatched:
        raise UsageError(f"model directory {path!r} holds weights whose shapes differ from its config.json "
                         f"({mismatched[0]} and {len(mismatched) - 1} more; another model size?); use the config.json "
                         "saved with these weights")
    buffers = {n for n, _ in model.named_buffers()}
    unexpected = [k for k in index.tensors if k not in used and index.lookup([k], prefix) not in used
                  and k not in buffers and not (prefix and f"{prefix}.{k}" in buffers)]
    check_loading_info(path, {"missing_keys": missing, "mismatched_keys": mismatched, "unexpected_keys": unexpected})


def check_loading_info(path: str, info: dict) -> None:
    """Refuse a model directory whose weights do not cover the model (transformers would initialise
    the missing tensors at random and train on that) or do not fit it.

    Raises:
        UsageError: naming the first missing / mismatched tensors.
    """
    missing = sorted(info.get("missing_keys") or [])
    mismatched = [k[0] if isinstance(k, (tuple, list)) else k for k in (info.get("mismatched_keys") or [])]
    unexpected = sorted(info.get("unexpected_keys") or [])
    if missing or mismatched:
        bad = missing or sorted(mismatched)
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        what = "has no weights for" if missing else "has weights of the wrong shape for"
        hint = f" (it holds {len(unexpected)} tensors the model does not use: a different architecture?)" if unexpected else ""
        raise UsageError(f"model directory {path!r} {what} {len(bad)} tensor(s) of the model: {shown}{hint}; they would "
                         "train from a random initialisation: use a complete checkpoint (its config.json must match)")
    if unexpected:
        shown = ", ".join(unexpected[:3]) + (f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
        warn(f"model directory {path!r} holds {len(unexpected)} tensor(s) the model does not use (ignored): "
             f"{shown}")


def build_wrapped_model(plan):
    """The wrapped model, built straight into the host store: ``megatrain.from_pretrained(model.path)``
    (safetensors) or ``megatrain.from_config`` (the same values as ``torch.manual_seed(train.seed);
    AutoModelForCausalLM.from_config(config)``). The whole model never exists in memory; the store's
    budget check refuses a model that does not fit before anything large is allocated. A directory
    with only ``pytorch_model.bin`` is loaded with transformers first (:func:`build_model`).

    Raises:
        UsageError: the checkpoint cannot be loaded (names the file and tensor).
    """
    import torch

    import megatrain

    cfg = plan.cfg
    kw = wrap_options(cfg, plan.device, plan.compute_dtype).as_kwargs()  # megatrain.wrap's keywords
    torch.manual_seed(cfg.train.seed)
    if cfg.model.path is not None and not has_safetensors(cfg.model.path):
        warn(f"model directory {cfg.model.path!r} has no safetensors weights: it is loaded whole with "
             "transformers (4 B/param more while loading); save_pretrained writes safetensors")
        return megatrain.wrap(build_model(plan), **kw)
    if cfg.model.path is not None:
        try:
            return megatrain.from_pretrained(cfg.model.path, **kw)
        except megatrain.CheckpointError as exc:
            raise UsageError(f"cannot load model {cfg.model.path!r} ({first_line(exc, 300)})") from None
    return megatrain.from_config(plan.model_config, seed=cfg.train.seed, **kw)


def build_model(plan):
    """The fp32 CPU model: ``from_pretrained(model.path)`` or random init from the seed (in memory;
    the trainer uses :func:`build_wrapped_model`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(plan.cfg.train.seed)
    if plan.cfg.model.path is not None:
        path = plan.cfg.model.path
        from transformers.utils import logging as hf_logging

        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # its load report of missing keys: ours below is one line
        hf_logging.disable_progress_bar()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True,
                                                               output_loading_info=True)
        except Exception as exc:  # noqa: BLE001
            if "ignore_mismatched_sizes" in str(exc):  # its "report above" is silenced: say it here
                raise UsageError(f"model directory {path!r} holds weights whose shapes differ from its config.json "
                                 "(another model size?); use the config.json saved with these weights") from None
            raise UsageError(f"cannot load model {path!r} ({first_line(exc)})") from None
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        check_loading_info(path, info)
        from megatrain.state.loading import count_nonfinite

        for name, p in model.named_parameters():
            bad = count_nonfinite(p)
            if bad:
                raise UsageError(f"cannot load model {path!r} (tensor {name} holds {bad} non-finite value(s) (NaN or "
                                 f"inf) of {p.numel()}; training would start from them: use an intact checkpoint)")
        return model
    return AutoModelForCausalLM.from_config(plan.model_config, dtype=torch.float32)


def check_causal(model) -> None:
    """Raises a one-line UsageError if the model's logits at a position depend on later tokens.

    ``AutoModelForCausalLM`` also builds encoder architectures (BERT, RoBERTa, ELECTRA, ...) as
    "causal" LM heads, which attend to the whole sequence unless their config sets
    ``is_decoder=True``: next-token training would then see the token it predicts. One forward of
    3 tokens in eval mode (no dropout) on the CPU model compares the first two positions' logits
    with the last token changed.
    """
    import torch

    was_training = model.training
    model.eval()
    engine = getattr(model, "megatrain", None)
    device = engine.device if engine is not None else torch.device("cpu")
    try:
        with torch.no_grad():
            x = torch.tensor([[1, 2, 3]], device=device)
            y = torch.tensor([[1, 2, 4]], device=device)
            a = model(input_ids=x).logits[0, :2].float()
            b = model(input_ids=y).logits[0, :2].float()
    except Exception as exc:  # noqa: BLE001 - a config transformers builds but cannot run (e.g. odd head_dim)
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise UsageError(f"model {kind!r} fails on a 3-token forward with this config ({first_line(exc)}); check "
                         "the model sizes (e.g. hidden_size / num_heads must be even for rotary embeddings)") from None
    finally:
        model.train(was_training)
        if engine is not None and getattr(engine, "auto_decisions", None):
            engine.auto_decisions.clear()  # the probe's shape is not the run's (activation_policy=auto)
    # fp32: equal bit for bit in a causal model; bf16 kernels may round differently per call.
    exact = a.dtype == b.dtype and (engine is None or engine.compute_dtype == torch.float32)
    same = torch.equal(a, b) if exact else bool((a - b).abs().max() <= 1e-2 * max(1.0, float(a.abs().max())))
    if not same:
        kind = getattr(model.config, "model_type", type(model).__name__)
        raise UsageError(
            f"model {kind!r} is not causal: its predictions at a position change with later tokens, so next-token "
            "training would see the answer. Use a decoder-only architecture (llama, qwen2, mistral, gpt2, ...)"
            + (", or set model.extra: {is_decoder: true}" if hasattr(model.config, "is_decoder") else "")
        )
