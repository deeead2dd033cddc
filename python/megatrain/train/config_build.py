"""The configuration of a run from its sources: preset defaults <- YAML file <- ``--set`` overrides.

:func:`build_config` merges them (unknown sections and keys are errors, :func:`resolve_key`) and
builds a checked :class:`~megatrain.train.config.Config` (:mod:`megatrain.train.config_checks`);
:func:`to_yaml` writes one back.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from typing import Optional

from megatrain.train.config import SECTION_CLASSES, Config, UsageError
from megatrain.train.config_checks import coerce, describe_value, validate
from megatrain.train.presets import PRESETS


def _field_types(cls) -> dict:
    return typing.get_type_hints(cls)


def _all_keys() -> dict:
    """Maps every bare key name to the sections that have it (for ``--set lr=...``)."""
    out: dict = {}
    for section, cls in SECTION_CLASSES.items():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, []).append(section)
    return out


def resolve_key(key: str) -> tuple:
    """Turns ``"train.lr"`` or an unambiguous bare ``"lr"`` into ``("train", "lr")``."""
    key = key.strip().replace("-", "_")
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTION_CLASSES:
            raise UsageError(
                f"unknown config section {section!r} in {key!r}; sections are: {', '.join(SECTION_CLASSES)}"
            )
        names = [f.name for f in dataclasses.fields(SECTION_CLASSES[section])]
        if name not in names:
            raise UsageError(f"unknown config key {key!r}; {section} keys are: {', '.join(names)}")
        return section, name
    owners = _all_keys().get(key)
    if not owners:
        raise UsageError(f"unknown config key {key!r}; use section.key, e.g. train.lr (see `megatrain train --print-config`)")
    if len(owners) > 1:
        raise UsageError(f"config key {key!r} is ambiguous; write one of: {', '.join(s + '.' + key for s in owners)}")
    return owners[0], key


def merge(base: dict, overrides: dict, where: str) -> dict:
    """Deep-merges a user mapping into ``base`` (a ``Config.to_dict()``), rejecting unknown keys."""
    if overrides is None:
        return base
    if not isinstance(overrides, dict):
        raise UsageError(f"{where} must be a mapping of sections ({', '.join(SECTION_CLASSES)}), got {describe_value(overrides)}")
    out = copy.deepcopy(base)
    for section, values in overrides.items():
        if section not in SECTION_CLASSES:
            raise UsageError(
                f"unknown config section {section!r} in {where}; sections are: {', '.join(SECTION_CLASSES)}"
            )
        if values is None:
            continue
        if not isinstance(values, dict):
            raise UsageError(f"config section {section!r} in {where} must be a mapping, got {describe_value(values)}")
        for name, value in values.items():
            resolve_key(f"{section}.{name}")  # raises on unknown keys
            out[section][name] = value
    return out


def from_dict(raw: dict) -> Config:
    """Builds a checked :class:`Config` from a fully merged mapping."""
    sections = {}
    for section, cls in SECTION_CLASSES.items():
        types = _field_types(cls)
        values = raw.get(section, {})
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name in values:
                kwargs[f.name] = coerce(f"{section}.{f.name}", values[f.name], types[f.name])
        sections[section] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def load_yaml(path: str) -> dict:
    """Reads a YAML config file; a missing or malformed file is a UsageError."""
    import yaml

    if os.path.isdir(path):
        saved = os.path.join(path, "config.yaml")  # a run's output directory holds its resolved config
        hint = f", such as {saved!r}" if os.path.isfile(saved) else ""
        raise UsageError(f"config path {path!r} is a directory; --config expects a YAML file{hint}")
    if not os.path.isfile(path):
        raise UsageError(f"config file {path!r} does not exist; pass an existing YAML file to --config")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UsageError(f"config file {path!r} is not valid YAML{where}; fix its syntax") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"config file {path!r} is not UTF-8 text (byte {exc.start}); pass a YAML file") from None
    return raw or {}


def parse_override(text: str) -> tuple:
    """Parses one ``--set section.key=value`` (value read as YAML: numbers, lists, null)."""
    import yaml

    if "=" not in text:
        raise UsageError(f"--set expects key=value (e.g. train.lr=1e-3), got {text!r}")
    key, value = text.split("=", 1)
    section, name = resolve_key(key)
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    return section, name, parsed


def preset_dict(name: str) -> dict:
    """The merged mapping (dataclass defaults <- preset) for preset ``name``.

    Raises:
        UsageError: unknown preset.
    """
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    raw = Config().to_dict()
    for section, values in PRESETS[name].items():
        raw[section].update(copy.deepcopy(values))
    return raw


# model.* keys that shape a model built from model.arch; a model directory's config.json decides them instead
MODEL_SHAPE_KEYS = ("arch", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                    "pad_vocab_to_multiple_of", "max_position_embeddings", "tie_word_embeddings", "extra")


def build_config(
    config_path: Optional[str] = None,
    preset: str = "default",
    overrides: Optional[list] = None,
    base: Optional[dict] = None,
) -> Config:
    """Preset defaults <- YAML file <- overrides (``[(section, key, value), ...]``), checked.

    Args:
        base: a configuration mapping used instead of the preset (a checkpoint's configuration,
            for ``--resume``); keys it lacks keep their defaults.

    Raises:
        UsageError: unknown section/key, a value of the wrong type or out of range.
    """
    if base is not None:
        raw = merge(Config().to_dict(), base, where="the checkpoint's configuration")
    else:
        raw = preset_dict(preset)
    if config_path is not None:
        raw = merge(raw, load_yaml(config_path), where=repr(config_path))
    for section, name, value in overrides or []:
        raw[section][name] = value
    shape = [name for section, name, _ in overrides or [] if section == "model" and name in MODEL_SHAPE_KEYS]
    if shape and raw["model"].get("path") is not None:  # it would be ignored: the directory's config.json decides
        raise UsageError(f"--set model.{shape[0]}=... has no effect on a model loaded from a directory "
                         f"({raw['model']['path']!r}: its config.json decides the shape); drop it, or build a new model "
                         "from an architecture name (--model llama) instead of a directory")
    return from_dict(raw)


def to_yaml(cfg: Config, printed: bool = False) -> str:
    """``cfg`` as YAML (a run's ``config.yaml``). ``printed``: for ``--print-config``, where with a model
    directory the model.* shape keys (:data:`MODEL_SHAPE_KEYS`, unused: its config.json decides them) are left
    out and a first comment line says so."""
    import yaml

    d, head = cfg.to_dict(), ""
    if printed and d["model"].get("path") is not None:
        d["model"] = {k: v for k, v in d["model"].items() if k not in MODEL_SHAPE_KEYS}
        head = f"# model.{{{','.join(MODEL_SHAPE_KEYS)}}}: from {d['model']['path']}/config.json\n"
    return head + yaml.safe_dump(d, sort_keys=False)
