"""``ModelShape``: the sizes of a causal LM's config that the rough activation and logits estimates use
(``megatrain.estimate``, and ``wrap``'s activation reserve for its batch). Reads the config alone: importing it
pulls in no model loading (:mod:`.model_shape` builds the model to plan)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..model.model_config import config_value


def _cfg_int(cfg, *names, default=None):
    for n in names:
        v = config_value(cfg, n, None)  # a per-layer attribute (heterogeneous config): its largest value
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a causal LM's (text) config that the activation and logits estimates use.

    Attributes:
        hidden: hidden size (``hidden_size`` / ``n_embd`` / ``d_model``; 0 when none).
        intermediate: MLP width (``intermediate_size`` / ``n_inner`` / ``ffn_dim``; default 4 x hidden).
        heads, kv_heads, head_dim: attention heads, key/value heads (default: heads), head width.
        vocab: vocabulary size (0 when none).
    """

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def of(cls, config) -> Optional["ModelShape"]:
        """The shape of ``config`` (its text config for a multimodal one); None for no config."""
        if config is None:
            return None
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        h = _cfg_int(cfg, "hidden_size", "n_embd", "d_model", default=0)
        heads = _cfg_int(cfg, "num_attention_heads", "n_head", default=1) or 1
        return cls(hidden=h,
                   intermediate=_cfg_int(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * h) or 4 * h,
                   heads=heads, kv_heads=_cfg_int(cfg, "num_key_value_heads", default=heads) or heads,
                   head_dim=_cfg_int(cfg, "head_dim", default=h // heads if heads else h) or 1,
                   vocab=_cfg_int(cfg, "vocab_size", default=0))
