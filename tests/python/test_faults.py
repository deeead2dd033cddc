"""Faults and bad inputs: nothing the user had or trained is lost or half-written, no training on
garbage, and every user error of the CLI is one line with exit status 2.

This file is also the worker script the tests run in subprocesses (``python test_faults.py MODE ...``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import transformers  # noqa: F401 - imported here: its log handler then binds the real stderr, not a test's capture
from parity import poison_gradient_at, run_cli  # noqa: E402

HERE = os.path.abspath(__file__)
_PY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if _PY not in sys.path:
    sys.path.insert(0, _PY)


# ---------------------------------------------------------------------------- shared set-up
def _tiny_model(seed: int = 0, vocab: int = 257):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _wrapped(seed: int = 0, **opt_kwargs):
    import megatrain

    model = megatrain.wrap(_tiny_model(seed), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, **opt_kwargs)
    return model, opt


def _plan(seq_len: int = 16):
    return SimpleNamespace(cfg=SimpleNamespace(data=SimpleNamespace(seq_len=seq_len)))


def _worker(argv):
    import megatrain
    import megatrain.state.checkpoint

    mode = argv[0]
    if mode == "slow_save":  # a checkpoint save that takes a while (another process saves meanwhile)
        model, opt = _wrapped()
        from parity import slow_checkpoint_writes
        slow_checkpoint_writes(float(argv[2]))
        print("SAVING", flush=True)
        megatrain.state.checkpoint.save_checkpoint(argv[1], model, opt, extra={"who": "slow"})
        print("SAVED", flush=True)
    elif mode == "killed_model_save":  # the CLI's final save of a second run, killed mid-way
        from megatrain.train import text_tokenizer
        from megatrain.train import final_model

        out = argv[1]
        model, _ = _wrapped()
        final_model.save_model(model, text_tokenizer.ByteTokenizer(), out, _plan())
        real_save = text_tokenizer.ByteTokenizer.save

        def slow_save(self, d):
            real_save(self, d)
            print("WRITING", flush=True)
            time.sleep(60)

        text_tokenizer.ByteTokenizer.save = slow_save
        final_model.save_model(model, text_tokenizer.ByteTokenizer(), out, _plan())
        print("SAVED (should have been killed)", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


def _spawn(*args, env=None):
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_PY + os.pathsep + os.environ.get("PYTHONPATH", ""))
    e.update(env or {})
    return subprocess.Popen([sys.executable, HERE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=e)


def _wait_line(p, want: str, timeout: float = 120):
    line = p.stdout.readline()
    assert line.strip() == want, (line, p.stderr.read() if p.poll() is not None else "")


# ---------------------------------------------------------------------------- the atomic directory
def _snapshot(path):
    if not os.path.isdir(path):
        return None
    return {n: open(os.path.join(path, n)).read() for n in sorted(os.listdir(path))}


def _watch_every_step(monkeypatch, check):
    """Call ``check()`` after every file-system mutation (what a SIGKILL at that moment would leave)."""
    def wrap(obj, name):
        real = getattr(obj, name)

        def f(*a, **k):
            r = real(*a, **k)
            check()
            return r
        monkeypatch.setattr(obj, name, f)

    for obj, name in [(os, "replace"), (os, "rename"), (os, "rmdir"), (os, "unlink"), (os, "remove"),
                      (shutil, "rmtree")]:
        wrap(obj, name)
    try:
        import megatrain.state.atomic as atomic
    except ImportError:  # a megatrain without megatrain.state.atomic
        return
    wrap(atomic, "_exchange")


def test_atomic_directory_is_old_or_new_at_every_moment(tmp_path, monkeypatch):
    from megatrain.state.atomic import atomic_directory

    def mine(p):
        return os.path.isfile(os.path.join(p, "mark"))

    dest = str(tmp_path / "d")
    old = {"a": "old a", "b": "old b", "mark": ""}
    new = {"a": "new a", "c": "new c", "mark": ""}
    with atomic_directory(dest, "t", mine) as tmp:
        for k, v in old.items():
            open(os.path.join(tmp, k), "w").write(v)
    seen = []

    def check():
        snap = _snapshot(dest)
        assert snap in (old, new), snap
        seen.append(snap == new)

    _watch_every_step(monkeypatch, check)
    with atomic_directory(dest, "t", mine) as tmp:
        for k, v in new.items():
            open(os.path.join(tmp, k), "w").write(v)
    monkeypatch.undo()
    assert _snapshot(dest) == new and seen and seen[-1]
    assert sorted(os.listdir(tmp_path)) == ["d"], "no temporary is left behind"
    with pytest.raises(RuntimeError):  # a failed write leaves the old one and no temporary
        with atomic_directory(dest, "t", mine) as tmp:
            open(os.path.join(tmp, "a"), "w").write("half")
            raise RuntimeError("boom")
    assert _snapshot(dest) == new and sorted(os.listdir(tmp_path)) == ["d"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        with atomic_directory(str(foreign), "t", mine):
            pass
    assert (foreign / "README.md").read_text() == "mine"


def test_atomic_directory_never_deletes_a_live_writers_temporary(tmp_path):
    """A temporary locked by a live writer survives another writer's clean-up; an unlocked one goes."""
    from megatrain.state.atomic import atomic_directory

    dest = str(tmp_path / "d")
    stale = tmp_path / ".d.tmp-killed"  # left by a killed writer: nobody holds its lock
    stale.mkdir()
    with atomic_directory(dest, "t", lambda p: True) as first:
        with atomic_directory(dest, "t", lambda p: True) as second:
            assert os.path.isdir(first) and not stale.exists()
            open(os.path.join(second, "x"), "w").write("2")
        assert os.path.isdir(first), "the second writer deleted the first one's temporary"
        open(os.path.join(first, "x"), "w").write("1")
    assert _snapshot(dest) == {"x": "1"}  # the last swap wins
    with pytest.raises(ValueError, match="is not empty"):  # re-checked before the swap: not replaced
        with atomic_directory(str(tmp_path / "e"), "t") as fourth:
            with atomic_directory(str(tmp_path / "e"), "t") as fifth:
                open(os.path.join(fifth, "x"), "w").write("5")
            open(os.path.join(fourth, "x"), "w").write("4")
    assert _snapshot(str(tmp_path / "e")) == {"x": "5"}
    shutil.rmtree(tmp_path / "e")
    assert sorted(os.listdir(tmp_path)) == ["d"]


# ---------------------------------------------------------------------------- 1. the user's base model
def _corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir(exist_ok=True)
    for i in range(6):
        (d / f"{i}.txt").write_text(("the quick brown fox jumps over the lazy dog %d. " % i) * 30)
    return d


_cli = run_cli  # (exit code, stdout, stderr) of megatrain.cli.main(argv)


def _one_line(code, err, fragment):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: ") and fragment in lines[0], err
    assert "Traceback" not in err


F = ["--steps", "2", "--seq-len", "32", "--micro-batch-size", "2", "--no-progress", "--device", "cpu",
     "--set", "eval.batches=1"]  # fmt: skip


def test_cli_never_replaces_the_users_own_model_dir(tmp_path, capsys):
    base = tmp_path / "work" / "model"
    _tiny_model().save_pretrained(base)
    (base / "README.md").write_text("my model")
    before = _snapshot_bytes(base)
    capsys.readouterr()
    code, _, err = _cli(["train", "--model", str(base), "--out", str(tmp_path / "work"), "--data",
                         str(_corpus(tmp_path)), *F, "--set", "log.overwrite=true"], capsys)
    _one_line(code, err, "is not empty and is not a model directory an earlier megatrain train run saved")
    assert _snapshot_bytes(base) == before
    assert sorted(os.listdir(tmp_path / "work")) == ["model"], "nothing is written before the check"


def _snapshot_bytes(path):
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


# ---------------------------------------------------------------------------- 2. killed during the final save
def test_cli_final_save_leaves_a_complete_model_at_every_moment(tmp_path, monkeypatch):
    from megatrain.train import text_tokenizer
    from megatrain.train import final_model

    model, _ = _wrapped()
    out = str(tmp_path / "out")
    os.makedirs(out)
    final_model.save_model(model, text_tokenizer.ByteTokenizer(), out, _plan())
    final = os.path.join(out, "model")
    first = _snapshot_bytes(final)
    with torch.no_grad():
        model.megatrain.entry_view(model.megatrain.units[0], 0, "master").add_(1.0)  # a different model
    bad = []

    def check():
        names = set(os.listdir(final)) if os.path.isdir(final) else set()
        if not {"config.json", "model.safetensors", "megatrain_train.json", "tokenizer.json"} <= names:
            bad.append(sorted(names))

    _watch_every_step(monkeypatch, check)
    final_model.save_model(model, text_tokenizer.ByteTokenizer(), out, _plan())
    monkeypatch.undo()
    assert not bad, f"a kill at some moment would have left out/model as {bad[0]}"
    assert _snapshot_bytes(final)["model.safetensors"] != first["model.safetensors"]
    assert sorted(os.listdir(out)) == ["model"]


def test_cli_final_save_killed_keeps_the_previous_model_and_the_next_save_cleans_up(tmp_path):
    from megatrain.train import text_tokenizer
    from megatrain.train import final_model

    out = tmp_path / "out"
    out.mkdir()
    p = _spawn("killed_model_save", str(out))
    try:
        _wait_line(p, "WRITING")
        first = _snapshot_bytes(out / "model")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    assert _snapshot_bytes(out / "model") == first
    model, _ = _wrapped()
    final_model.save_model(model, text_tokenizer.ByteTokenizer(), str(out), _plan())
    assert sorted(os.listdir(out)) == ["model"], "the killed save's temporary is cleaned up"


# ---------------------------------------------------------------------------- 8. two processes, one checkpoint path
def test_two_processes_saving_one_checkpoint_both_complete(tmp_path):
    import megatrain.state.checkpoint
    from megatrain.state.checkpoint import verify_checkpoint

    ckpt = str(tmp_path / "ck")
    p = _spawn("slow_save", ckpt, "0.7")
    try:
        _wait_line(p, "SAVING")
        deadline = time.time() + 120
        while time.time() < deadline and not any(
                f.endswith(".safetensors") for d in os.listdir(tmp_path) if d.startswith(".ck.tmp-")
                for f in os.listdir(tmp_path / d)):
            time.sleep(0.05)
        model, opt = _wrapped(seed=1)
        megatrain.state.checkpoint.save_checkpoint(ckpt, model, opt, extra={"who": "fast"})
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "SAVED" in out, err[-3000:]
    verify_checkpoint(ckpt)
    model, opt = _wrapped(seed=2)
    assert megatrain.state.checkpoint.load_checkpoint(ckpt, model, opt) == {"who": "slow"}  # the last swap wins
    assert sorted(os.listdir(tmp_path)) == ["ck"]


# ---------------------------------------------------------------------------- 5. non-finite loss / gradient
def _masters(model):
    import megatrain

    return {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}


def _nan_step(model, opt, scale=float("nan"), x=None):
    x = torch.randint(0, 257, (2, 12)) if x is None else x
    (model(input_ids=x, labels=x).loss * scale).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("clip", [1.0, None], ids=["max_grad_norm", "no_clipping"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_loss_never_reaches_the_masters_and_the_next_step_is_torch_adamw(clip, bad):
    model, opt = _wrapped(max_grad_norm=clip)
    before = _masters(model)
    x0, x1 = torch.randint(0, 257, (2, 12)), torch.randint(0, 257, (2, 12))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        _nan_step(model, opt, bad, x0)
        _nan_step(model, opt, 1.0, x1)  # without clipping the skip is reported at the next step()
    assert opt.skipped_steps == 1
    assert all(float(st["step"]) == 1.0 for st in opt.state.values())
    # The skipped step changed nothing: the good step from the same start is plain torch AdamW's.
    ref = _tiny_model()
    for n, p in ref.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(input_ids=x1, labels=x1).loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ref_opt.step()
    after = _masters(model)
    for n, p in ref.named_parameters():
        torch.testing.assert_close(after[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_nonfinite_raise_mode_raises_before_any_update():
    for clip in (1.0, None):
        model, opt = _wrapped(max_grad_norm=clip, nonfinite="raise")
        before = _masters(model)
        with pytest.raises(FloatingPointError, match="non-finite"):
            _nan_step(model, opt)
        opt.zero_grad()
        after = _masters(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
        _nan_step(model, opt, 1.0)  # training goes on after the error
        assert all(torch.isfinite(v).all() for v in _masters(model).values())


def test_nonfinite_gradient_in_one_layer_without_clipping_skips_that_layer_and_those_below():
    """Without max_grad_norm each layer updates during backward: a NaN entering backward at layer 1's
    output reaches layer 1, layer 0 and the embedding (skipped), not layer 2+ or the LM head (updated)."""
    import megatrain

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = megatrain.wrap(LlamaForCausalLM(cfg), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)

    h = poison_gradient_at(model.model.layers[1])
    before = _masters(model)
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.1"):
        _nan_step(model, opt, 1.0)
        h.remove()
        opt.wait()  # the updates queued during backward have run (no forward in between waits for them)
        opt.step()  # reports the skipped layers
    after = _masters(model)
    assert all(torch.isfinite(v).all() for v in after.values())
    for k in before:
        skipped = k.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))
        assert torch.equal(before[k], after[k]) == skipped, k
    steps = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    assert steps["model.layers.0.mlp.up_proj.weight"] == 0 and steps["model.layers.2.mlp.up_proj.weight"] == 1


def test_eps_zero_is_refused_in_the_api():
    import megatrain

    model = megatrain.wrap(_tiny_model(), device="cpu", compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="eps must be > 0"):
        megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, eps=0.0)
    with pytest.raises(ValueError, match="nonfinite must be"):
        megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, nonfinite="ignore")


# ---------------------------------------------------------------------------- 6, 7. one line, exit 2, nothing written
@pytest.mark.parametrize("argv, fragment", [
    (["--seq-len", "1"], "data.seq_len must be >= 2"),
    (["--set", "model.hidden_size=32768", "--set", "model.num_layers=64", "--set", "model.num_heads=256",
      "--set", "model.num_kv_heads=256", "--set", "model.intermediate_size=65536"], "of host memory but only"),
    (["--set", "model.vocab_size=400000000"], "of host memory but only"),
    (["--out", "/proc/megatrain-out"], "cannot write output directory"),
], ids=["seq_len_1", "huge_model", "huge_vocab", "out_under_proc"])  # fmt: skip
def test_cli_bad_size_or_out_is_one_line_before_anything_is_written(tmp_path, capsys, argv, fragment):
    out = tmp_path / "out"
    code, _, err = _cli(["train", "--out", str(out), "--data", str(_corpus(tmp_path)), *F, *argv], capsys)
    _one_line(code, err, fragment)
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_cli_read_only_out_dir_is_one_line(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        code, _, err = _cli(["train", "--out", str(out), "--data", str(_corpus(tmp_path)), *F], capsys)
    finally:
        out.chmod(0o755)
    _one_line(code, err, "not writable")
    assert os.listdir(out) == []


def test_cli_huge_lr_is_one_line_and_the_masters_stay_finite(tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = _cli(["train", "--out", str(out), "--data", str(_corpus(tmp_path)), *F, "--steps", "6",
                         "--lr", "1e6", "--set", "train.warmup_steps=0"], capsys)
    _one_line(code, err, "non-finite")
    assert json.load(open(out / "summary.json"))["status"] == "failed"


def test_cli_disk_full_at_start_and_during_the_save_is_one_line(tmp_path, capsys, monkeypatch):
    import errno

    import megatrain.state.export
    from megatrain.train import run_files

    out = tmp_path / "out"
    args = ["train", "--out", str(out), "--data", str(_corpus(tmp_path)), *F]

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "config.yaml"))

    with monkeypatch.context() as m:
        m.setattr(run_files, "to_yaml", full)
        code, _, err = _cli(args, capsys)
    _one_line(code, err, "No space left on device; free disk space or choose another --out")
    code, _, err = _cli(args + ["--set", "log.overwrite=true"], capsys)
    assert code == 0, err
    first = _snapshot_bytes(out / "model")

    def full_save(model, d, dtype=None):
        open(os.path.join(d, "model.safetensors"), "wb").write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(d, "model.safetensors"))

    monkeypatch.setattr(megatrain.state.export, "save_pretrained_streamed", full_save)
    code, _, err = _cli(args + ["--set", "log.overwrite=true"], capsys)
    _one_line(code, err, "No space left on device")
    assert _snapshot_bytes(out / "model") == first, "the previous model is intact"
    assert not [n for n in os.listdir(out) if n.startswith(".")]


# ---------------------------------------------------------------------------- 3. a model directory missing a tensor
def test_cli_refuses_a_model_dir_missing_a_tensor(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    _tiny_model().save_pretrained(base)
    sd = load_file(base / "model.safetensors")
    del sd["model.layers.1.self_attn.q_proj.weight"]
    save_file(sd, base / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    out = tmp_path / "out"
    code, _, err = _cli(["train", "--model", str(base), "--out", str(out), "--data", str(_corpus(tmp_path)), *F],
                        capsys)
    _one_line(code, err, "has no weights for 1 tensor(s) of the model: model.layers.1.self_attn.q_proj.weight")
    assert not out.exists()


# ---------------------------------------------------------------------------- 4. data that is not text
def test_binary_files_are_skipped_with_a_warning_naming_them(tmp_path, capsys):
    from megatrain.train import data as data_mod

    d = _corpus(tmp_path)
    shutil.copy(sys.executable if os.path.isfile(sys.executable) else "/bin/ls", d / "elf.txt")
    (d / "zeros.md").write_bytes(b"abc\0\0\0def" * 100)
    cfg = SimpleNamespace(path=str(d), include=["*.txt", "*.md"], text_field="text", tokenizer=None, seq_len=32,
                          eval_fraction=0.2, max_documents=None)
    data = data_mod.load_text_data(cfg, 0)
    err = capsys.readouterr().err
    assert "skipping 2 binary data file(s)" in err and "elf.txt" in err and "zeros.md" in err
    assert data.num_documents == 6
    with pytest.raises(data_mod.UsageError, match="is binary"):  # the one file the user named
        data_mod.load_text_data(SimpleNamespace(**{**vars(cfg), "path": str(d / "elf.txt")}), 0)


def test_latin1_text_keeps_every_byte_with_the_byte_tokenizer(tmp_path):
    from megatrain.train import data as data_mod
    from megatrain.train import text_tokenizer

    raw = "caf\u00e9 na\u00efve \u00fcber ".encode("latin-1") * 50
    (tmp_path / "a.txt").write_bytes(raw)
    docs = data_mod.read_documents([str(tmp_path / "a.txt")], keep_bytes=True)
    ids = text_tokenizer.ByteTokenizer().encode(docs[0])
    assert bytes(ids.astype("uint8").tolist()) == raw


def test_non_utf8_text_with_another_tokenizer_warns_naming_the_file(tmp_path, capsys):
    from megatrain.train import data as data_mod

    (tmp_path / "a.txt").write_bytes("caf\u00e9".encode("latin-1"))
    docs = data_mod.read_documents([str(tmp_path / "a.txt")], keep_bytes=False)
    assert docs == ["caf\ufffd"]
    err = capsys.readouterr().err
    assert "not valid UTF-8" in err and "a.txt" in err


def test_a_fifo_in_the_data_dir_is_skipped_not_read(tmp_path, capsys):
    from megatrain.train import data as data_mod

    d = _corpus(tmp_path)
    os.mkfifo(d / "pipe.txt")
    os.symlink(d / "missing.txt", d / "dangling.txt")
    files = data_mod.find_files(str(d), ["*.txt"])
    assert str(d / "pipe.txt") not in files and len(files) == 6
    err = capsys.readouterr().err
    assert "pipe.txt" in err and "dangling.txt" in err and "not regular files" in err
    with pytest.raises(data_mod.UsageError, match="FIFO"):
        data_mod.find_files(str(d / "pipe.txt"), ["*.txt"])


# ---------------------------------------------------------------------------- more bad inputs
def test_model_dir_whose_config_does_not_match_its_weights_is_one_line(tmp_path, capsys):
    base = tmp_path / "base"
    _tiny_model().save_pretrained(base)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128)
    (base / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    code, _, err = _cli(["train", "--model", str(base), "--out", str(tmp_path / "out"), "--data",
                         str(_corpus(tmp_path)), *F], capsys)
    _one_line(code, err, "holds weights whose shapes differ from its config.json")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--micro-batch-size", "100000000"], "is more than the"),
    (["--set", "model.hidden_size=6", "--set", "model.num_heads=2", "--set", "model.num_kv_heads=1",
      "--set", "model.intermediate_size=8"], "fails on a 3-token forward"),
], ids=["micro_batch_larger_than_the_data", "odd_rotary_head_dim"])  # fmt: skip
def test_cli_more_bad_sizes_are_one_line(tmp_path, capsys, argv, fragment):
    out = tmp_path / "out"
    code, _, err = _cli(["train", "--out", str(out), "--data", str(_corpus(tmp_path)), *F, *argv], capsys)
    _one_line(code, err, fragment)
    assert not out.exists()


def test_unknown_model_extra_key_warns(tmp_path, capsys):
    from megatrain.train import model_build
    from megatrain.train.config_build import build_config

    cfg = build_config(overrides=[("model", "extra", {"hiden_act": "gelu"})])
    model_build.load_model_config(cfg, 257, 256)
    assert "'hiden_act' are not attributes of LlamaConfig" in capsys.readouterr().err


if __name__ == "__main__":
    _worker(sys.argv[1:])
