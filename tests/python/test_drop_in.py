"""A wrapped model in existing training scripts: the nn.Module / torch.optim surface they call.

Each script-style test runs the same small script twice, on the unwrapped model with
``torch.optim.AdamW`` and on the wrapped model with ``CPUAdamW`` (the usual three changed lines),
and compares them (CPU, fp32). The scripts follow nanoGPT's train.py (a checkpoint dict of
``model.state_dict()`` / ``optimizer.state_dict()``), transformers' run_clm_no_trainer.py
(accelerate ``save_state`` / ``load_state`` / ``unwrap_model(model).save_pretrained``), run_clm.py
(a plain ``Trainer`` with ``save_steps`` and ``resume_from_checkpoint=True``) and pytorch/examples
word_language_model (``clip_grad_norm_`` each step).
"""

from __future__ import annotations

import copy
import os
import pickle
import warnings

import pytest
import torch
import transformers

import megatrain
from parity import PARITY_EPS, assert_close_rel

RTOL = 1e-5
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.95)


def tiny(tied: bool = True, layers: int = 2):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, num_hidden_layers=layers, max_position_embeddings=64,
                                   tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def batches(n: int, seed: int = 1, batch: int = 2, seq: int = 12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (batch, seq), generator=g) for _ in range(n)]


def make(wrapped: bool, model=None, **opt_kw):
    """The three lines a script changes: the model (wrapped or not) and its AdamW."""
    model = tiny() if model is None else model
    kw = dict(lr=LR, betas=BETAS, weight_decay=WD, eps=PARITY_EPS)
    if wrapped:
        model = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
        return model, megatrain.optim.CPUAdamW(model.parameters(), **kw, **opt_kw)
    opt_kw.pop("max_grad_norm", None)
    return model, torch.optim.AdamW(model.parameters(), **kw, foreach=False)


def weights(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_params_close(got: dict, ref: dict, rtol: float = RTOL):
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert got[k].device.type == "cpu" and got[k].dtype == v.dtype, k
        assert_close_rel(got[k], v, rtol, k)


def train_steps(model, opt, data, clip=None):
    losses, norms = [], []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


# ---------------------------------------------------------------------------- nanoGPT-style checkpoint dict
def nanogpt_script(wrapped: bool, path: str):
    """Train 3 steps, torch.save({'model': ..., 'optimizer': ...}), train 3 more; then a fresh
    model resumes from the file (load_state_dict on model and optimizer) and trains the same 3."""
    data = batches(6)
    model, opt = make(wrapped)
    train_steps(model, opt, data[:3])
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 3}, path)
    cont, _ = train_steps(model, opt, data[3:])
    continued = weights(model)

    ck = torch.load(path, weights_only=True)
    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # another init: everything must come from the checkpoint
    model2, opt2 = make(wrapped, fresh)
    load = model2.load_state_dict(ck["model"])
    opt2.load_state_dict(copy.deepcopy(ck["optimizer"]))  # torch's AdamW keeps (and steps) the loaded tensors
    resumed_losses, _ = train_steps(model2, opt2, data[3:])
    return ck, continued, weights(model2), cont, resumed_losses, load


def test_nanogpt_checkpoint_dict_saves_loads_and_resumes(tmp_path):
    ref = nanogpt_script(False, str(tmp_path / "ref.pt"))
    got = nanogpt_script(True, str(tmp_path / "mt.pt"))
    ref_ck, got_ck = ref[0], got[0]
    # the checkpoint holds every tensor with data, keys exactly as the unwrapped model's (tied lm_head too)
    assert list(got_ck["model"]) == list(ref_ck["model"])
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in got_ck["model"].values())
    assert_params_close(got_ck["model"], ref_ck["model"])
    assert got_ck["optimizer"]["param_groups"][0]["params"] == ref_ck["optimizer"]["param_groups"][0]["params"]
    for pid, st in ref_ck["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close_rel(got_ck["optimizer"]["state"][pid][k], st[k], 1e-4, f"{pid}.{k}")
        assert float(got_ck["optimizer"]["state"][pid]["step"]) == float(st["step"]) == 3.0
    assert str(got[5]) == str(ref[5]) == "<All keys matched successfully>"
    # resumed == continued (bit for bit on the CPU), and both match the unwrapped script
    assert got[4] == got[3]
    for k, v in got[1].items():
        assert torch.equal(got[2][k], v), k
    assert_params_close(got[2], ref[2])


# ---------------------------------------------------------------------------- accelerate loop
def accelerate_script(wrapped: bool, out: str):
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    set_seed(3)
    data = batches(5)
    acc = Accelerator(cpu=True)
    model, opt = make(wrapped)
    model, opt = acc.prepare(model, opt)
    for x in data[:3]:
        acc.backward(model(input_ids=x, labels=x).loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(os.path.join(out, "state"))
    cont = []
    for x in data[3:]:
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        cont.append(loss.item())
    continued = weights(model)
    acc.wait_for_everyone()
    acc.unwrap_model(model).save_pretrained(os.path.join(out, "final"), save_function=acc.save)

    fresh = tiny()
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)
    model2, opt2 = make(wrapped, fresh)
    acc = Accelerator(cpu=True)  # as a new process would
    model2, opt2 = acc.prepare(model2, opt2)
    acc.load_state(os.path.join(out, "state"))
    resumed = []
    for x in data[3:]:
        loss = model2(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt2.step()
        opt2.zero_grad()
        resumed.append(loss.item())
    final = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"))
    return continued, weights(model2), cont, resumed, weights(final)


def test_accelerate_save_state_load_state_and_save_pretrained(tmp_path):
    ref = accelerate_script(False, str(tmp_path / "ref"))
    got = accelerate_script(True, str(tmp_path / "mt"))
    assert got[3] == got[2]
    for k, v in got[0].items():
        assert torch.equal(got[1][k], v), k  # resumed from save_state == continued
    assert_params_close(got[1], ref[1])
    # unwrap_model(model).save_pretrained wrote the trained fp32 weights, reloadable as a plain model
    for k, v in got[0].items():
        assert torch.equal(got[4][k], v), k
    assert_params_close(got[4], ref[4])
    assert sorted(os.listdir(tmp_path / "mt" / "final")) == sorted(os.listdir(tmp_path / "ref" / "final"))


# ---------------------------------------------------------------------------- plain HF Trainer
def trainer_script(wrapped: bool, out: str, resume: bool):
    from megatrain.integrations import MegatrainCallback

    model = tiny()
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6, learning_rate=5e-3,
        weight_decay=0.1, max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="steps", save_steps=3, seed=7, dataloader_num_workers=0,
        disable_tqdm=True, adam_epsilon=PARITY_EPS)
    g = torch.Generator().manual_seed(1)
    ds = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, 96, (48, 12), generator=g)]
    if wrapped:
        model = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=5e-3, weight_decay=0.1, eps=PARITY_EPS,
                                       max_grad_norm=1.0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1, eps=PARITY_EPS, foreach=False)
    sched = transformers.get_cosine_schedule_with_warmup(opt, 2, 6)
    tr = transformers.Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, sched),
                              callbacks=[MegatrainCallback()] if wrapped else [])
    if resume:
        # a fresh run over the output directory: resume from its last checkpoint (checkpoint-3)
        import shutil

        shutil.rmtree(os.path.join(out, "checkpoint-6"))
        tr.train(resume_from_checkpoint=True)
    else:
        tr.train()
    logs = [(h["loss"], h.get("grad_norm")) for h in tr.state.log_history if "loss" in h]
    return weights(tr.model), logs


def test_plain_trainer_with_callback_saves_and_resumes_exactly(tmp_path):
    ref_full, ref_logs = trainer_script(False, str(tmp_path / "ref"), resume=False)
    full, logs = trainer_script(True, str(tmp_path / "mt"), resume=False)
    assert sorted(os.listdir(tmp_path / "mt")) == sorted(os.listdir(tmp_path / "ref"))
    ck = tmp_path / "mt" / "checkpoint-3"
    assert sorted(os.listdir(ck)) == sorted(os.listdir(tmp_path / "ref" / "checkpoint-3"))
    assert_params_close(full, ref_full)
    assert len(logs) == len(ref_logs) == 6
    for (l, n), (rl, rn) in zip(logs, ref_logs):
        assert l == pytest.approx(rl, rel=1e-5, abs=1e-4) and n == pytest.approx(rn, rel=1e-4)
    assert any(n > 1.0 for _, n in logs), "clipping was not exercised"
    resumed, rlogs = trainer_script(True, str(tmp_path / "mt"), resume=True)
    for k, v in full.items():
        assert torch.equal(resumed[k], v), k
    assert rlogs[-3:] == logs[-3:]


# ---------------------------------------------------------------------------- clip_grad_norm_ loop
@pytest.mark.parametrize("opt_mgn,clip", [(0.5, 0.5), (float("inf"), 0.5), (0.3, 0.5)],
                         ids=["same-as-optimizer", "clip-only-by-user", "optimizer-clips-again"])
def test_plain_loop_clip_grad_norm_matches_torch(opt_mgn, clip):
    data = batches(6)
    model, opt = make(False, tiny(tied=False))
    ref_losses, ref_norms = [], []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if opt_mgn < clip:  # what CPUAdamW(max_grad_norm) adds: a second clip of the clipped gradient
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_mgn)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref = weights(model)

    wmodel, wopt = make(True, tiny(tied=False), max_grad_norm=opt_mgn)
    losses, norms = train_steps(wmodel, wopt, data, clip=clip)
    assert all(n > clip for n in ref_norms), "clipping was not exercised"
    for a, b in zip(norms, ref_norms):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip(losses, ref_losses):
        assert a == pytest.approx(b, rel=1e-5)
    # Two clips of one gradient (optimizer-clips-again) round twice in fp32; Adam (eps 1e-6) enlarges
    # that for embedding rows whose gradient is near eps: 2.0e-6 absolute after 6 steps with
    # transformers 5.24 (1e-5 of the tensor's largest value is 1.0e-6 there), so 3e-5 here.
    assert_params_close(weights(wmodel), ref, rtol=3e-5 if opt_mgn < clip else RTOL)


@pytest.mark.parametrize("opt_mgn", [0.5, float("inf"), 0.3], ids=["same-as-user", "only-user-clips", "clips-again"])
def test_last_grad_norm_is_the_norm_before_any_clip_after_a_user_clip_grad_norm(opt_mgn):
    """``CPUAdamW.last_grad_norm`` is what ``clip_grad_norm_`` returned (the norm before any clipping,
    the HF Trainer's ``grad_norm``), not the norm after the caller's clip; with no clip call it is
    the same norm; a second ``clip_grad_norm_`` in one step changes it no more than the first."""
    data = batches(4)
    model, opt = make(True, tiny(tied=False), max_grad_norm=opt_mgn)
    ref_model = tiny(tied=False)
    seen = []
    for k, x in enumerate(data):
        model(input_ids=x, labels=x).loss.backward()
        ref_model(input_ids=x, labels=x).loss.backward()
        ref = float(torch.nn.utils.clip_grad_norm_(ref_model.parameters(), float("inf")))
        ref_model.zero_grad()
        if k % 2:
            total = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
            again = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))  # the clipped gradient's norm
            assert total == pytest.approx(ref, rel=1e-5) and again == pytest.approx(0.5, rel=1e-5)
        opt.step()
        opt.zero_grad()
        ref_model.load_state_dict(weights(model))  # the next reference norm is taken at the same weights
        seen.append((opt.last_grad_norm, ref))
    assert all(r > 0.5 for _, r in seen), "clipping was not exercised"
    for got, ref in seen:
        assert got == pytest.approx(ref, rel=1e-5)


def test_clip_grad_norm_without_max_grad_norm_is_refused_at_once():
    model, opt = make(True)
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match=r"CPUAdamW\(\.\.\., max_grad_norm=\.\.\.\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="norm_type=2 only"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    # other tensors still go to torch's own function
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    assert float(torch.nn.utils.clip_grad_norm_([p], 1.0)) == pytest.approx(12 ** 0.5)


# ---------------------------------------------------------------------------- state_dict / load_state_dict
def test_state_dict_is_zero_copy_masters_with_torch_keys():
    ref = tiny()
    model = megatrain.wrap(copy.deepcopy(ref), device="cpu")
    sd, rsd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(rsd)
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]  # tied: one tensor, as torch
    for k, v in rsd.items():
        assert torch.equal(sd[k], v), k
    eng = model.megatrain
    u = eng.layers[0]
    assert sd[u.entries[0].name].data_ptr() == eng.entry_view(u, 0, "master").data_ptr()  # no copy
    # a submodule's state_dict as well
    sub = model.model.layers[1].state_dict()
    assert list(sub) == list(ref.model.layers[1].state_dict())
    assert all(torch.equal(v, ref.model.layers[1].state_dict()[k]) for k, v in sub.items())


@pytest.mark.parametrize("placement", [{}, dict(device_state_layers="auto")])
def test_in_place_write_to_a_resident_parameter_is_refused_and_load_state_dict_is_the_way(placement):
    """``model.lm_head.weight.mul_(3)`` after wrap would change only the compute copy (not the fp32
    master): the next forward and any state read raise, naming load_state_dict; that works after."""
    model = megatrain.wrap(tiny(tied=False), device="cpu", compute_dtype=torch.float32, **placement)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=LR)
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    before = model.state_dict()["lm_head.weight"].clone()
    with torch.no_grad():
        model.lm_head.weight.mul_(3)
    with pytest.raises(RuntimeError, match=r"lm_head.weight was modified in place after megatrain.wrap.*load_state_dict"):
        model(input_ids=x, labels=x)
    with pytest.raises(RuntimeError, match="modified in place"):
        model.state_dict()
    model.load_state_dict({"lm_head.weight": before * 3}, strict=False)  # the supported way
    assert torch.equal(model.state_dict()["lm_head.weight"], before * 3)
    assert torch.equal(model.lm_head.weight.detach(), before * 3)
    model(input_ids=x, labels=x).loss.backward()  # trains on
    opt.step()


@pytest.mark.parametrize("placement", [{}, dict(device_state_layers=1), dict(device_state_layers="auto")])
def test_in_place_writes_into_state_dict_tensors_change_the_model_as_in_torch(placement):
    """``model.state_dict()[k].mul_(3)`` changes the parameter in torch; on a wrapped model it changes
    the fp32 master and the next forward uses it (layer on the host or on the device, resident unit)."""
    data = batches(3)
    ref, ropt = make(False, model=tiny(tied=False))
    model = megatrain.wrap(tiny(tied=False), device="cpu", compute_dtype=torch.float32, **placement)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=PARITY_EPS,
                                   max_grad_norm=1.0)
    keys = ("model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight")
    for step, x in enumerate(data):
        if step == 1:
            for sd in (model.state_dict(), ref.state_dict()):
                with torch.no_grad():
                    for k in keys:
                        sd[k].mul_(3)
        losses = []
        for m, o in ((model, opt), (ref, ropt)):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            if m is ref:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 1e-5 * abs(losses[1]), (step, losses)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert_close_rel(got[k], v, RTOL, k)


def test_a_write_through_a_stale_state_dict_tensor_of_a_device_state_unit_is_refused():
    """A state dict held across ``step()`` is refreshed by it (a write through it is taken); a
    ``.detach()`` of one kept without its state dict is not, and a write through it is refused."""
    model = megatrain.wrap(tiny(tied=False), device="cpu", device_state_layers=1)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    key = "model.layers.0.mlp.up_proj.weight"
    sd = model.state_dict()
    stale = model.state_dict()[key].detach()  # its state dict dropped: not refreshed by step()
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with torch.no_grad():
        sd[key].mul_(3)  # held through the step: the current master
    model(input_ids=x, labels=x)
    assert torch.equal(megatrain.master_state_dict(model)[key], sd[key])
    del sd
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with torch.no_grad():
        stale.mul_(3)  # an older master
    with pytest.raises(RuntimeError, match=r"state_dict\(\) tensor holding an older master"):
        model(input_ids=x, labels=x)


def test_load_state_dict_strict_and_non_strict_like_torch():
    ref = tiny()
    model = megatrain.wrap(tiny(), device="cpu")
    target = {k: v + 0.25 for k, v in ref.state_dict().items()}
    target["lm_head.weight"] = target["model.embed_tokens.weight"]
    before = weights(model)
    # strict: missing and unexpected keys refused with torch's message, nothing written
    bad = {k: v for k, v in target.items() if "layers.1.mlp" not in k}
    bad["extra.weight"] = torch.zeros(2)
    with pytest.raises(RuntimeError) as got:
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError) as want:
        copy.deepcopy(ref).load_state_dict(bad)
    assert str(got.value) == str(want.value)
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    # shape mismatch: torch's message, nothing written
    wrong = dict(target)
    wrong["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError) as got:
        model.load_state_dict(wrong, strict=False)
    with pytest.raises(RuntimeError) as want:
        copy.deepcopy(ref).load_state_dict(wrong, strict=False)
    assert str(got.value) == str(want.value)
    assert torch.equal(model.state_dict()["model.norm.weight"], before["model.norm.weight"])
    # non-strict: the same return value as torch; the present keys are written (masters + compute copy)
    r = model.load_state_dict(bad, strict=False)
    r_ref = copy.deepcopy(ref).load_state_dict(bad, strict=False)
    assert r.missing_keys == r_ref.missing_keys and r.unexpected_keys == r_ref.unexpected_keys
    assert torch.equal(model.state_dict()["model.layers.0.mlp.up_proj.weight"],
                       target["model.layers.0.mlp.up_proj.weight"])
    r = model.load_state_dict(target)
    assert str(r) == "<All keys matched successfully>"
    ref.load_state_dict(target)
    x = batches(1)[0]
    with torch.no_grad():  # the forward uses the loaded weights (layers streamed, resident buffer refreshed)
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    with pytest.raises(ValueError, match="assign=False"):
        model.load_state_dict(target, assign=True)


def test_load_state_dict_waits_for_updates_in_flight_and_training_continues_from_it():
    data = batches(4)
    ref, ropt = make(False)
    model, opt = make(True)
    train_steps(ref, ropt, data[:2])
    train_steps(model, opt, data[:2])
    snap = weights(ref)
    x = data[2]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # its updates may still run on the worker
    model.load_state_dict(snap)  # must land after them, not be overwritten by them
    for k, v in snap.items():
        assert torch.equal(model.state_dict()[k], v), k


# ---------------------------------------------------------------------------- save_pretrained / export
def test_save_pretrained_into_existing_dir_sharded_and_reloads(tmp_path):
    model, opt = make(True)
    train_steps(model, opt, batches(2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("mine")
    model.save_pretrained(str(out), max_shard_size="20KB")
    names = sorted(os.listdir(out))
    assert "README.md" in names and "model.safetensors.index.json" in names
    assert sum(n.startswith("model-") for n in names) > 1
    import json

    cfg = json.load(open(out / "config.json"))
    assert cfg["dtype"] == "float32" and cfg["use_cache"] is True
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    sd = model.state_dict()
    for k, v in back.state_dict().items():
        assert torch.equal(v, sd[k]), k
    model.save_pretrained(str(tmp_path / "pt"), safe_serialization=False) if "safe_serialization" in \
        transformers.PreTrainedModel.save_pretrained.__code__.co_varnames else None


def test_export_pretrained_keeps_the_runs_checkpoint_folders(tmp_path):
    model, _ = make(True)
    out = tmp_path / "run"
    (out / "checkpoint-500").mkdir(parents=True)
    (out / "checkpoint-500" / "trainer_state.json").write_text("{}")
    megatrain.export_pretrained(model, str(out))
    megatrain.export_pretrained(model, str(out))  # again: replaces its own files, keeps the checkpoints
    assert sorted(os.listdir(out)) == ["checkpoint-500", "config.json", "generation_config.json", "model.safetensors"]
    assert (out / "checkpoint-500" / "trainer_state.json").read_text() == "{}"
    (out / "notes.txt").write_text("foreign")
    with pytest.raises(ValueError, match="not empty"):
        megatrain.export_pretrained(model, str(out))
    assert (out / "notes.txt").read_text() == "foreign"


def test_pickling_a_wrapped_model_is_refused_naming_save_checkpoint(tmp_path):
    model, _ = make(True)
    for f in (lambda: torch.save(model, str(tmp_path / "m.pt")), lambda: copy.deepcopy(model),
              lambda: pickle.dumps(model)):
        with pytest.raises(TypeError, match=r"megatrain\.save_checkpoint"):
            f()
    torch.save(model.state_dict(), str(tmp_path / "sd.pt"))  # the way that works
    assert torch.load(str(tmp_path / "sd.pt"), weights_only=True).keys() == model.state_dict().keys()


@pytest.mark.parametrize("cast", ["half", "bf16", "lm_head", "meta"])
def test_changing_dtype_or_device_is_refused_before_any_tensor_changes(cast):
    model, opt = make(True)
    x = batches(1)[0]
    with torch.no_grad():
        before = model(x).logits
    f = {"half": lambda: model.half(), "bf16": lambda: model.to(torch.bfloat16),
         "lm_head": lambda: model.lm_head.half(), "meta": lambda: model.to("meta")}[cast]
    with pytest.raises(TypeError, match=r"megatrain\.wrap\(model, compute_dtype="):
        f()
    model.to("cpu").float()  # what the Trainer / accelerate call: no change, allowed
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)
    model.train()
    model(input_ids=x, labels=x).loss.backward()  # still trains
    opt.step()

def test_resize_token_embeddings_after_wrap_is_refused_naming_resize_then_wrap():
    model, _ = make(True)
    before = weights(model)
    for f in (lambda: model.resize_token_embeddings(120), lambda: model.model.resize_token_embeddings(120),
              lambda: model.set_input_embeddings(torch.nn.Embedding(120, 32))):
        with pytest.raises(RuntimeError, match=r"resize first, then wrap"):
            f()
    assert model.get_input_embeddings().weight.shape[0] == 96
    assert_params_close(weights(model), before, rtol=0.0)

def test_an_optimizer_replaced_by_a_newer_cpu_adamw_refuses_to_step():
    # The newer CPUAdamW receives the gradients and runs the updates with its own settings: stepping
    # the old one trained with the new one's lr (silently). Notebook re-runs use the newest: that works.
    model, old = make(True, max_grad_norm=1.0)
    new = megatrain.optim.CPUAdamW(model.parameters(), lr=0.5, max_grad_norm=1.0)
    x = batches(1)[0]
    model.train()
    model(input_ids=x, labels=x).loss.backward()
    before = weights(model)
    for f in (old.step, old.zero_grad):
        with pytest.raises(RuntimeError, match=r"newer CPUAdamW for the same model"):
            f()
    assert_params_close(weights(model), before, rtol=0.0)
    new.step()
    new.zero_grad()
    assert any(not torch.equal(v, before[k]) for k, v in weights(model).items())

def test_load_checkpoint_keeps_the_callers_max_grad_norm(tmp_path):
    model, opt = make(True, max_grad_norm=0.5)
    train_steps(model, opt, batches(1))
    megatrain.save_checkpoint(str(tmp_path / "ck"), model, opt)
    model2, opt2 = make(True)
    with pytest.warns(UserWarning, match="max_grad_norm=0.5"):
        megatrain.load_checkpoint(str(tmp_path / "ck"), model2, opt2)
    assert opt2.max_grad_norm is None


# ---------------------------------------------------------------------------- optimizer semantics
def test_add_param_group_trains_the_new_group_like_torch():
    # eps 1e-5: the new group's first update starts from gradients that follow two steps of trained
    # layers; where |grad| ~ eps, Adam turns fp32 summation noise into visible update differences.
    def run(wrapped):
        model = tiny(tied=False)
        if wrapped:
            model = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32)
        layers = [p for n, p in model.named_parameters() if ".layers." in n]
        rest = [p for n, p in model.named_parameters() if ".layers." not in n]
        if wrapped:
            opt = megatrain.optim.CPUAdamW(layers, lr=1e-3, betas=BETAS, weight_decay=WD, eps=1e-5)
        else:
            opt = torch.optim.AdamW(layers, lr=1e-3, betas=BETAS, weight_decay=WD, eps=1e-5, foreach=False)
        for i, x in enumerate(batches(5)):
            if i == 2:
                opt.add_param_group({"params": rest, "lr": 2e-3, "weight_decay": 0.0})
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            model.zero_grad()  # also the parameters outside the optimizer (as the HF Trainer does)
        return weights(model), opt

    ref, ropt = run(False)
    got, gopt = run(True)
    assert len(gopt.param_groups) == 2 and gopt.param_groups[1]["lr"] == 2e-3
    assert_params_close(got, ref)
    assert not torch.equal(got["lm_head.weight"], tiny(tied=False).state_dict()["lm_head.weight"])


def test_zero_grad_set_to_none_false_then_steps_without_backward_like_torch():
    def run(wrapped):
        model, opt = make(wrapped)
        for i, x in enumerate(batches(6)):
            if i not in (2, 4):  # steps 2 and 4: no backward, the zero gradients still step
                model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return weights(model), opt

    ref, ropt = run(False)
    got, gopt = run(True)
    assert_params_close(got, ref)
    p_ref, p_got = next(iter(ropt.state)), next(iter(gopt.state))
    assert float(gopt.state[p_got]["step"]) == float(ropt.state[p_ref]["step"]) == 6.0


@pytest.mark.parametrize("device_state_layers", [0, 2])
def test_zero_grad_set_to_none_false_after_backward_then_step_is_a_zero_gradient_step_like_torch(device_state_layers):
    """backward(), zero_grad(set_to_none=False), step(): torch steps every parameter that held a gradient
    with zeros (step count, moment decay, weight decay); the gradients of that backward count as held,
    with the state in the host store and on the device alike."""
    def run(wrapped):
        model = tiny()
        if wrapped:
            model = megatrain.wrap(model, device="cpu", compute_dtype=torch.float32,
                                   device_state_layers=device_state_layers)
        kw = dict(lr=LR, betas=BETAS, weight_decay=WD, eps=PARITY_EPS)
        opt = (megatrain.optim.CPUAdamW(model.parameters(), **kw, max_grad_norm=1e9) if wrapped
               else torch.optim.AdamW(model.parameters(), **kw, foreach=False))
        for i, x in enumerate(batches(3)):
            model(input_ids=x, labels=x).loss.backward()
            if i == 1:
                opt.zero_grad(set_to_none=False)
            opt.step()
            opt.zero_grad()
        steps = {float(opt.state[p]["step"]) for p in model.parameters() if p.requires_grad}
        return weights(model), steps

    ref, ref_steps = run(False)
    got, got_steps = run(True)
    assert ref_steps == got_steps == {3.0}
    assert_params_close(got, ref)


def test_zero_gradient_step_while_the_last_steps_updates_are_still_queued():
    """step() with no forward since the last step(): the last step's CPU updates may still be queued (a
    busy worker); the new update of a unit waits for them instead of failing in the gradient ledger."""
    import threading

    from megatrain.runtime.engine.worker import _Worker

    def run(wrapped):
        model, opt = make(wrapped, max_grad_norm=1.0)  # updates wait for step(): step() queues every unit's
        for i, x in enumerate(batches(3)):
            if i != 1:
                model(input_ids=x, labels=x).loss.backward()
            if wrapped and i == 0:  # hold the CPU worker: step 0's updates stay queued through step 1
                release = threading.Event()
                model.megatrain.worker.submit(lambda: release.wait(30), klass=_Worker.UPDATE)
                threading.Timer(0.5, release.set).start()
            opt.step()
            opt.zero_grad(set_to_none=False)
        return weights(model)

    ref_model, ref_opt = make(False)
    for i, x in enumerate(batches(3)):
        if i != 1:
            ref_model(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
    assert_params_close(run(True), weights(ref_model))


def test_second_step_without_backward_is_refused_before_anything_changes():
    model, opt = make(True)
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    before = weights(model)
    steps = [float(s["step"]) for s in opt.state.values()]
    with pytest.raises(RuntimeError, match="step\\(\\) again without a backward"):
        opt.step()
    assert [float(s["step"]) for s in opt.state.values()] == steps
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    opt.zero_grad()
    opt.step()  # after zero_grad (set_to_none): no gradients, nothing to do, as torch
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("kw", [dict(amsgrad=True), dict(maximize=True), dict(differentiable=True)])
def test_unimplemented_adamw_options_are_refused(kw):
    model = megatrain.wrap(tiny(), device="cpu")
    name = next(iter(kw))
    with pytest.raises(ValueError, match=f"{name}=True"):
        megatrain.optim.CPUAdamW(model.parameters(), **kw)
    opt = megatrain.optim.CPUAdamW(list(model.parameters())[:1])
    with pytest.raises(ValueError, match=f"{name}=True"):
        opt.add_param_group({"params": list(model.parameters())[1:], **kw})


def test_param_groups_carry_torch_adamws_keys_and_refuse_an_l2_penalty():
    """Every key of torch.optim.AdamW's param groups is in CPUAdamW's (scripts and schedulers read them);
    a group with decoupled_weight_decay=False (torch.optim.Adam's L2 penalty) is refused, not run as AdamW."""
    model = megatrain.wrap(tiny(), device="cpu")
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    opt = megatrain.optim.CPUAdamW(list(model.parameters())[:1])
    assert set(ref.param_groups[0]) <= set(opt.param_groups[0])
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        opt.add_param_group({"params": list(model.parameters())[1:], "decoupled_weight_decay": False})
    assert len(opt.param_groups) == 1


def test_a_tensor_lr_trains_as_the_same_float_lr_with_a_scheduler():
    """torch.optim.AdamW takes ``lr=torch.tensor(...)``; so does CPUAdamW (StepLR scales it in place)."""
    data = batches(3)
    runs = []
    for lr in (LR, torch.tensor(LR)):
        model = megatrain.wrap(tiny(), device="cpu", compute_dtype=torch.float32)
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WD, eps=PARITY_EPS)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
        for x in data:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        runs.append(weights(model))
    for k, v in runs[0].items():
        assert torch.equal(runs[1][k], v), k


def test_implementation_selectors_are_accepted_with_identical_results():
    data = batches(3)
    a, oa = make(True)
    train_steps(a, oa, data)
    model = megatrain.wrap(tiny(), device="cpu", compute_dtype=torch.float32)
    ob = megatrain.optim.CPUAdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, eps=PARITY_EPS,
                                  foreach=True, fused=False, capturable=False, amsgrad=False, maximize=False)
    train_steps(model, ob, data)
    for k, v in weights(a).items():
        assert torch.equal(weights(model)[k], v), k


def test_optimizer_state_read_right_after_step_shows_the_new_moments():
    import time

    from megatrain.runtime.engine.worker import _Worker

    x = batches(1)[0]
    ref, ropt = make(False)
    ref(input_ids=x, labels=x).loss.backward()
    ropt.step()
    model, opt = make(True)
    model(input_ids=x, labels=x).loss.backward()
    # an update task that runs before the ones step() queues (smallest key): they are still queued
    # when the state is read below
    model.megatrain.worker.submit(lambda: time.sleep(0.05), _Worker.UPDATE, -1)
    opt.step()
    p_ref = ref.model.layers[1].mlp.down_proj.weight
    p = model.model.layers[1].mlp.down_proj.weight
    got = opt.state[p]["exp_avg"].clone()  # read at once: waits for the update in flight
    assert float(opt.state[p]["step"]) == 1.0
    assert_close_rel(got, ropt.state[p_ref]["exp_avg"], 1e-5, "exp_avg")
    sd = opt.state_dict()
    assert type(sd["state"][0]) is dict
    back = torch.load(_roundtrip(sd), weights_only=True)["state"]
    assert [tuple(back[i]["exp_avg"].shape) for i in range(len(back))] == [tuple(q.shape) for q in model.parameters()]


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.mark.cuda
def test_cuda_bf16_state_dict_load_state_dict_clip_and_save_pretrained(tmp_path):
    """On the GPU (bf16 compute copy): state_dict gives the fp32 masters, load_state_dict refreshes the
    streamed layers and the resident device buffer, clip_grad_norm_ returns the global norm."""
    if megatrain.cuda_status() != "ok":
        pytest.skip(megatrain.cuda_status())
    ref = tiny()
    model = megatrain.wrap(copy.deepcopy(ref), device="cuda")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    sd = model.state_dict()
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in sd.values())
    x = batches(1)[0].cuda()
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    rl = ref(input_ids=x.cpu(), labels=x.cpu()).loss
    rl.backward()
    rtotal = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert float(total) == pytest.approx(float(rtotal), rel=2e-2)  # bf16 compute
    opt.step()
    opt.zero_grad()
    model.load_state_dict(ref.state_dict())
    assert torch.equal(model.lm_head.weight.float().cpu(), ref.lm_head.weight.detach().bfloat16().float())
    with torch.no_grad():
        got = model(input_ids=x).logits.float().cpu()
        want = ref(input_ids=x.cpu()).logits
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999
    model.save_pretrained(str(tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_a_wrapped_model_that_is_dropped_frees_its_engine_and_host_store(close):
    """As any nn.Module: once the script drops the model and its optimizer (a notebook cell run again,
    a sweep building one model after another), the engine and its host store are freed. The resident
    parameters' gradient hooks held the engine where the garbage collector does not look, so every
    wrapped model stayed in host memory (its whole store) until the process ended."""
    import gc
    import weakref

    model = megatrain.wrap(tiny(tied=False), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
    x = torch.randint(0, 96, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    eng = model.megatrain
    refs = [weakref.ref(o) for o in (model, eng, eng.store)]
    if close:
        eng.close()
    del model, opt, eng
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


@pytest.mark.parametrize("opt_mgn,clip,warns", [(0.3, 0.5, True), (0.5, 0.5, False), (0.5, 0.3, False),
                                                (0.3, float("inf"), False)],
                         ids=["optimizer-stricter", "same", "user-stricter", "norm-only"])
def test_clip_grad_norm_looser_than_max_grad_norm_warns_once(opt_mgn, clip, warns):
    """clip_grad_norm_(max_norm) with CPUAdamW(max_grad_norm) smaller: the optimizer clips again (a torch.optim.AdamW
    script would clip to max_norm only), so it warns once per model; the same or a stricter max_norm, or inf (the
    Trainer's way to read the norm), does not."""
    import warnings as w

    model, opt = make(True, tiny(tied=False), max_grad_norm=opt_mgn)
    with w.catch_warnings(record=True) as seen:
        w.simplefilter("always")
        for x in batches(2):
            model(input_ids=x, labels=x).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    ours = [str(s.message) for s in seen if "both apply" in str(s.message)]
    assert len(ours) == (1 if warns else 0), ours
    if warns:
        assert ours[0].startswith(f"megatrain: clip_grad_norm_(max_norm={clip:g}) on a model whose CPUAdamW clips at "
                                  f"max_grad_norm={opt_mgn:g}")
