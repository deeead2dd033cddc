"""Reading a model's Hugging Face config where it nests (multimodal wrappers) or varies per layer.

A ``*ForConditionalGeneration`` model (Gemma 3, Gemma 4, ...) keeps its text model's settings in
``config.text_config``: the text model reads ``text_config.use_cache``, not the top-level flag.
A heterogeneous config (transformers' per-layer configs, e.g. Dots 3) raises on a global read of an
attribute that varies per layer (``num_attention_heads``): such attributes are read per layer.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple


def sub_configs(cfg) -> List[Tuple[Tuple[str, ...], object]]:
    """``cfg`` and every config nested in it (``text_config``, ``vision_config``, ...), each once.

    Returns:
        ``[(path, config), ...]``: ``path`` is the tuple of attribute names from ``cfg`` (``()`` for
        ``cfg`` itself, ``("text_config",)`` for its text config), depth first. ``[]`` for ``None``.
    """
    if cfg is None:
        return []
    out, seen = [], set()

    def visit(c, path):
        if id(c) in seen or len(path) > 4:
            return
        seen.add(id(c))
        out.append((path, c))
        for k, v in list(vars(c).items()):
            if not k.startswith("_") and v is not None and _is_config(v):
                visit(v, path + (k,))
    visit(cfg, ())
    return out


def _is_config(v) -> bool:
    return any(t.__name__ in ("PretrainedConfig", "PreTrainedConfig") for t in type(v).__mro__)


def _get(c, name: str, default=None):
    """``getattr(c, name, default)`` that also takes a per-layer attribute's refusal as "no global value"."""
    try:
        return getattr(c, name, default)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError (a RuntimeError)
        return default


def cache_flags(cfg) -> Dict[Tuple[str, ...], object]:
    """``use_cache`` of ``cfg`` and of each nested config that has one: ``{path: value}`` (see :func:`sub_configs`)."""
    flags = {}
    for path, c in sub_configs(cfg):
        v = _get(c, "use_cache", _MISSING)
        if v is not _MISSING:
            flags[path] = v
    return flags


def set_cache_flags(cfg, flags) -> None:
    """Set ``use_cache`` of ``cfg`` and its nested configs: ``flags`` is one value for all of them (those that
    have the attribute) or a ``{path: value}`` dict from :func:`cache_flags`."""
    for path, c in sub_configs(cfg):
        if isinstance(flags, dict):
            if path in flags:
                c.use_cache = flags[path]
        elif _get(c, "use_cache", _MISSING) is not _MISSING:
            c.use_cache = flags


def cache_asked(cfg) -> bool:
    """Whether ``cfg`` or a nested config has ``use_cache`` set (a forward would build a KV cache)."""
    return any(bool(v) for v in cache_flags(cfg).values())


def router_logits_asked(cfg) -> bool:
    """Whether ``cfg`` or a nested config sets ``output_router_logits`` (per layer: any layer's)."""
    return cfg is not None and any(config_value(c, "output_router_logits", False) for _, c in sub_configs(cfg))


def write_cache_flags(config_dict: dict, flags: Dict[Tuple[str, ...], object]) -> None:
    """Write ``flags`` (from :func:`cache_flags`) into a ``config.json`` dict, nested configs included."""
    for path, v in flags.items():
        d = config_dict
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, dict):
            d["use_cache"] = v


def config_value(cfg, name: str, default=None, layer: Optional[int] = None):
    """``cfg.<name>`` for code that reads a model's shape from its config.

    A per-layer attribute of a heterogeneous config (transformers raises on its global read) is read
    from layer ``layer``'s config when given, else as the largest value over the layers (an upper
    bound: what memory checks need). ``default`` when the config has no such attribute.
    """
    try:
        return getattr(cfg, name, default)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError: varies per layer
        pass
    try:
        per_layer = cfg.per_layer_config
        if layer is not None:
            return getattr(per_layer[layer], name, default)
        values = [getattr(per_layer[i], name, None) for i in range(len(per_layer))]
    except Exception:  # noqa: BLE001 - no per-layer view: as if unset
        return default
    values = [v for v in values if v is not None]
    if not values:
        return default
    try:
        return max(values)
    except TypeError:
        return values[0]


_MISSING = object()
