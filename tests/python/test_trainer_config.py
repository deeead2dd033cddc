"""megatrain.train.config: defaults, YAML/flag conversion, unknown keys, range checks, LR schedule."""

import math
import os

import pytest

import megatrain.train.config as config
import megatrain.train.config_build as config_build
UsageError = config.UsageError


def test_default_config_is_the_documented_default():
    cfg = config_build.build_config()
    assert cfg.data.path == "stdlib" and cfg.data.tokenizer is None
    assert cfg.model.arch == "llama" and cfg.model.path is None
    assert cfg.runtime.compute_dtype == "auto" and cfg.runtime.activation_policy is None
    assert cfg.data.seq_len <= cfg.model.max_position_embeddings


def test_yaml_file_then_overrides_take_precedence(tmp_path):
    path = tmp_path / "c.yaml"
    # YAML 1.1 reads 3e-4 (no dot) as a string; the trainer must still take it as a number.
    path.write_text("train:\n  lr: 3e-4\n  steps: 7\nmodel:\n  num_layers: 3\n")
    cfg = config_build.build_config(str(path), overrides=[("train", "steps", "11")])
    assert cfg.train.lr == pytest.approx(3e-4)
    assert cfg.train.steps == 11
    assert cfg.model.num_layers == 3


def test_gpu_preset_differs_from_default():
    assert config_build.build_config(preset="gpu").model.num_layers > config_build.build_config().model.num_layers
    with pytest.raises(UsageError, match="unknown preset"):
        config_build.build_config(preset="huge")


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        ("train:\n  learning_rate: 1.0\n", "unknown config key 'train.learning_rate'"),
        ("optimizer:\n  lr: 1.0\n", "unknown config section 'optimizer'"),
        ("train:\n  lr: abc\n", "train.lr must be a number, got 'abc'"),
        ("train:\n  steps: 1.5\n", "train.steps must be an integer"),
        ("train:\n  steps: 0\n", "train.steps must be > 0"),
        ("train: [1, 2]\n", "must be a mapping"),
        ("data:\n  eval_fraction: 1.0\n", "data.eval_fraction must be between 0 and 1"),
        ("data:\n  seq_len: 4096\n", "above the model's limit max_position_embeddings"),
        ("runtime:\n  activation_policy: block:0\n",
         "runtime.activation_policy must be 'recompute', 'store', 'auto', 'offload' or 'block:K' (K >= 1), got 'block:0'"),
        ("runtime:\n  compute_dtype: fp16\n", "compute_dtype must be auto, bf16 or fp32"),
        ("model:\n  hidden_size: 100\n  num_heads: 3\n", "divisible by model.num_heads"),
        ("train:\n  warmup_steps: -1\n", "train.warmup_steps must be >= 0"),
        ("log:\n  progress: maybe\n", "log.progress must be true or false"),
        ("train:\n  lr: .nan\n", "train.lr must be a finite number"),
        ("train:\n  lr: [\n", "is not valid YAML"),
    ],
)
def test_bad_config_file_is_one_line_usage_error(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(UsageError) as info:
        config_build.build_config(str(path))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_set_override_accepts_dotted_and_unambiguous_bare_keys():
    section, key, value = config_build.parse_override("train.lr=1e-3")
    assert (section, key) == ("train", "lr")
    assert config_build.build_config(overrides=[(section, key, value)]).train.lr == 1e-3
    assert config_build.parse_override("warmup_steps=5") == ("train", "warmup_steps", 5)
    assert config_build.parse_override("data.max_documents=null") == ("data", "max_documents", None)
    with pytest.raises(UsageError, match="ambiguous"):
        config_build.parse_override("every=5")  # eval.every and log.every
    with pytest.raises(UsageError, match="unknown config key 'train.nope'"):
        config_build.parse_override("train.nope=1")
    with pytest.raises(UsageError, match="key=value"):
        config_build.parse_override("train.lr")


def test_missing_config_file_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        config_build.build_config(str(tmp_path / "nope.yaml"))


def test_config_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(UsageError) as info:
        config_build.build_config(str(tmp_path))
    assert str(info.value) == f"config path {str(tmp_path)!r} is a directory; --config expects a YAML file"
    # a run's output directory: point at the resolved config it holds
    (tmp_path / "config.yaml").write_text("train:\n  steps: 3\n")
    with pytest.raises(UsageError, match="is a directory; --config expects a YAML file, such as .*config.yaml"):
        config_build.build_config(str(tmp_path))


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))


@pytest.mark.parametrize("policy", ["recompute", "store", "auto", "block:1", "block:3", "block:0", "block:",
                                    "block:-1", "offload", "Offload", "Recompute", "store\n", ""])
def test_activation_policy_accepted_exactly_when_wrap_accepts_it(policy):
    """runtime.activation_policy follows megatrain.wrap's own rule (auto included), with wrap's message;
    an empty value is the key's default (None: wrap's default), as for every optional key."""
    import megatrain

    if policy == "":
        assert config_build.build_config(overrides=[("runtime", "activation_policy", "")]).runtime.activation_policy is None
        return

    try:
        megatrain.wrap(_tiny_llama(), device="cpu", activation_policy=policy)
        wrap_error = None
    except ValueError as exc:
        wrap_error = str(exc)
    if wrap_error is None:
        assert config_build.build_config(overrides=[("runtime", "activation_policy", policy)]).runtime.activation_policy == policy
    else:
        with pytest.raises(UsageError) as info:
            config_build.build_config(overrides=[("runtime", "activation_policy", policy)])
        assert str(info.value) == wrap_error.replace("megatrain.wrap: activation_policy", "runtime.activation_policy")
    assert (wrap_error is None) == (policy in ("recompute", "store", "auto", "offload", "block:1", "block:3"))


def test_lr_schedule_warms_up_linearly_then_decays_to_min_ratio():
    from megatrain.train.trainer import lr_lambda

    cfg = config_build.build_config(
        overrides=[("train", "steps", 100), ("train", "warmup_steps", 10), ("train", "min_lr_ratio", 0.1)]
    )
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1)  # first step runs at lr / warmup_steps, never at 0
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(100) == pytest.approx(0.1)
    cfg.train.lr_schedule = "linear"
    assert lr_lambda(cfg)(55) == pytest.approx(0.1 + 0.9 * 0.5)
    cfg.train.lr_schedule = "constant"
    assert lr_lambda(cfg)(99) == 1.0


def test_print_config_round_trips_through_yaml(tmp_path):
    cfg = config_build.build_config(overrides=[("model", "num_layers", 3), ("train", "lr", "2e-3")])
    path = tmp_path / "resolved.yaml"
    path.write_text(config_build.to_yaml(cfg))
    assert config_build.build_config(str(path)) == cfg


def test_example_configs_parse_and_default_yaml_is_the_default():
    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "configs")
    names = sorted(n for n in os.listdir(root) if n.endswith(".yaml"))
    assert "default.yaml" in names
    for name in names:
        config_build.build_config(os.path.join(root, name))
    assert config_build.build_config(os.path.join(root, "default.yaml")) == config_build.build_config()
    import dataclasses

    import yaml

    with open(os.path.join(root, "default.yaml")) as f:
        listed = yaml.safe_load(f)
    for f in dataclasses.fields(config.Config):  # docs/cli.md: default.yaml lists every key
        want = {g.name for g in dataclasses.fields(getattr(config_build.build_config(), f.name))}
        assert set(listed[f.name]) == want, (f.name, want ^ set(listed[f.name]))
    gpu = config_build.build_config(os.path.join(root, "gpu_llama_76m.yaml"))
    preset = config_build.build_config(preset="gpu")
    assert gpu == preset  # "the --preset gpu run as a file": every section
    one_b = config_build.build_config(os.path.join(root, "h200_1b.yaml"))
    assert one_b == config_build.build_config(preset="1b")


@pytest.mark.parametrize("key", ["chunked_loss", "tile_mlp"])
@pytest.mark.parametrize("value,stored,for_wrap", [
    ("auto", "auto", "auto"), (True, "true", True), (False, "false", False), ("TRUE", "true", True),
    (" false ", "false", False), (64, "64", 64), ("1_024", "1024", 1024), ("1", "1", 1),
])
def test_chunked_loss_and_tile_mlp_keys(key, value, stored, for_wrap):
    cfg = config_build.build_config(overrides=[("runtime", key, value)])
    assert getattr(cfg.runtime, key) == stored and type(getattr(cfg.runtime, key)) is str  # safe_dump-able
    got = config.wrap_rows_mode(getattr(cfg.runtime, key))
    assert got == for_wrap and type(got) is type(for_wrap)
    assert f"{key}: " in config_build.to_yaml(cfg)


@pytest.mark.parametrize("key", ["chunked_loss", "tile_mlp"])
@pytest.mark.parametrize("value", [0, -3, 2.5, "sometimes", "", None, [4]])
def test_bad_chunked_loss_and_tile_mlp_values_are_one_line(key, value):
    with pytest.raises(UsageError) as info:
        config_build.build_config(overrides=[("runtime", key, value)])
    assert str(info.value).startswith(f"runtime.{key} must be auto, true, false or a positive number of rows, got ")


def test_chunked_loss_and_tile_mlp_default_to_auto_and_read_from_yaml(tmp_path):
    assert (config.RuntimeConfig().chunked_loss, config.RuntimeConfig().tile_mlp) == ("auto", "auto")
    path = tmp_path / "c.yaml"
    path.write_text("runtime:\n  chunked_loss: true\n  tile_mlp: 4096\n")
    cfg = config_build.build_config(config_path=str(path))
    assert (cfg.runtime.chunked_loss, cfg.runtime.tile_mlp) == ("true", "4096")
