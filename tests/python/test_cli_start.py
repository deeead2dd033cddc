"""`megatrain train` at its start and its end: one memory rule for --dry-run and the real run,
checked before anything is written; a run that cannot start leaves --out as it found it; messages
that name the real cause (a non-finite weight, a full disk, a signal after the final model's swap,
a model.extra key the config consumes)."""

from __future__ import annotations

import errno
import json
import os
import signal
import sys

import pytest
import torch

_PY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if _PY not in sys.path:
    sys.path.insert(0, _PY)

megatrain = pytest.importorskip("megatrain", reason="megatrain (with its compiled extension) is not importable")
from megatrain.runtime.placement import host_memory
from megatrain.train import final_model, model_build, run_files  # noqa: E402
from parity import run_cli  # noqa: E402

MARGIN = 1 << 30  # megatrain.runtime.placement.estimate.RUN_HOST_MARGIN_BYTES, as docs/cli.md states it

# The activation estimate does not depend on the free memory with these (no auto choice): a rule at a byte.
F = ["--steps", "2", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress", "--device", "cpu",
     "--activation-policy", "recompute", "--chunked-loss", "false", "--tile-mlp", "false", "--set", "eval.batches=1",
     "--set", "model.hidden_size=32", "--set", "model.num_layers=2", "--set", "model.num_heads=2",
     "--set", "model.intermediate_size=64"]  # fmt: skip


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d. " % i) * 30)
    return d


def _one_line(code, err, fragment):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: ") and fragment in lines[0], err
    return lines[0]


def _limits(mem_available):
    return dict(mem_available_bytes=mem_available, cgroup_limit_bytes=None, cgroup_usage_bytes=None,
                memlock_bytes=None, cgroup_path=None)


def _tiny_model_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


# ---------------------------------------------------------------------------- the memory rule
def test_dry_run_and_run_refuse_alike_unless_store_activations_and_margin_fit(tmp_path, corpus, capsys, monkeypatch):
    """The real run used to check the host store alone: with memory for the store but not for the
    CPU device's slots and activations, nor the margin, it started (and on a real machine was killed
    by the kernel). Now both refuse it in one line naming the margin, and --out stays as it was."""
    seen = []
    real_estimate = megatrain.estimate
    monkeypatch.setattr(megatrain, "estimate", lambda *a, **k: seen.append(real_estimate(*a, **k)) or seen[-1])
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(1 << 40))
    out = tmp_path / "out"
    out.mkdir()  # an empty directory the user made: it stays, empty
    args = ["train", "--out", str(out), "--data", str(corpus), *F]
    code, _, err = run_cli(args + ["--dry-run"], capsys)
    assert code == 0, err
    est = seen[-1]
    assert est.gpu_bytes > 0
    need = est.host_bytes + est.gpu_bytes + MARGIN  # store, staging, slots, activations, margin

    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(need - 1))
    for extra in (["--dry-run"], []):
        code, _, err = run_cli(args + extra, capsys)
        line = _one_line(code, err, "of host memory for the CPU device's slots and activations")
        assert "and the 1.00 GiB margin" in line, line
        assert os.listdir(out) == [], "nothing is written before the check"

    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(need - est.gpu_bytes))  # the store fits
    code, _, err = run_cli(args, capsys)
    _one_line(code, err, "of host memory for the CPU device's slots and activations")
    assert os.listdir(out) == []

    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(need))
    code, stdout, err = run_cli(args + ["--dry-run"], capsys)
    assert code == 0 and "(with a 1.00 GiB margin kept free): fits" in stdout, (stdout, err)
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    assert json.load(open(out / "summary.json"))["status"] == "completed"
    from megatrain.runtime.placement.estimate import RUN_HOST_MARGIN_BYTES

    assert est.host_margin_bytes == RUN_HOST_MARGIN_BYTES == MARGIN


def test_store_and_margin_over_the_available_memory_is_one_line(tmp_path, corpus, capsys, monkeypatch):
    seen = []
    real_estimate = megatrain.estimate
    monkeypatch.setattr(megatrain, "estimate", lambda *a, **k: seen.append(real_estimate(*a, **k)) or seen[-1])
    args = ["train", "--out", str(tmp_path / "out"), "--data", str(corpus), *F]
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(1 << 40))
    assert run_cli(args + ["--dry-run"], capsys)[0] == 0
    monkeypatch.setattr(host_memory, "host_memory_limits", lambda: _limits(seen[-1].host_bytes + (1 << 20)))
    code, _, err = run_cli(args, capsys)
    _one_line(code, err, " + 1.00 GiB margin of host memory but only ")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- a full disk
class _FullDisk:
    """A file whose writes fail as on a full disk (the file itself was created, as open() does)."""

    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self):
        pass

    def fileno(self):
        return self.f.fileno()


@pytest.mark.parametrize("existed", [False, True], ids=["new_out", "empty_out"])
def test_disk_full_at_start_leaves_out_as_it_was_and_the_rerun_starts(tmp_path, corpus, capsys, monkeypatch, existed):
    out = tmp_path / "runs" / "a"
    if existed:
        out.mkdir(parents=True)
    args = ["train", "--out", str(out), "--data", str(corpus), *F]

    def full_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        return _FullDisk(f) if "w" in mode and os.path.basename(path).startswith("config.yaml") else f

    with monkeypatch.context() as m:
        m.setattr(run_files, "open", full_open, raising=False)
        code, _, err = run_cli(args, capsys)
    line = _one_line(code, err, f"cannot write '{out / 'config.yaml'}': No space left on device; free disk space or "
                                "choose another --out")
    assert line.endswith(f"({out} is left as it was)") and "intact" not in line, line
    if existed:
        assert os.listdir(out) == []
    else:
        assert not (tmp_path / "runs").exists(), "the directories the run created are gone again"
    code, _, err = run_cli(args, capsys)  # space freed: the same command is not refused as "not empty"
    assert code == 0, err


def test_disk_full_in_the_final_save_says_intact_only_when_a_model_is_there(tmp_path, corpus, capsys, monkeypatch):
    import megatrain.state.checkpoint
    import megatrain.state.export

    out = tmp_path / "out"
    args = ["train", "--out", str(out), "--data", str(corpus), *F]

    def full_save(model, d, dtype=None):
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(d, "model.safetensors"))

    with monkeypatch.context() as m:
        m.setattr(megatrain.state.export, "save_pretrained_streamed", full_save)
        code, _, err = run_cli(args, capsys)
    line = _one_line(code, err, "No space left on device; free disk space or choose another --out")
    assert "intact" not in line and not (out / "model").exists(), line
    assert run_cli(args + ["--set", "log.overwrite=true"], capsys)[0] == 0
    with monkeypatch.context() as m:
        m.setattr(megatrain.state.export, "save_pretrained_streamed", full_save)
        code, _, err = run_cli(args + ["--set", "log.overwrite=true"], capsys)
    line = _one_line(code, err, "No space left on device")
    assert line.endswith(f"(the model in {out / 'model'} is intact)"), line
    assert final_model.is_train_model_dir(str(out / "model"))


# ---------------------------------------------------------------------------- a non-finite weight
def test_model_dir_with_a_nan_weight_names_the_tensor_and_file(tmp_path, corpus, capsys):
    from safetensors.torch import load_file, save_file

    base = _tiny_model_dir(tmp_path / "base")
    sd = load_file(base / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, base / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--model", str(base), "--out", str(out), "--data", str(corpus), "--tokenizer", "byte", *F[:-8]], capsys)
    line = _one_line(code, err, f"tensor model.layers.1.mlp.up_proj.weight in {base / 'model.safetensors'} holds 1 "
                                "non-finite value(s) (NaN or inf) of 2048")
    assert "not causal" not in line
    assert not out.exists()


def test_count_nonfinite_counts_across_chunks():
    from megatrain.state.loading import count_nonfinite

    t = torch.zeros(10, 7, dtype=torch.bfloat16)
    t[0, 0], t[9, 6], t[4, 2] = float("nan"), float("inf"), -float("inf")
    assert count_nonfinite(t, chunk_numel=8) == 3 and count_nonfinite(torch.ones(5)) == 0


# ---------------------------------------------------------------------------- a signal after the final swap
def test_sigint_just_after_the_final_model_swap_completes_the_run(tmp_path, corpus, capsys, monkeypatch):
    """The signal arrives between the swap that puts the new model in place and the end of the run
    (injected right after the swap's fsync of out/): the model is saved, so the run is complete."""
    import megatrain.state.atomic

    out = tmp_path / "out"
    real_fsync = megatrain.state.atomic._fsync
    sent = []

    def fsync_then_signal(path):
        real_fsync(path)
        if os.path.abspath(path) == str(out) and os.path.isdir(out / "model") and not sent:
            sent.append(path)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(megatrain.state.atomic, "_fsync", fsync_then_signal)
    code, stdout, err = run_cli(["train", "--out", str(out), "--data", str(corpus), *F], capsys)
    assert sent, "the swap happened"
    assert code == 0, err
    assert f"SIGINT arrived after the final model was saved to {out / 'model'}; the run is complete" in stdout
    assert "no model was saved" not in err
    summary = json.load(open(out / "summary.json"))
    assert summary["status"] == "completed" and summary["model_dir"] == str(out / "model")
    assert final_model.is_train_model_dir(str(out / "model"))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---------------------------------------------------------------------------- model.extra keys
def test_a_model_extra_key_the_config_consumes_is_not_warned_as_unread(capsys):
    from megatrain.train.config_build import build_config

    cfg = build_config(overrides=[("model", "extra", {"rope_theta": 500000.0, "hiden_act": "gelu"})])
    config = model_build.load_model_config(cfg, 257, 256)
    err = capsys.readouterr().err
    assert "rope_theta" not in err, err
    assert "'hiden_act' are not attributes of LlamaConfig" in err, err  # a typo still is
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    assert theta == 500000.0


def test_a_bad_model_extra_value_names_the_key(tmp_path, corpus, capsys):
    code, _, err = run_cli(["train", "--out", str(tmp_path / "out"), "--data", str(corpus), *F, "--set",
                            "model.extra={rope_theta: abc}"], capsys)
    line = _one_line(code, err, "cannot build a model from this config")
    assert line.endswith("check the model sizes and model.extra (rope_theta='abc')"), line
    assert "rope_theta" not in line.split("error:")[0]
    assert not (tmp_path / "out").exists()


def test_single_document_banner_says_its_tail_is_held_out(tmp_path, capsys):
    """One text file of one document: the banner said "1 documents (0 held out)" although its tail is held out
    for evaluation (megatrain.train.data.load_text_data)."""
    text = tmp_path / "one.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    code, out, err = run_cli(["train", "--out", str(tmp_path / "out"), "--data", str(text), *F], capsys)
    assert code == 0, err
    assert "1 document (its last 5% of tokens held out)" in out + err, out + err
    assert "documents (0 held out)" not in out + err
    assert os.path.isdir(tmp_path / "out" / "model")
