"""`megatrain train --dry-run` and the CLI's streamed model building: the estimate is printed and
nothing is written; a model that does not fit is refused in one line before anything large is
allocated; building through megatrain.from_config / from_pretrained trains exactly as building the
model in memory and wrapping it did."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

_PY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if _PY not in sys.path:
    sys.path.insert(0, _PY)

megatrain = pytest.importorskip("megatrain", reason="megatrain (with its compiled extension) is not importable")
from megatrain.cli import main  # noqa: E402
from parity import run_cli  # noqa: E402
from megatrain.train import model_build, run_plan  # noqa: E402
from megatrain.train.config_build import build_config  # noqa: E402

TINY = ["--set", "model.hidden_size=64", "--set", "model.num_layers=2", "--set", "model.num_heads=2",
        "--set", "model.num_kv_heads=1", "--set", "model.intermediate_size=192", "--set", "data.max_documents=200",
        "--set", "eval.batches=2", "--set", "train.warmup_steps=2", "--seq-len", "64", "--no-progress",
        "--device", "cpu", "--compute-dtype", "fp32"]  # fmt: skip


def _without_model_keys(argv: list) -> list:
    """``argv`` without its ``--set model.*`` pairs (a model directory's config.json decides those)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--set" and argv[i + 1].startswith("model."):
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


HUGE = ["--set", "model.hidden_size=32768", "--set", "model.num_layers=64", "--set", "model.num_heads=256",
        "--set", "model.num_kv_heads=256", "--set", "model.intermediate_size=65536"]  # fmt: skip


_run_main = run_cli  # (exit code, stdout, stderr) of megatrain.cli.main(argv)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (d / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 40)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=320, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_dry_run_prints_the_estimate_and_writes_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    code, stdout, err = _run_main(["train", "--dry-run", "--out", str(out), "--data", str(corpus), *TINY], capsys)
    assert code == 0, err
    for word in ("compute copy", "master (fp32)", "exp_avg (fp32)", "exp_avg_sq (fp32)", "grad accumulator",
                 "gradient staging", "pinned", "layer slots", "resident unit", "activations", "fits this machine"):
        assert word in stdout, word
    assert not out.exists()


@pytest.mark.parametrize("source", ["arch", "model_dir"])
@pytest.mark.parametrize("gas", [1, 2])
def test_dry_run_estimate_equals_the_store_the_run_builds(tmp_path, corpus, model_dir, source, gas):
    overrides = [("log", "out", str(tmp_path / "out")), ("data", "path", str(corpus)), ("runtime", "device", "cpu"),
                 ("train", "gradient_accumulation_steps", gas), ("data", "seq_len", 32)]
    if source == "model_dir":
        overrides.append(("model", "path", str(model_dir)))
    cfg = build_config(overrides=overrides)
    plan = run_plan.prepare(cfg, dry_run=True)
    est = plan.estimate
    model = model_build.build_wrapped_model(plan)
    megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=gas)
    eng = model.megatrain
    assert est.host_sections == dict(eng.store.section_bytes)
    assert est.store_bytes == eng.store.total_bytes
    assert est.accumulator_bytes == eng.accumulator_bytes() and (est.accumulator_bytes > 0) == (gas > 1)
    assert not (tmp_path / "out").exists()


def _measured(argv, cwd):
    """Runs ``python -m megatrain ARGV`` from a fresh parent: (returncode, stdout, stderr, seconds, peak RSS bytes)."""
    probe = (
        "import json, resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run([sys.executable, '-m', 'megatrain', *sys.argv[1:]], capture_output=True, text=True)\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps(dict(rc=p.returncode, out=p.stdout, err=p.stderr, s=dt, rss=rss)))\n"
    )
    env = dict(os.environ, PYTHONPATH=_PY + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", None)
    res = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                         timeout=300)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return r["rc"], r["out"], r["err"], r["s"], r["rss"]


@pytest.mark.parametrize("dry", [True, False], ids=["dry_run", "real_run"])
def test_a_huge_model_is_refused_in_one_line_without_allocating(tmp_path, corpus, dry):
    """hidden 32768 x 64 layers (687B parameters, ~10 TiB of store): exit 2 with the reason, out not
    created, and the process never holds more than a small interpreter's memory."""
    out = tmp_path / "out"
    argv = ["train", *(["--dry-run"] if dry else []), "--out", str(out), "--data", str(corpus), *TINY, *HUGE]
    t = time.perf_counter()
    code, stdout, err, seconds, rss = _measured(argv, tmp_path)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    assert "does not fit this machine" in lines[0] and "of host memory but only" in lines[0], lines[0]
    assert "Traceback" not in err
    assert not out.exists()
    if dry:
        assert "DOES NOT FIT" in stdout and "store total" in stdout
    assert rss < 2 * 2**30, f"peak RSS {rss / 2**30:.2f} GiB: something large was allocated"
    assert seconds < 60, seconds  # interpreter + torch + transformers imports on a loaded 2-core machine
    assert time.perf_counter() - t < 120


def _losses(out):
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r["kind"] == "train"], [r["eval_loss"] for r in recs if r["kind"] == "eval"]


def _in_memory_then_wrap(plan):
    """How the CLI built models before the streamed path: the whole model in memory, then wrap."""
    return megatrain.wrap(model_build.build_model(plan), device=plan.device, compute_dtype=plan.compute_dtype,
                          activation_policy=plan.cfg.runtime.activation_policy)


@pytest.mark.parametrize("source", ["arch", "model_dir"])
def test_streamed_building_trains_bit_identically_to_building_in_memory(tmp_path, corpus, model_dir, monkeypatch,
                                                                        capsys, source):
    tiny = TINY if source == "arch" else _without_model_keys(TINY)  # a model dir's config.json gives its shape
    argv = ["--steps", "4", "--log-every", "1", "--eval-every", "2", "--micro-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--data", str(corpus), *tiny, "--seq-len", "32"]  # fmt: skip
    if source == "model_dir":
        argv += ["--model", str(model_dir)]
    streamed = tmp_path / "streamed"
    assert main(["train", "--out", str(streamed), *argv]) == 0
    with monkeypatch.context() as m:
        m.setattr(model_build, "build_wrapped_model", _in_memory_then_wrap)
        before = tmp_path / "in_memory"
        assert main(["train", "--out", str(before), *argv]) == 0
    capsys.readouterr()
    a, b = _losses(streamed), _losses(before)
    assert len(a[0]) == 4 and len(a[1]) == 3
    assert a == b  # every step's loss and every eval loss, bit for bit


@pytest.mark.parametrize("flags,expect", [
    ([], "long context: loss over chunks of"),
    (["--chunked-loss", "false", "--tile-mlp", "4096"],
     "long context: full logits (chunked_loss=false); MLP over tiles of 4,096 rows, norms over tiles of 4,096 rows "
     "(tile_mlp=4096)"),
])
def test_dry_run_at_512k_tokens_says_how_the_loss_and_mlp_are_split(tmp_path, capsys, monkeypatch, flags, expect):
    """The dry run prints how the loss and the MLP are split; on the CPU device the 8 x 524288 tokens'
    activations (~60 GiB) live in host memory too, so a 24 GiB host refuses the run, saying what to lower."""
    from megatrain.runtime.placement import host_memory

    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: dict(
        mem_available_bytes=24 << 30, cgroup_limit_bytes=None, cgroup_usage_bytes=None, memlock_bytes=None,
        cgroup_path=None))
    out = tmp_path / "out"
    code, stdout, err = _run_main(["train", "--dry-run", "--out", str(out), "--seq-len", "524288", "--set",
                                   "model.max_position_embeddings=524288", "--device", "cpu", *flags], capsys)
    assert code != 0 and "of host memory for the CPU device's slots and activations" in err, err
    assert "lower micro_batch_size or seq_len" in err and "\n" not in err.strip(), err
    assert "8 x 524288 tokens" in stdout and expect in stdout, stdout
    if not flags:
        assert "(chunked_loss=auto); MLP over tiles of" in stdout and "(tile_mlp=auto)" in stdout
    assert not out.exists()


def test_chunked_loss_and_tile_mlp_keys_reach_the_model_and_train_like_the_untiled_run(tmp_path, corpus, capsys):
    argv = ["--steps", "3", "--log-every", "1", "--eval-every", "3", "--micro-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--data", str(corpus), *TINY, "--seq-len", "32"]  # fmt: skip
    assert main(["train", "--out", str(tmp_path / "untiled"), *argv, "--chunked-loss", "false",
                 "--tile-mlp", "false"]) == 0
    assert main(["train", "--out", str(tmp_path / "tiled"), *argv, "--chunked-loss", "5",
                 "--set", "runtime.tile_mlp=7"]) == 0
    capsys.readouterr()
    (a_train, a_eval), (b_train, b_eval) = _losses(tmp_path / "tiled"), _losses(tmp_path / "untiled")
    assert len(a_train) == 3 and len(a_eval) == 2
    for a, b in zip(a_train + a_eval, b_train + b_eval):
        assert abs(a - b) <= 1e-6 * abs(b), (a_train, b_train)
    saved = (tmp_path / "tiled" / "config.yaml").read_text()
    assert "chunked_loss: '5'" in saved and "tile_mlp: '7'" in saved
    used = json.loads((tmp_path / "tiled" / "summary.json").read_text())["long_context"]
    assert (used["chunked_loss"], used["tile_mlp"], used["loss_rows"], used["mlp_rows"]) == ("5", "7", 5, 7)
    used = json.loads((tmp_path / "untiled" / "summary.json").read_text())["long_context"]
    assert (used["loss_rows"], used["mlp_rows"]) == (None, None)


def test_bad_chunked_loss_value_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = _run_main(["train", "--out", str(out), "--chunked-loss", "sometimes"], capsys)
    assert code == 2 and not out.exists()
    assert err.strip().splitlines() == [
        "megatrain: error: runtime.chunked_loss must be auto, true, false or a positive number of rows, got 'sometimes'"]


def _config_only_dir(path, **sizes):
    from transformers import LlamaConfig

    LlamaConfig(**sizes).save_pretrained(str(path))
    assert os.listdir(path) == ["config.json"]
    return path


def test_dry_run_estimates_a_model_directory_holding_only_config_json(tmp_path, corpus, capsys):
    """Before downloading the weights: --dry-run --model DIR with config.json alone prints the estimate
    (exit 0 when it fits); the real run still refuses the directory, pointing at --dry-run."""
    model = _config_only_dir(tmp_path / "cfg", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, intermediate_size=64, vocab_size=320, max_position_embeddings=64)
    out = tmp_path / "out"
    argv = ["train", "--model", str(model), "--out", str(out), "--data", str(corpus),
            *_without_model_keys(TINY), "--seq-len", "32"]
    code, stdout, err = _run_main([*argv, "--dry-run"], capsys)
    assert code == 0, err
    assert "LlamaForCausalLM" in stdout and "fits this machine" in stdout and "on this CPU" in stdout
    assert f"note: {str(model)!r} holds no weights (estimated from its config.json alone): the real run needs them" in stdout
    assert f"the run would train on: data {str(corpus)!r}" in stdout
    assert not out.exists()
    code, _, err = _run_main(argv, capsys)
    assert code == 2 and "has no weights" in err and "--dry-run estimates the memory from config.json alone" in err
    assert not out.exists()


def test_dry_run_of_a_70b_config_on_the_cpu_suggests_only_what_would_fit(tmp_path, corpus, capsys, monkeypatch):
    """A Llama-3-70B config.json on a CPU with 24 GiB: refused in one line that names no GPU, does not
    suggest offload_dir (the 280 GB of fp32 compute copies stay in RAM) or LoRA, and plans no
    "chunks of 1 rows"."""
    from megatrain.runtime.placement import host_memory

    monkeypatch.delenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK", raising=False)
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: dict(
        mem_available_bytes=24 << 30, cgroup_limit_bytes=None, cgroup_usage_bytes=None, memlock_bytes=None,
        cgroup_path=None))
    model = _config_only_dir(tmp_path / "llama70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                             max_position_embeddings=8192)
    out = tmp_path / "out"
    code, stdout, err = _run_main(["train", "--dry-run", "--model", str(model), "--out", str(out), "--data",
                                   str(corpus), "--device", "cpu", "--seq-len", "512", "--micro-batch-size", "2", "--no-progress"], capsys)
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("megatrain: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    line = errors[0]
    assert "70.55B parameters" in line and "of host memory but only" in line, line
    assert "offload_dir" not in line and "LoRA" not in line and "GPU" not in line, line
    assert "smaller model" in line
    assert "on this CPU" in stdout and "chunks of 1 rows" not in stdout and "tiles of 1 rows" not in stdout
    assert not out.exists()


def test_the_run_wraps_with_its_batch_and_estimates_the_same_one():
    """``megatrain train`` gives wrap its batch (train.micro_batch_size x data.seq_len), the one ``--dry-run``
    estimates, so the capacity share of exclusive device-state layers keeps that batch's activation estimate."""
    from megatrain.train.wrap_args import estimate_kwargs, wrap_options

    cfg = build_config(overrides=[("train", "micro_batch_size", 3), ("data", "seq_len", 96)])
    kw = wrap_options(cfg, torch.device("cpu"), torch.float32).as_kwargs()  # what model_build passes to wrap
    assert kw["micro_batch_size"] == 3 and kw["seq_len"] == 96
    assert "micro_batch_size" not in estimate_kwargs(wrap_options(cfg, torch.device("cpu"), torch.float32))
