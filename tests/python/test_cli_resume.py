"""`megatrain train` checkpoints and `--resume`: a run stopped by SIGTERM (or resumed from a periodic
checkpoint) continues exactly: on the CPU in fp32 every step's loss and gradient norm, every eval
loss and the final weights are bit-identical to the uninterrupted run's."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

_PY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if _PY not in sys.path:
    sys.path.insert(0, _PY)

megatrain = pytest.importorskip("megatrain", reason="megatrain (with its compiled extension) is not importable")
# Imported now, not first inside a test: transformers' log handler keeps the sys.stderr of its first
# import, and a test's captured stderr is closed after the test.
pytest.importorskip("transformers")
from megatrain.cli import main  # noqa: E402

# A tiny variant of the default recipe (cosine schedule with warmup, clipping, weight decay), with
# gradient accumulation so that the data position is more than the step count.
TINY = [
    "--set", "model.hidden_size=64", "--set", "model.num_layers=2", "--set", "model.num_heads=2",
    "--set", "model.num_kv_heads=1", "--set", "model.intermediate_size=192",
    "--set", "data.max_documents=120", "--set", "eval.batches=2", "--set", "train.warmup_steps=5",
    "--seq-len", "64", "--micro-batch-size", "4", "--gradient-accumulation-steps", "2",
    "--device", "cpu", "--no-progress", "--set", "log.tensorboard=false", "--set", "log.save_model=false",
]  # fmt: skip


def _records(out, kind="train"):
    """Per step, the newest record of ``kind`` in out/metrics.jsonl (a resumed run appends)."""
    by_step = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec["kind"] == kind:
                by_step[rec["step"]] = rec
    return by_step


def _last_step(out) -> int:
    """The newest train step in out/metrics.jsonl while it is being written (0 if none yet)."""
    try:
        text = (out / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    steps = [0]
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # the line being written
            continue
        if rec["kind"] == "train":
            steps.append(rec["step"])
    return max(steps)


def _state(out):
    """The fp32 master weights and Adam moments of the run's newest checkpoint, per tensor name."""
    from safetensors.torch import load_file

    ckpts = sorted(os.listdir(os.path.join(out, "checkpoints")))
    path = os.path.join(out, "checkpoints", ckpts[-1])
    tensors = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    return ckpts[-1], tensors


def _assert_same_run(got, want, steps):
    g, w = _records(got), _records(want)
    assert sorted(w) == list(range(1, steps + 1)) and sorted(g) == sorted(w)
    for step in w:  # exact float equality: the same computation in the same order
        assert (g[step]["loss"], g[step]["grad_norm"], g[step]["lr"]) == (
            w[step]["loss"], w[step]["grad_norm"], w[step]["lr"]), f"step {step}"
    ge, we = _records(got, "eval"), _records(want, "eval")
    assert ge.keys() == we.keys() and all(ge[s]["eval_loss"] == we[s]["eval_loss"] for s in we)
    name_g, tg = _state(got)
    name_w, tw = _state(want)
    assert name_g == name_w and tg.keys() == tw.keys() and len(tw) > 0
    for key in tw:
        assert tg[key].equal(tw[key]), key


def _env():
    return dict(os.environ, PYTHONPATH=_PY + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _cli(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "megatrain", "train", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=300, **kw)


def test_sigterm_writes_a_checkpoint_and_resume_is_bit_identical(tmp_path):
    steps = 60
    common = [*TINY, "--steps", str(steps), "--log-every", "1", "--eval-every", "25"]
    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "megatrain", "train", "--out", str(out), *common],
                            cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while _last_step(out) < 3:
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted", summary
    stopped_at = summary["step"]
    assert 3 <= stopped_at < steps, "SIGTERM came after the run had finished: make the run longer"
    assert summary["checkpoint"] == str(out / "checkpoints" / f"step-{stopped_at:08d}")
    assert "terminated (SIGTERM)" in err and f"after step {stopped_at}" in err and "Traceback" not in err
    assert f"megatrain train --resume {out}" in err
    assert max(_records(out)) == stopped_at  # the checkpoint is at the last finished step

    resumed = _cli(["--resume", str(out), "--set", f"train.save_every={steps}"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == stopped_at
    assert summary["eval_history"][0]["step"] == 0  # the whole run's history, not only the resumed part
    assert _records(out, "resume")[stopped_at]["checkpoint"] == str(out / "checkpoints" / f"step-{stopped_at:08d}")

    # The uninterrupted run, with a checkpoint at its end to compare the final state with.
    ref = tmp_path / "uninterrupted"
    full = _cli(["--out", str(ref), *common, "--set", f"train.save_every={steps}"], cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    _assert_same_run(out, ref, steps)


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr()


def test_periodic_checkpoints_keep_last_and_resume_mid_log_window(tmp_path, capsys):
    """save_every=2, keep_last=4: the four newest survive. Resuming from step 4 (inside a log window
    of 3 steps) gives the uninterrupted run's windows, eval losses and final state exactly."""
    common = [*TINY, "--steps", "9", "--log-every", "3", "--eval-every", "4"]
    ref = tmp_path / "ref"
    code, cap = _run(["train", "--out", str(ref), *common, "--set", "train.save_every=2",
                      "--set", "train.keep_last=4"], capsys)  # fmt: skip
    assert code == 0, cap.err
    kept = ["step-00000004", "step-00000006", "step-00000008", "step-00000009"]  # 2 is pruned; 9 is the end
    assert sorted(os.listdir(ref / "checkpoints")) == kept
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["checkpoints"] == [str(ref / "checkpoints" / n) for n in kept]
    resumed = tmp_path / "resumed"
    code, cap = _run(["train", "--resume", str(ref / "checkpoints" / "step-00000004"), "--out", str(resumed),
                      "--set", "train.save_every=9"], capsys)  # fmt: skip
    assert code == 0, cap.err
    # The resumed directory holds steps 5..9 only: compare those (and the eval at 8 and 9).
    r, w = _records(resumed), _records(ref)
    assert sorted(r) == [6, 9] and all(r[s]["loss"] == w[s]["loss"] for s in r)
    assert r[6]["step_time_s"] > 0  # the window 4..6 straddles the resume
    re_, we = _records(resumed, "eval"), _records(ref, "eval")
    assert sorted(re_) == [8, 9] and all(re_[s]["eval_loss"] == we[s]["eval_loss"] for s in re_)
    _, tr = _state(resumed)
    _, tw = _state(ref)
    assert tr.keys() == tw.keys() and all(tr[k].equal(tw[k]) for k in tw)
    s = json.loads((resumed / "summary.json").read_text())
    assert s["eval_history"] == json.loads((ref / "summary.json").read_text())["eval_history"]
    assert s["final_train_loss"] == summary["final_train_loss"]


def test_resume_errors_are_one_line_and_write_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    code, cap = _run(["train", "--out", str(out), *TINY, "--steps", "2", "--set", "train.save_every=2"], capsys)
    assert code == 0, cap.err
    before = {p: os.path.getmtime(out / p) for p in ("metrics.jsonl", "summary.json", "config.yaml")}

    def usage_error(argv, fragment):
        code, cap = _run(["train", *argv], capsys)
        lines = cap.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and fragment in lines[0] and "Traceback" not in cap.err, cap.err
        assert {p: os.path.getmtime(out / p) for p in before} == before

    usage_error(["--resume", str(out)], "nothing to train; raise --steps")
    usage_error(["--resume", str(out), "--steps", "4", "--seed", "1"], "the training data differs")
    usage_error(["--resume", str(tmp_path / "nope")], "does not exist")
    usage_error(["--resume", str(tmp_path)], "holds no complete checkpoint")
    usage_error(["--resume", str(out), "--preset", "gpu", "--steps", "4"], "--preset and --resume")
    usage_error(["--out", str(out), *TINY, "--steps", "2"], "it holds checkpoints: continue that run with --resume")

    # Another architecture given with --model: the reason leads the line (the CLI shows its first 200 characters)
    from transformers import AutoModelForCausalLM as _Auto, Qwen2Config

    qwen = tmp_path / "qwen2"
    _Auto.from_config(Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=192, vocab_size=320, max_position_embeddings=128)).save_pretrained(qwen)
    capsys.readouterr()
    code, cap = _run(["train", "--resume", str(out), "--steps", "4", "--model", str(qwen)], capsys)
    last = cap.err.strip().splitlines()[-1]  # after the warnings that the model dir has no tokenizer and no --data
    assert code == 2 and "was saved from another model (a different architecture" in last, cap.err
    assert "shapes or tie_word_embeddings?): unit 0 (model.layers.0.*) holds ['model.layers.0.self_attn.q_proj" in last
    assert {p: os.path.getmtime(out / p) for p in before} == before

    # A checkpoint of the loop API (no training position) is not a CLI run's.
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=64)
    model = megatrain.wrap(AutoModelForCausalLM.from_config(cfg), device="cpu", compute_dtype=torch.float32)
    megatrain.save_checkpoint(str(tmp_path / "api"), model, megatrain.optim.CPUAdamW(model.parameters()))
    usage_error(["--resume", str(tmp_path / "api")], "was not written by megatrain train")


def test_overwrite_starts_a_fresh_run_and_summary_reports_auto_decisions(tmp_path, capsys):
    out = tmp_path / "run"
    code, cap = _run(["train", "--out", str(out), *TINY, "--steps", "3", "--set", "train.save_every=3"], capsys)
    assert code == 0, cap.err
    code, cap = _run(["train", "--out", str(out), *TINY, "--steps", "2", "--log-every", "1",
                      "--activation-policy", "auto", "--set", "log.overwrite=true"], capsys)  # fmt: skip
    assert code == 0, cap.err
    assert sorted(_records(out)) == [1, 2]  # the old run's step 3 is gone: a fresh metrics file
    assert not (out / "checkpoints").exists()  # and its checkpoints (they would resume the old run)
    decisions = json.loads((out / "summary.json").read_text())["auto_decisions"]
    assert decisions and all(d["bytes_per_layer"] > 0 and d["free_bytes"] > 0 for d in decisions)
    assert all(d["policy"] == ("store" if d["recompute_layers"] == 0 else "recompute" if d["store_layers"] == 0
                               else f"store {d['store_layers']} layers, recompute the rest") for d in decisions)
    assert decisions[0]["input_shapes"][0] == [4, 64, 64]  # [micro batch, seq_len, hidden]


def _worker_pid(agent_pid: int, rank: int) -> int:
    """The pid of torchrun's worker of ``rank`` (a child of the agent with RANK=rank in its environment)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == agent_pid and f"RANK={rank}".encode() in environ:
            return int(name)
    raise AssertionError(f"no worker of rank {rank} under pid {agent_pid}")


def test_torchrun_sigterm_to_one_rank_stops_every_rank_after_the_same_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "megatrain",
           "train", "--out", str(out), *TINY, "--micro-batch-size", "2", "--steps", "200", "--log-every", "1",
           "--eval-every", "1000"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(_env(), MEGATRAIN_ADAM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while _last_step(out) < 3:
            assert proc.poll() is None and time.time() < deadline, "training did not start"
            time.sleep(0.05)
        os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)  # rank 1 only, as a preempted process would be
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    stopped_at = summary["step"]
    assert summary["status"] == "interrupted" and 3 <= stopped_at < 200, summary
    assert summary["checkpoint"] == str(out / "checkpoints" / f"step-{stopped_at:08d}")
    megatrain.state.checkpoint.verify_checkpoint(summary["checkpoint"])
    assert err.count(f"megatrain: terminated (SIGTERM) after step {stopped_at}") == 2, err[-3000:]  # both ranks
    assert max(_records(out)) == stopped_at
