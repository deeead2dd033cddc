"""The disk tier in training (wrap(offload_dir=..., host_memory_limit=...)): bit-identical to host-only
training, checkpoints, state dicts, faults and the checks before anything is written."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import megatrain
from megatrain import _C
from megatrain.state.checkpoint import verify_checkpoint
from megatrain.runtime.placement import disk_plan as disk_offload
from megatrain.runtime.options import options_set

sys.path.insert(0, os.path.dirname(__file__))
from parity import PARITY_EPS, assert_close_rel, make_batches, poison_gradient_at, train_reference  # noqa: E402
from parity import keep_compute_copy  # noqa: E402

# These tests pin today's layout (a compute copy per layer) to exercise the exclusive / disk tiers.
kept_wrap, kept_estimate = keep_compute_copy(megatrain.wrap), keep_compute_copy(megatrain.estimate)
kept_from_pretrained = keep_compute_copy(megatrain.from_pretrained)
kept_from_config = keep_compute_copy(megatrain.from_config)

LAYERS = 6
VOCAB = 96


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=VOCAB)


def _model(seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_config())


def _limit(ga=1):
    """One byte less than the host bytes of the whole model without a disk tier: some layers must go to disk."""
    return kept_estimate(_model(), device="cpu", gradient_accumulation_steps=ga).host_bytes - 1


def _wrap(tmp_path, name="tier", ga=1, **kw):
    """The test model wrapped host-only (``name`` None) or with a disk tier under ``tmp_path / name``
    (accumulation: the accumulator planned at wrap, ``grad_accumulator=True``)."""
    m = _model()
    if name is None:
        return kept_wrap(m, device="cpu", **kw)
    if ga > 1:
        kw.setdefault("grad_accumulator", True)
    return kept_wrap(m, device="cpu", offload_dir=str(tmp_path / name), host_memory_limit=_limit(ga), **kw)


def _train(model, steps, ga, max_grad_norm, batches=None, opt=None, start=0):
    if opt is None:
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS,
                                       max_grad_norm=max_grad_norm, gradient_accumulation_steps=ga)
    batches = batches or make_batches(VOCAB, start + steps, ga, 2, 8, seed=3)
    for micro in batches[start:start + steps]:
        for x in micro:
            (model(input_ids=x, labels=x).loss / ga).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _state(model, opt):
    """Every fp32 training state, by name: masters and the moments (copies)."""
    out = {f"master.{k}": v.clone() for k, v in megatrain.master_state_dict(model).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{k}.{names[id(p)]}"] = st[k].clone()
    return out


def _assert_bits(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)), k


@pytest.mark.parametrize("ga,max_grad_norm", [(1, None), (2, 1.0), (3, None), (4, 0.05)])
def test_training_with_the_tier_is_bit_identical_to_without(tmp_path, ga, max_grad_norm):
    ref = _wrap(tmp_path, None)
    opt_ref = _train(ref, 10, ga, max_grad_norm)
    model = _wrap(tmp_path, ga=ga)
    eng = model.megatrain
    assert [u.index for u in eng.disk.units] == [3, 4, 5]  # the deepest layers, as few as fit
    assert eng.disk.tier.direct_io or eng.disk.tier.direct_io_note
    opt = _train(model, 10, ga, max_grad_norm)
    _assert_bits(_state(model, opt), _state(ref, opt_ref))
    st = eng.stats()
    # the state really went through the files: 3 units, 2 buffers
    assert st["disk_layers"] == 3 and st["disk_unit_reads"] >= 10 and st["disk_unit_writes"] >= 30
    if ga > 1:
        assert eng.disk.accum is not None and eng.disk.accum.stats()["unit_writes"] >= 10 * 3
    assert not [n for n in os.listdir(tmp_path / "tier") if not n.endswith(".tier") and n != "grad_accum"]


@pytest.mark.parametrize("ga,max_grad_norm", [(1, None), (1, 1.0), (2, None), (2, 1.0)])
def test_each_step_reads_and_writes_the_disk_state_once(tmp_path, ga, max_grad_norm):
    """The bytes the tiers move per step are what docs/disk_tier.md's read-ahead policy says: every disk
    unit's state (master, exp_avg, exp_avg_sq) read at most once (not at all when the pool still
    holds it from the last step) and written once, whether the updates run
    during backward (no clipping) or at step() in forward order (clipping); with accumulation each
    accumulator is written once per micro-batch and read at most once per micro-batch and once by
    the update. A read-ahead whose target is evicted
    before its update takes it reads the state again (the first 9.98B H200 run read 2.6x the state)."""
    model = _wrap(tmp_path, ga=ga)
    eng = model.megatrain
    n = len(eng.disk.units)
    state_bytes, accum_bytes = eng.disk.plan.disk_bytes, eng.disk.plan.accum_disk_bytes
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, eps=PARITY_EPS, max_grad_norm=max_grad_norm,
                                   gradient_accumulation_steps=ga)
    batches = make_batches(VOCAB, 6, ga, 2, 8, seed=4)

    def counters():
        eng.worker.drain()
        eng.disk.flush()  # the writes behind of this step done
        # every read a step issues is one its updates take: none is left in flight for the next step's count
        tiers = [t for t in (eng.disk.tier, eng.disk.accum) if t is not None]
        assert not [(t.dir, u.index) for t in tiers for u in eng.disk.units if t.unit_state(u.disk) == "reading"]
        return [{k: t.stats()[k] for k in ("bytes_read", "bytes_written", "unit_reads", "unit_writes", "cache_hits")}
                for t in (eng.disk.tier, eng.disk.accum) if t is not None]

    per_step = []
    for k, micro in enumerate(batches):
        before = counters()
        for x in micro:
            (model(input_ids=x, labels=x).loss / ga).backward()
        opt.step()
        opt.zero_grad()
        after = counters()
        if k > 0:  # the first step writes the accumulators' files for the first time (no reads)
            per_step.append([{key: a[key] - b[key] for key in a} for a, b in zip(after, before)])
    # each unit read at most once a step, whatever the threads' timing; only the units the pool still holds
    # from the last step may skip it
    for k, tiers in enumerate(per_step, start=1):
        state = tiers[0]
        assert n - eng.disk.num_buffers <= state["unit_reads"] <= n, (k, state)
        assert state["bytes_read"] == state["unit_reads"] * state_bytes // n, (k, state)
        assert (state["unit_writes"], state["bytes_written"]) == (n, state_bytes), (k, state)
        if ga > 1:
            accum = tiers[1]
            assert (accum["unit_writes"], accum["bytes_written"]) == (ga * n, ga * accum_bytes), (k, accum)
            assert accum["unit_reads"] <= (ga + 1) * n, (k, accum)
            assert accum["bytes_read"] == accum["unit_reads"] * accum_bytes // n, (k, accum)
        else:
            assert len(tiers) == 1


def test_parity_with_torch_adamw(tmp_path):
    """The tier against the ordinary PyTorch way (torch.optim.AdamW, fp32), per element."""
    batches = make_batches(VOCAB, 10, 2, 2, 8, seed=5)
    ref = train_reference(_model(), batches, lr=1e-3, wd=0.1, betas=(0.9, 0.95), max_grad_norm=1.0, groups="one")
    model = _wrap(tmp_path, ga=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=PARITY_EPS,
                                   max_grad_norm=1.0, gradient_accumulation_steps=2)
    _train(model, 10, 2, 1.0, batches=batches, opt=opt)
    got = megatrain.master_state_dict(model)
    for name, want in ref.params.items():
        assert_close_rel(got[name], want, 1e-5, name)


def test_frozen_entries_and_nonfinite_skip_are_exact(tmp_path):
    """A disk layer with frozen entries (no fp32 state), and a step whose disk-layer gradient is NaN."""
    ms = []
    for name in (None, "tier"):
        m = _model()
        for n, p in m.named_parameters():
            if "layernorm" in n and "layers.4" in n:
                p.requires_grad_(False)
        limit = kept_estimate(m, device="cpu").host_bytes - 1
        kw = dict(offload_dir=str(tmp_path / name), host_memory_limit=limit) if name else {}
        ms.append(kept_wrap(m, device="cpu", **kw))
    results = []
    for m in ms:
        opt = megatrain.optim.CPUAdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, eps=PARITY_EPS)
        batches = make_batches(VOCAB, 4, 1, 2, 8, seed=7)
        for s, (x,) in enumerate(batches):
            h = poison_gradient_at(m.model.layers[5]) if s == 2 else None  # a disk layer's gradient is NaN
            m(input_ids=x, labels=x).loss.backward()
            if h is not None:
                h.remove()
            with pytest.warns(RuntimeWarning, match="non-finite") if s == 2 else _nullwarn():
                opt.step()
            opt.zero_grad()
        results.append((_state(m, opt), opt.skipped_steps))
    assert ms[1].megatrain.disk is not None and 4 in [u.index for u in ms[1].megatrain.disk.units]
    assert results[0][1] == results[1][1] == 1
    _assert_bits(results[1][0], results[0][0])


class _nullwarn:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_undeclared_accumulation_and_zero_grad_paths_are_exact(tmp_path):
    """A second backward with gradient_accumulation_steps=1 moves the direct gradients of the disk
    units to the accumulator on disk; zero_grad without step rewrites their compute copy from the
    masters on disk."""
    out = []
    for name in (None, "tier"):
        m = _wrap(tmp_path, name, grad_accumulator=True)
        opt = megatrain.optim.CPUAdamW(m.parameters(), lr=1e-2, eps=PARITY_EPS, max_grad_norm=1.0)
        b = make_batches(VOCAB, 3, 2, 2, 8, seed=9)
        for x in b[0]:  # two backward passes, one step
            m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        m(input_ids=b[1][0], labels=b[1][0]).loss.backward()
        opt.zero_grad()  # dropped: the compute copies come back from the masters
        with torch.no_grad():
            logits = m(input_ids=b[2][0]).logits.clone()
        out.append((_state(m, opt), logits))
    _assert_bits(out[1][0], out[0][0])
    assert torch.equal(out[1][1], out[0][1])


def test_state_dicts_read_and_write_the_disk_units(tmp_path):
    model = _wrap(tmp_path)
    opt = _train(model, 2, 1, None)
    eng = model.megatrain
    disk_name = next(e.name for e in eng.disk.units[-1].entries)
    sd = model.state_dict()
    master = megatrain.master_state_dict(model)
    assert torch.equal(sd[disk_name], master[disk_name])
    # load_state_dict into the disk units: the new values train on, and are what state_dict() gives back
    new = {k: v + 0.5 for k, v in sd.items()}
    model.load_state_dict(new)
    assert torch.equal(model.state_dict()[disk_name], new[disk_name])
    osd = opt.state_dict()
    p_disk = dict(model.named_parameters())[disk_name]
    idx = [i for g in opt.param_groups for i, p in enumerate(g["params"]) if p is p_disk][0]
    assert osd["state"][idx]["exp_avg"].abs().sum() > 0
    osd["state"][idx]["exp_avg"] = torch.full_like(osd["state"][idx]["exp_avg"], 0.25)
    opt.load_state_dict(osd)
    assert torch.equal(opt.state[p_disk]["exp_avg"], torch.full(p_disk.shape, 0.25))
    # the same loads on a host-only model give the same training
    ref = _wrap(tmp_path, None)
    ref_opt = _train(ref, 2, 1, None)
    ref.load_state_dict(new)
    ref_opt.load_state_dict(osd)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))
    _train(model, 2, 1, None, opt=opt, start=2)
    _train(ref, 2, 1, None, opt=ref_opt, start=2)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))


def test_checkpoint_round_trip_through_the_tier(tmp_path):
    ref = _wrap(tmp_path, None)
    ref_opt = _train(ref, 6, 2, 1.0)
    model = _wrap(tmp_path, "a", ga=2)
    opt = _train(model, 3, 2, 1.0)
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    del model, opt
    model = _wrap(tmp_path, "b", ga=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=1.0,
                                   gradient_accumulation_steps=2)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _train(model, 3, 2, 1.0, opt=opt, start=3)
    _assert_bits(_state(model, opt), _state(ref, ref_opt))
    # a host-only model reads the same checkpoint (the format does not depend on the tier)
    plain = _wrap(tmp_path, None)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), plain)
    megatrain.export_pretrained(model, str(tmp_path / "export"))
    from transformers import LlamaForCausalLM

    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
    got = dict(back.named_parameters())
    for k, v in megatrain.master_state_dict(model).items():
        assert torch.equal(got[k].detach(), v), k


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, megatrain
    from test_disk_offload import _wrap, _train, _state, make_batches, VOCAB, PARITY_EPS
    from pathlib import Path
    tmp, mode = Path(sys.argv[1]), sys.argv[2]
    model = _wrap(tmp, "tier", ga=2)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS, max_grad_norm=1.0,
                                   gradient_accumulation_steps=2)
    batches = make_batches(VOCAB, 10, 2, 2, 8, seed=3)
    start = 0
    if mode == "resume":
        start = megatrain.load_checkpoint(str(tmp / "ckpt"), model, opt)["step"]
    for s in range(start, 10):
        for k, x in enumerate(batches[s]):
            loss = model(input_ids=x, labels=x).loss / 2
            if mode == "kill" and s == 7 and k == 1:
                # killed during a step: the first micro-batch's gradients are in the accumulator on
                # disk and the tier's files are being written
                loss.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            loss.backward()
        opt.step()
        opt.zero_grad()
        if s == 4:
            megatrain.save_checkpoint(str(tmp / "ckpt"), model, opt, extra={{"step": s + 1}})
    torch.save(_state(model, opt), str(tmp / "final.pt"))
""")


@pytest.mark.slow
def test_killed_during_a_step_resumes_exactly(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT.format(tests=os.path.dirname(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

    def run(d, mode):
        d.mkdir(exist_ok=True)
        return subprocess.run([sys.executable, str(script), str(d), mode], env=env, capture_output=True, text=True,
                              timeout=300)

    r = run(tmp_path / "killed", "kill")
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    left = os.listdir(tmp_path / "killed" / "tier")
    assert any(n.endswith(".tier") for n in left)  # a killed run leaves its working files behind
    r = run(tmp_path / "killed", "resume")  # the same offload_dir: the dead run's files are removed, not read
    assert r.returncode == 0, r.stderr[-2000:]
    r = run(tmp_path / "whole", "plain")
    assert r.returncode == 0, r.stderr[-2000:]
    _assert_bits(torch.load(tmp_path / "killed" / "final.pt"), torch.load(tmp_path / "whole" / "final.pt"))


def test_disk_write_error_is_clear_and_the_last_checkpoint_intact(tmp_path):
    model = _wrap(tmp_path, "ok")
    opt = _train(model, 2, 1, None)
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    saved = _state(model, opt)
    with options_set(disk_fault=("write", -1, errno.ENOSPC, 12)):  # the disk fills up during training
        model2 = _wrap(tmp_path, "full")
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), model2)
    with pytest.raises((RuntimeError, OSError), match="No space left on device.*disk is full.*restart from the last "
                       "checkpoint"):
        _train(model2, 10, 1, None)
        model2.megatrain.flush()
    with pytest.raises((RuntimeError, OSError), match="restart from the last checkpoint"):
        megatrain.save_checkpoint(str(tmp_path / "ckpt"), model2, None)
    verify_checkpoint(str(tmp_path / "ckpt"))  # untouched
    fresh = _wrap(tmp_path, "fresh")
    opt3 = megatrain.optim.CPUAdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, eps=PARITY_EPS)
    megatrain.load_checkpoint(str(tmp_path / "ckpt"), fresh, opt3)
    _assert_bits(_state(fresh, opt3), saved)


def test_bad_offload_arguments_fail_before_anything_is_written(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="parent of offload_dir.*does not exist"):
        _wrap(tmp_path, "missing/tier")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        kept_wrap(_model(), device="cpu", offload_dir=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="host_memory_limit must be a number of bytes"):
        kept_wrap(_model(), device="cpu", host_memory_limit="1 gigabyte")
    with pytest.raises(_C.HostMemoryError, match="pass offload_dir"):
        kept_wrap(_model(), device="cpu", host_memory_limit=_limit())
    with pytest.raises(_C.HostMemoryError, match="even with the fp32 state of 6 decoder layers on disk"):
        kept_wrap(_model(), device="cpu", offload_dir=str(tmp_path / "small"), host_memory_limit=200_000)
    assert not (tmp_path / "small").exists()
    monkeypatch.setattr(disk_offload, "free_bytes", lambda d: 4096)
    with pytest.raises(_C.DiskSpaceError) as info:
        _wrap(tmp_path, "nospace")
    assert info.value.errno == errno.ENOSPC and info.value.free_bytes == 4096
    assert info.value.needed_bytes > 4096
    assert "Nothing was written" in str(info.value) and not (tmp_path / "nospace").exists()
    monkeypatch.undo()
    auto = kept_wrap(_model(), device="cpu", offload_dir=str(tmp_path / "auto"), host_memory_limit=_limit())
    with pytest.raises(_C.HostMemoryError, match="accumulator.*host_memory_limit.*grad_accumulator=True"):
        megatrain.optim.CPUAdamW(auto.parameters(), gradient_accumulation_steps=2)
    # layers 0..4 never go to disk: the fewest of them (layer 0 is enough) keep their fp32 state on the device
    # only, before any layer goes to disk
    ds = _wrap(tmp_path, "ds", device_state_layers=5)
    assert ds.megatrain.placement()["exclusive_layers"] == [0] and ds.megatrain.disk is None
    with pytest.raises(_C.HostMemoryError, match="1 decoder layers on disk and of layers 0..4 on the device only"):
        kept_wrap(_model(), device="cpu", offload_dir=str(tmp_path / "ds2"), host_memory_limit=200_000,
                       device_state_layers=5)
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        with pytest.raises(ValueError, match="not writable"):
            kept_wrap(_model(), device="cpu", offload_dir=str(ro), host_memory_limit=_limit())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (a directory nobody can write)")
def test_unwritable_offload_dir_is_refused_even_with_no_layer_on_disk(tmp_path):
    # Root ignores permission bits: /proc is a directory where no file can be created, by anyone.
    big = 2 * kept_estimate(_model(), device="cpu").host_bytes  # every layer fits: none would go to disk
    model = _model()
    model.save_pretrained(str(tmp_path / "ckpt"))
    for bad, msg in (("/proc/megatrain_tier", "cannot be created: /proc is not writable"),
                     ("/proc", "offload_dir=/proc is not writable")):
        calls = {
            "megatrain.wrap": lambda kw: kept_wrap(model, device="cpu", **kw),
            "megatrain.estimate": lambda kw: kept_estimate(_config(), device="cpu", **kw),
            "megatrain.from_config": lambda kw: kept_from_config(_config(), seed=0, device="cpu", **kw),
            "megatrain.from_pretrained": lambda kw: kept_from_pretrained(str(tmp_path / "ckpt"), device="cpu",
                                                                              **kw),
        }
        for where, call in calls.items():
            rng = torch.get_rng_state()
            with pytest.raises(ValueError, match=f"^{where}: .*{msg}"):
                call(dict(offload_dir=bad, host_memory_limit=big))
            with pytest.raises(ValueError, match=f"^{where}: .*{msg}"):  # checked first, as docs/disk_tier.md says
                call(dict(offload_dir=bad, host_memory_limit="1GB"))
            assert torch.equal(rng, torch.get_rng_state())  # from_config's seed: not applied
    assert getattr(model, "megatrain", None) is None
    # a writable one still works, and the probe leaves nothing behind
    (tmp_path / "tier").mkdir()
    wrapped = kept_wrap(model, device="cpu", offload_dir=str(tmp_path / "tier"), host_memory_limit=big)
    assert wrapped.megatrain.disk is None and os.listdir(tmp_path / "tier") == []


def test_estimate_says_what_wrap_puts_on_disk(tmp_path):
    est = kept_estimate(_config(), device="cpu", offload_dir=str(tmp_path / "tier"), host_memory_limit=_limit())
    assert est.fits and est.disk_layers == 3 and "disk tier" in str(est)
    model = _wrap(tmp_path)
    files = [os.path.join(tmp_path / "tier", n) for n in os.listdir(tmp_path / "tier")]
    assert est.disk_bytes == sum(os.path.getsize(f) for f in files)
    assert est.host_bytes == model.megatrain.offload_plan.host_bytes
    model.megatrain.close()  # the working files go with the tier (a normal exit closes it too)
    assert not (tmp_path / "tier").exists()
    short = kept_estimate(_config(), device="cpu", host_memory_limit=_limit())
    assert not short.fits and "host_memory_limit" in short.reason()


def test_cli_run_with_the_tier_saves_the_model_of_the_run_without(tmp_path, capsys):
    """``megatrain train --offload-dir DIR --host-memory-limit BYTES``: some layers' state on disk, the same model."""
    from safetensors.torch import load_file

    from megatrain.train import run_plan
    from megatrain.train.config_build import build_config
    from parity import run_cli

    argv = ["--set", "model.hidden_size=32", "--set", "model.num_layers=4", "--set", "model.num_heads=2",
            "--set", "model.num_kv_heads=1", "--set", "model.intermediate_size=64", "--set", "data.max_documents=20",
            "--set", "eval.batches=1", "--set", "eval.every=4", "--set", "train.warmup_steps=1",
            "--set", "train.max_grad_norm=1.0", "--seq-len", "32", "--steps", "4", "--micro-batch-size", "2",
            "--gradient-accumulation-steps", "2", "--no-progress", "--set", "log.tensorboard=false"]
    cfg = build_config(overrides=[("model", "hidden_size", 32), ("model", "num_layers", 4), ("model", "num_heads", 2),
                                  ("model", "num_kv_heads", 1), ("model", "intermediate_size", 64),
                                  ("data", "max_documents", 20), ("data", "seq_len", 32),
                                  ("train", "micro_batch_size", 2), ("train", "gradient_accumulation_steps", 2),
                                  ("log", "out", str(tmp_path / "probe"))])
    host = run_plan.prepare(cfg).estimate.host_bytes  # the run's host bytes without a disk tier
    code, out, err = run_cli(["train", "--out", str(tmp_path / "plain")] + argv, capsys)
    assert code == 0, err
    code, out, err = run_cli(["train", "--out", str(tmp_path / "disk"), "--offload-dir", str(tmp_path / "tier"),
                              "--host-memory-limit", str(host - 1), "--host-compute-copy", "true"] + argv, capsys)
    assert code == 0, err
    assert "fp32 state on disk" in out + err
    summary = json.loads((tmp_path / "disk" / "summary.json").read_text())
    assert summary["placement"]["disk_layers"] == [1, 2, 3]
    a = load_file(str(tmp_path / "plain" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "disk" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, out, err = run_cli(["train", "--out", str(tmp_path / "bad"), "--offload-dir", str(tmp_path / "no" / "dir")]
                             + argv, capsys)
    assert code == 2 and "parent of offload_dir" in err and not (tmp_path / "bad").exists()


@pytest.mark.cuda
def test_cuda_bf16_training_with_the_tier_matches_without(tmp_path):
    """On the GPU (bf16 compute, streamed layers, eager updates and clipping): the same run with the
    deepest layers' fp32 state on disk gives the same losses and masters (the CPU-side bits are the
    tier-less path's; the GPU kernels see the same inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(disk):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
        kw = {}
        if disk:
            limit = kept_estimate(m, device="cuda", compute_dtype=torch.bfloat16).host_bytes - 1
            kw = dict(offload_dir=str(tmp_path / "tier"), host_memory_limit=limit)
        return kept_wrap(m, device="cuda", compute_dtype=torch.bfloat16, device_state_layers=0, **kw)

    out = []
    for disk in (False, True):
        for mgn in (None, 1.0):
            model = build(disk)
            opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=mgn)
            losses = []
            for (x,) in make_batches(512, 5, 1, 2, 128, seed=11):
                x = x.cuda()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            st = model.megatrain.stats()
            assert (st.get("disk_layers", 0) == 3) == disk
            out.append((losses, megatrain.master_state_dict(model)))
            model.megatrain.close()
    for (la, pa), (lb, pb) in zip(out[:2], out[2:]):
        for a, b in zip(la, lb):
            assert abs(a - b) <= 1e-3 * abs(a), (la, lb)
        for k in pa:
            cos = torch.nn.functional.cosine_similarity(pa[k].flatten().double(), pb[k].flatten().double(), dim=0)
            assert cos > 0.99999, (k, float(cos))


def test_from_pretrained_and_from_config_fill_the_tier(tmp_path):
    """The streamed loaders write the disk layers' masters through the tier: the same values as without it."""
    src = _model()
    src.save_pretrained(str(tmp_path / "hf"))
    limit = _limit()
    for load in (lambda **kw: kept_from_pretrained(str(tmp_path / "hf"), device="cpu", **kw),
                 lambda **kw: kept_from_config(_config(), seed=4, device="cpu", **kw)):
        plain = load()
        tiered = load(offload_dir=str(tmp_path / "tier"), host_memory_limit=limit)
        assert [u.index for u in tiered.megatrain.disk.units] == [3, 4, 5]
        want, got = megatrain.master_state_dict(plain), megatrain.master_state_dict(tiered)
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        x = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():  # the compute copies were rebuilt from the masters on disk
            assert torch.equal(plain(input_ids=x).logits, tiered(input_ids=x).logits)
        tiered.megatrain.close()


def test_a_second_model_on_a_live_offload_dir_is_refused_until_the_first_is_closed(tmp_path):
    first = _wrap(tmp_path)
    with pytest.raises(_C.DiskTierError, match="in use.*model.megatrain.close"):
        _wrap(tmp_path)
    first.megatrain.close()
    second = _wrap(tmp_path)
    assert second.megatrain.disk is not None


def _wait(cond, what: str, timeout: float = 60.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


@pytest.mark.parametrize("ga", [1, 2])
def test_a_backward_never_reads_state_its_step_already_updated(tmp_path, ga):
    """Forces the interleaving behind the extra reads of a step: the CPU worker has run (and written) every
    disk layer's update before backward hands over the embedding's gradient (the resident unit's last
    hand-over, below every layer). That hand-over must not read the deepest layers' state again (the old
    read-ahead did, for the next step, while this step was still counted: 5 reads of 3 layers), and when
    the worker is drained no read is left in flight."""
    model = _wrap(tmp_path, ga=ga)
    eng = model.megatrain
    n = len(eng.disk.units)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, eps=PARITY_EPS, gradient_accumulation_steps=ga)
    hold = {"on": False, "queued": 0}

    def updates_written(grad):
        if hold["on"]:  # the disk layers' updates queued, run and written before the embedding's hand-over
            _wait(lambda: eng.disk._update_seq >= hold["queued"] + n, "the disk updates queued")
            _wait(lambda: not eng.disk.updates_pending(), "the disk updates")
            eng.disk.flush()
        return grad

    def on_embedding(mod, args, out):
        out.register_hook(updates_written)  # runs once layer 0's backward handed over its gradients

    model.model.embed_tokens.register_forward_hook(on_embedding)
    reads = []
    for k, micro in enumerate(make_batches(VOCAB, 3, ga, 2, 8, seed=4)):
        eng.worker.drain()
        eng.disk.flush()
        before = eng.disk.tier.stats()["unit_reads"]
        for j, x in enumerate(micro):
            hold["on"] = k > 0 and j == ga - 1
            hold["queued"] = eng.disk._update_seq  # disk updates submitted so far
            (model(input_ids=x, labels=x).loss / ga).backward()
        hold["on"] = False
        opt.step()
        opt.zero_grad()
        eng.worker.drain()
        eng.disk.flush()
        in_flight = [u.index for u in eng.disk.units if eng.disk.tier.unit_state(u.disk) == "reading"]
        _wait(lambda: all(eng.disk.tier.unit_state(u.disk) != "reading" for u in eng.disk.units), "the reads")
        reads.append((eng.disk.tier.stats()["unit_reads"] - before, in_flight))
    # per step: (layers read, layers still being read once the worker is drained)
    assert all(r <= n and not f for r, f in reads), reads
