"""Hugging Face Trainer + megatrain: parity with the plain Trainer (AdamW, accumulation, clipping),
bit-exact resume from a Trainer checkpoint in a fresh process, save_model, megatrain log keys.

This file is also the worker script for the subprocess runs (``python test_hf_trainer.py MODE ...``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import megatrain

pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")

HERE = os.path.abspath(__file__)
STEPS = 10


def _model(dropout: float = 0.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      attention_dropout=dropout, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _dataset(n: int = 48, seq: int = 12):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 96, (n, seq), generator=g)
    return [{"input_ids": x, "labels": x.clone()} for x in data]


def _args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=STEPS,
                learning_rate=5e-3, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.1,
                max_grad_norm=1.0, lr_scheduler_type="cosine", warmup_steps=2, logging_steps=1, report_to=[],
                use_cpu=True, save_strategy="no", seed=7, dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


class _LossRecorder:
    """Forward hook recording every training micro-batch loss (exact, unlike the rounded logged loss)."""

    def __init__(self, model):
        self.losses = []
        model.register_forward_hook(self._hook)

    def _hook(self, module, args, out):
        if module.training and getattr(out, "loss", None) is not None:
            self.losses.append(out.loss.item())


class _LogRecorder:
    def __new__(cls):
        from transformers import TrainerCallback

        class R(TrainerCallback):
            def __init__(self):
                self.logs = []

            def on_log(self, args, state, control, logs=None, **kw):
                self.logs.append(dict(logs or {}))

        return R()


def _megatrain_trainer(out, model=None, dropout=0.0, **kw):
    import megatrain
    from megatrain.integrations import MegatrainTrainer

    model = megatrain.wrap(model if model is not None else _model(dropout), device="cpu",
                           compute_dtype=torch.float32)
    rec = _LossRecorder(model)
    logs = _LogRecorder()
    tr = MegatrainTrainer(model=model, args=_args(out, **kw), train_dataset=_dataset(), callbacks=[logs])
    return tr, rec, logs


# ---------------------------------------------------------------------------- worker side
def _worker(argv):
    import megatrain

    mode, out, dump = argv
    if mode == "full":
        tr, rec, _ = _megatrain_trainer(out, dropout=0.1, save_strategy="steps", save_steps=5)
        tr.train()
    elif mode == "resume":
        torch.manual_seed(1234)
        from transformers import LlamaConfig  # noqa: F401 - a different init must not matter
        model = _model(0.1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        tr, rec, _ = _megatrain_trainer(out, model=model, save_strategy="steps", save_steps=5)
        tr.train(resume_from_checkpoint=os.path.join(out, "checkpoint-5"))
    elif mode == "dp":  # under torchrun: N processes x 1 row per micro-batch
        from megatrain.integrations import MegatrainTrainer

        from parity import PARITY_EPS

        args = _args(out, per_device_train_batch_size=1, save_strategy="steps", save_steps=5, adam_epsilon=PARITY_EPS)
        assert args.device.type == "cpu"  # sets up torch.distributed (accelerate's state) before megatrain.wrap
        model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
        rec = _LossRecorder(model)
        tr = MegatrainTrainer(model=model, args=args, train_dataset=_dataset())
        tr.train()
        dump = dump.replace(".pt", f"{args.process_index}.pt")
    else:
        raise SystemExit(mode)
    torch.save({"losses": rec.losses, "params": megatrain.master_state_dict(tr.model)}, dump)


# ---------------------------------------------------------------------------- test side
@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip", "noclip-eager"])
def test_trainer_parity_with_plain_trainer(tmp_path, max_grad_norm):
    import megatrain
    from transformers import Trainer

    plain_model = _model()
    plain_rec = _LossRecorder(plain_model)
    plain = Trainer(model=plain_model, args=_args(str(tmp_path / "plain"), max_grad_norm=max_grad_norm),
                    train_dataset=_dataset())
    plain.train()

    tr, rec, logs = _megatrain_trainer(str(tmp_path / "mt"), max_grad_norm=max_grad_norm)
    tr.train()

    assert len(plain_rec.losses) == len(rec.losses) == STEPS * 2
    for i, (a, b) in enumerate(zip(plain_rec.losses, rec.losses)):
        assert abs(a - b) <= 1e-5 * abs(a), (i, a, b)
    plain_logs = [h for h in plain.state.log_history if "loss" in h]
    mt_logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(plain_logs) == len(mt_logs) == STEPS
    for a, b in zip(plain_logs, mt_logs):
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-12)
        if max_grad_norm:  # without clipping CPUAdamW does not compute the global norm (eager updates)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-4)
    # The Trainer's clip is skipped; CPUAdamW clips with the Trainer's max_grad_norm.
    opt = megatrain.integrations.hf_trainer._unwrap_optimizer(tr.optimizer)
    assert opt.max_grad_norm == (max_grad_norm or None)
    if max_grad_norm:
        assert any(h["grad_norm"] > 1.0 for h in mt_logs), "clipping was not exercised"
    sd = megatrain.master_state_dict(tr.model)
    for k, v in plain_model.state_dict().items():
        if k in sd:
            torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=k)

    # megatrain's figures are in the Trainer's logs (callbacks and log_history).
    seen = [l for l in logs.logs if "loss" in l]
    assert seen and all("megatrain/tokens_per_s" in l and "megatrain/host_rss_gib" in l for l in seen)
    assert seen[0]["megatrain/tokens_per_s"] > 0
    assert all("megatrain/tokens_per_s" in h for h in mt_logs)

    # save_model writes a standard Hugging Face model with the fp32 master weights.
    from transformers import AutoModelForCausalLM

    out = str(tmp_path / "final")
    tr.save_model(out)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, sd[k]), k


@pytest.mark.parametrize("chunked_loss,tile_mlp", [(True, True), (5, 7)])
def test_trainer_with_chunked_loss_and_tiled_mlp_matches_the_untiled_run(tmp_path, chunked_loss, tile_mlp):
    """MegatrainTrainer (gradient accumulation: the Trainer passes num_items_in_batch) on a model
    wrapped with the chunked loss and the tiled MLP trains like the untiled one (fp32 CPU: every
    micro-batch loss within 1e-6 relative, every parameter after 10 steps within 1e-5)."""
    import megatrain
    from megatrain.integrations import MegatrainTrainer
    from parity import assert_close_rel

    def run(out, **wrap_kw):
        model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32, **wrap_kw)
        rec = _LossRecorder(model)
        tr = MegatrainTrainer(model=model, args=_args(out), train_dataset=_dataset())
        tr.train()
        return model, rec

    ref, ref_rec = run(str(tmp_path / "untiled"), chunked_loss=False, tile_mlp=False)
    got, rec = run(str(tmp_path / "tiled"), chunked_loss=chunked_loss, tile_mlp=tile_mlp)
    last = got.megatrain.long_context.last
    assert last["loss_rows"] is not None and last["mlp_rows"] is not None  # both really used
    if chunked_loss is not True:
        assert (last["loss_rows"], last["mlp_rows"]) == (chunked_loss, tile_mlp)
    assert len(rec.losses) == len(ref_rec.losses) == STEPS * 2
    for a, b in zip(rec.losses, ref_rec.losses):
        assert abs(a - b) <= 1e-6 * abs(b), (rec.losses, ref_rec.losses)
    ref_sd, sd = megatrain.master_state_dict(ref), megatrain.master_state_dict(got)
    assert ref_sd.keys() == sd.keys()
    for k, v in ref_sd.items():  # 10 steps of Adam on gradients summed in another order (per chunk)
        assert_close_rel(sd[k], v, 1e-5, k)


def _plain_trainer(out, model, max_grad_norm=1.0, **kw):
    """The plain ``transformers.Trainer`` recipe: CPUAdamW clips, MegatrainCallback logs and checks."""
    from megatrain.integrations import MegatrainCallback, create_optimizer
    from transformers import Trainer

    args = _args(out, max_grad_norm=0.0, **kw)
    return Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[MegatrainCallback()],
                   optimizers=(create_optimizer(model, args, max_grad_norm=max_grad_norm), None))


@pytest.mark.parametrize("device_placement,max_grad_norm", [(True, 1.0), (False, 0.0)],
                         ids=["accelerate-default-clip", "placement-off-noclip-eager"])
def test_plain_trainer_with_callback_trains_like_megatrain_trainer(tmp_path, device_placement, max_grad_norm):
    """A plain Trainer + MegatrainCallback + create_optimizer trains exactly like MegatrainTrainer
    (same micro-batch losses, logs and parameters, bit for bit on the CPU) and saves the model."""
    import megatrain

    ref, ref_rec, _ = _megatrain_trainer(str(tmp_path / "mt"), max_grad_norm=max_grad_norm)
    ref.train()

    model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    rec = _LossRecorder(model)
    tr = _plain_trainer(str(tmp_path / "plain"), model, max_grad_norm=max_grad_norm)
    tr.accelerator.device_placement = device_placement  # only matters on CUDA (see the cuda test)
    tr.train()

    assert len(rec.losses) == len(ref_rec.losses) == STEPS * 2
    assert rec.losses == ref_rec.losses
    ref_sd, sd = megatrain.master_state_dict(ref.model), megatrain.master_state_dict(model)
    assert ref_sd.keys() == sd.keys()
    for k, v in ref_sd.items():
        assert torch.equal(v, sd[k]), k
    ref_logs = [h for h in ref.state.log_history if "loss" in h]
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert len(logs) == len(ref_logs) == STEPS
    for a, b in zip(ref_logs, logs):
        assert b["loss"] == a["loss"] and b["learning_rate"] == a["learning_rate"]
        # grad_norm: CPUAdamW's pre-clip norm (the callback replaces the Trainer's figure, which saw
        # only placeholders); none without clipping (eager updates compute no global norm).
        assert b.get("grad_norm") == a.get("grad_norm")
        assert ("grad_norm" in b) == bool(max_grad_norm)
        assert b["megatrain/tokens_per_s"] > 0 and "megatrain/host_store_gib" in b
    if max_grad_norm:
        assert any(h["grad_norm"] > 1.0 for h in logs), "clipping was not exercised"
    assert tr.evaluate(_dataset(8))["eval_loss"] == ref.evaluate(_dataset(8))["eval_loss"]
    # save_model goes through the wrapped model's save_pretrained: the fp32 master weights
    from transformers import AutoModelForCausalLM

    tr.save_model(str(tmp_path / "final"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    for k, v in reloaded.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_trainer_gradient_checkpointing_is_ignored_with_one_warning(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): megatrain's activation_policy already recomputes the
    layers; checkpointing them too would run each forward once more. Same losses and weights as without."""
    import warnings

    import megatrain

    ref, ref_rec, _ = _megatrain_trainer(str(tmp_path / "ref"))
    ref.train()

    tr, rec, _ = _megatrain_trainer(str(tmp_path / "ckpt"), gradient_checkpointing=True)
    runs = []
    for layer in tr.model.model.layers:
        layer.self_attn.register_forward_pre_hook(lambda m, a: runs.append(m))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    ours = [w for w in caught if "already controls recompute" in str(w.message)]
    assert len(ours) == 1 and issubclass(ours[0].category, UserWarning)
    assert rec.losses == ref_rec.losses
    ref_sd, sd = megatrain.master_state_dict(ref.model), megatrain.master_state_dict(tr.model)
    for k, v in ref_sd.items():
        assert torch.equal(v, sd[k]), k
    # 3 layers x 2 micro batches x STEPS steps, each layer run twice (forward + megatrain's recompute)
    assert len(runs) == 3 * 2 * STEPS * 2


def test_plain_trainer_clipping_needs_cpu_adamw_max_grad_norm(tmp_path):
    """The Trainer's clip_grad_norm_ is exact only when CPUAdamW defers its updates to step()."""
    import megatrain
    from megatrain.integrations import MegatrainCallback
    from transformers import Trainer

    model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    args = _args(str(tmp_path / "plain"), max_grad_norm=1.0)
    tr = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[MegatrainCallback()],
                 optimizers=(megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3), None))
    with pytest.raises(ValueError, match=r"CPUAdamW\(\.\.\., max_grad_norm=args\.max_grad_norm\)"):
        tr.train()
    assert tr.state.global_step == 0


@pytest.mark.parametrize("trainer,args_mgn,opt_mgn", [
    ("megatrain", 1.0, None),   # MegatrainTrainer has no clip of its own: it would not clip at all
    ("megatrain", 1.0, 0.5),    # it would clip at 0.5
    ("megatrain", 1.0, float("inf")),
    ("plain", 1.0, 0.5),        # both clips: the lower wins
])  # fmt: skip
def test_a_cpu_adamw_max_grad_norm_other_than_the_trainers_is_refused_before_training(tmp_path, trainer, args_mgn,
                                                                                      opt_mgn):
    import megatrain
    from megatrain.integrations import MegatrainCallback, MegatrainTrainer
    from transformers import Trainer

    model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    before = {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}
    args = _args(str(tmp_path / "t"), max_grad_norm=args_mgn)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=opt_mgn)
    if trainer == "megatrain":
        tr = MegatrainTrainer(model=model, args=args, train_dataset=_dataset(), optimizers=(opt, None))
    else:
        tr = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[MegatrainCallback()],
                     optimizers=(opt, None))
    with pytest.raises(ValueError, match=rf"TrainingArguments\(max_grad_norm={args_mgn}\) but CPUAdamW has "
                                         rf"max_grad_norm={opt_mgn}"):
        tr.train()
    assert tr.state.global_step == 0
    after = megatrain.master_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_plain_trainer_accumulation_needs_the_same_cpu_adamw_accumulation_without_clipping(tmp_path):
    """Without max_grad_norm a CPUAdamW(gradient_accumulation_steps=1) updated each layer during the first
    micro-batch's backward under the Trainer's gradient_accumulation_steps=2: refused before any update."""
    import megatrain
    from megatrain.integrations import MegatrainCallback
    from transformers import Trainer

    model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    before = {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}
    args = _args(str(tmp_path / "plain"), max_grad_norm=0.0, gradient_accumulation_steps=2)
    tr = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[MegatrainCallback()],
                 optimizers=(megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3), None))
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=args\.gradient_accumulation_steps"):
        tr.train()
    assert tr.state.global_step == 0
    after = megatrain.master_state_dict(model)
    assert all(torch.equal(before[k], after[k]) for k in before)

def _run(*args):
    e = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, HERE, *args], capture_output=True, text=True, timeout=600, env=e)
    assert p.returncode == 0, f"worker {args[0]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"


def test_trainer_under_torchrun_matches_one_process_with_the_global_batch(tmp_path):
    from parity import PARITY_EPS, assert_close_rel

    e = dict(os.environ, OMP_NUM_THREADS="1", MEGATRAIN_ADAM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", HERE, "dp",
           str(tmp_path / "dp"), str(tmp_path / "dp.pt")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=e)
    assert p.returncode == 0, f"torchrun failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    ranks = [torch.load(str(tmp_path / f"dp{r}.pt")) for r in range(2)]
    # 1 process x 2 rows: the same global batches
    one, rec, _ = _megatrain_trainer(str(tmp_path / "one"), adam_epsilon=PARITY_EPS)
    one.train()
    assert len(rec.losses) == 2 * STEPS and all(len(r["losses"]) == 2 * STEPS for r in ranks)
    # each rank's loss is its rows' share of the global token mean (the Trainer's num_items_in_batch)
    worst = 0.0
    for k, ref in enumerate(rec.losses):
        got = sum(r["losses"][k] for r in ranks)
        worst = max(worst, abs(got - ref) / abs(ref))
        assert abs(got - ref) <= 1e-5 * abs(ref), (k, got, ref)
    params = megatrain.master_state_dict(one.model)
    for n, t in params.items():
        assert_close_rel(ranks[0]["params"][n], t, 1e-5, n)
        assert torch.equal(ranks[0]["params"][n], ranks[1]["params"][n]), n  # one shared store
    diff = max(float((ranks[0]["params"][n] - t).abs().max()) for n, t in params.items())
    print(f"Trainer, 2 processes vs 1: max loss rel diff {worst:.2e}, max |param diff| {diff:.2e}")
    ck = tmp_path / "dp" / "checkpoint-5"
    megatrain.state.checkpoint.verify_checkpoint(str(ck / "megatrain"))  # written once, by rank 0
    assert (ck / "model.safetensors").is_file() and (ck / "trainer_state.json").is_file()


def test_trainer_resume_in_fresh_process_is_bit_exact(tmp_path):
    out = str(tmp_path / "run")
    _run("full", out, str(tmp_path / "full.pt"))
    ck = os.path.join(out, "checkpoint-5")
    assert os.path.isfile(os.path.join(ck, "megatrain", "manifest.json"))
    assert os.path.isfile(os.path.join(ck, "model.safetensors"))  # the checkpoint is also an HF model
    assert not os.path.exists(os.path.join(ck, "optimizer.pt"))
    manifest = json.load(open(os.path.join(ck, "megatrain", "manifest.json")))
    assert "scheduler.pt" in manifest["files"]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ck, output_loading_info=True)[1]  # also a standard HF model
    assert not hf["missing_keys"] and not hf["unexpected_keys"], hf
    _run("resume", out, str(tmp_path / "resumed.pt"))
    full = torch.load(str(tmp_path / "full.pt"))
    resumed = torch.load(str(tmp_path / "resumed.pt"))
    assert len(full["losses"]) == 2 * STEPS and len(resumed["losses"]) == STEPS
    assert resumed["losses"] == full["losses"][STEPS:]
    for k, v in full["params"].items():
        assert torch.equal(v, resumed["params"][k]), k


@pytest.mark.cuda
def test_trainer_cuda_bf16_trains_saves_resumes(tmp_path):
    """MegatrainTrainer on the GPU (bf16 compute copy): trains, checkpoints, resumes, saves a model."""
    import megatrain
    from megatrain.integrations import MegatrainTrainer

    def trainer(model):
        model = megatrain.wrap(model, device="cuda", activation_policy="recompute")  # streamed: H2D / D2H logged
        rec = _LossRecorder(model)
        args = _args(str(tmp_path / "run"), use_cpu=False, save_strategy="steps", save_steps=5)
        return MegatrainTrainer(model=model, args=args, train_dataset=_dataset()), rec

    tr, rec = trainer(_model())
    tr.train()
    tr2, rec2 = trainer(_model())
    tr2.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-5"))
    print(f"\nfull    {rec.losses[STEPS:]}\nresumed {rec2.losses}\nbit-exact: {rec.losses[STEPS:] == rec2.losses}")
    assert len(rec2.losses) == STEPS
    for a, b in zip(rec.losses[STEPS:], rec2.losses):
        assert abs(a - b) <= 1e-2 * abs(a)
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert all(h.get("megatrain/h2d_gbps", 0) > 0 for h in logs), logs[-1]
    tr2.save_model(str(tmp_path / "final"))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))


@pytest.mark.cuda
def test_plain_trainer_cuda_bf16(tmp_path):
    """The plain Trainer recipe on the GPU: refused while accelerate would copy the optimizer state to
    the GPU (device_placement); with it off, trains like MegatrainTrainer and the step counters stay
    on the CPU."""
    import megatrain
    from megatrain.integrations import MegatrainTrainer

    def wrapped():
        return megatrain.wrap(_model(), device="cuda", activation_policy="recompute")  # streamed: H2D / D2H logged

    ref_model = wrapped()
    ref_rec = _LossRecorder(ref_model)
    MegatrainTrainer(model=ref_model, args=_args(str(tmp_path / "mt"), use_cpu=False),
                     train_dataset=_dataset()).train()

    tr = _plain_trainer(str(tmp_path / "p1"), wrapped(), use_cpu=False)
    with pytest.raises(ValueError, match="device_placement"):
        tr.train()

    model = wrapped()
    rec = _LossRecorder(model)
    tr = _plain_trainer(str(tmp_path / "p2"), model, use_cpu=False)
    tr.accelerator.device_placement = False
    tr.train()
    print(f"\nMegatrainTrainer {ref_rec.losses}\nplain Trainer    {rec.losses}\nbit-exact: {ref_rec.losses == rec.losses}")
    assert len(rec.losses) == len(ref_rec.losses) == STEPS * 2
    for a, b in zip(ref_rec.losses, rec.losses):
        assert abs(a - b) <= 1e-2 * abs(a)
    opt = megatrain.integrations.hf_trainer._unwrap_optimizer(tr.optimizer)
    assert all(st["step"].device.type == "cpu" for st in opt.state.values())
    logs = [h for h in tr.state.log_history if "loss" in h]
    assert all(h.get("megatrain/h2d_gbps", 0) > 0 for h in logs), logs[-1]


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "..", "..", "python"))
    _worker(sys.argv[1:])


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_trainer_refuses_mixed_precision_flags_before_training(tmp_path, flag):
    # The Trainer's autocast would recast what megatrain runs in compute_dtype (it trained silently).
    import megatrain

    try:
        tr, _, _ = _megatrain_trainer(str(tmp_path / "mp"), **{flag: True})
    except ValueError as e:  # this transformers refuses the flag itself on a CPU: nothing to check
        pytest.skip(f"TrainingArguments({flag}=True) refused by transformers here: {e}")
    before = {k: v.clone() for k, v in megatrain.master_state_dict(tr.model).items()}
    with pytest.raises(ValueError, match="set bf16=False and fp16=False in TrainingArguments"):
        tr.train()
    assert tr.state.global_step == 0
    after = megatrain.master_state_dict(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("optim", ["adafactor", "sgd"])
def test_trainer_refuses_an_optim_other_than_adamw_before_training(tmp_path, optim):
    # MegatrainTrainer builds CPUAdamW from the TrainingArguments: another optim trained AdamW silently.
    import megatrain

    tr, _, _ = _megatrain_trainer(str(tmp_path / "o"), optim=optim)
    before = {k: v.clone() for k, v in megatrain.master_state_dict(tr.model).items()}
    with pytest.raises(ValueError, match=rf"optim='{optim}'\) is not available"):
        tr.train()
    assert tr.state.global_step == 0
    after = megatrain.master_state_dict(tr.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    tr, _, _ = _megatrain_trainer(str(tmp_path / "a"), optim="adamw_torch", max_steps=1)
    tr.train()
    assert tr.state.global_step == 1


def test_trainer_with_the_disk_tier_is_bit_identical_and_resumes(tmp_path):
    """MegatrainTrainer on a model whose layers keep their fp32 state on disk (wrap(offload_dir=...)):
    the same bits as without, and a Trainer checkpoint resumes it exactly."""
    import megatrain
    from megatrain.integrations import MegatrainTrainer

    def wrapped(disk: str = None):
        m = _model()
        kw = {}
        if disk:
            limit = megatrain.estimate(m, device="cpu", compute_dtype=torch.float32,
                                       gradient_accumulation_steps=2).host_bytes - 1
            kw = dict(offload_dir=str(tmp_path / disk), host_memory_limit=limit, grad_accumulator=True,
                      host_compute_copy=True)  # (the disk tier; "auto" would first drop compute copies)
        return megatrain.wrap(m, device="cpu", compute_dtype=torch.float32, **kw)

    plain = MegatrainTrainer(model=wrapped(), args=_args(str(tmp_path / "plain")), train_dataset=_dataset())
    plain.train()
    disk_model = wrapped("tier")
    assert [u.index for u in disk_model.megatrain.disk.units] == [0, 1, 2]
    tr = MegatrainTrainer(model=disk_model, args=_args(str(tmp_path / "disk"), save_strategy="steps", save_steps=5),
                          train_dataset=_dataset())
    tr.train()
    want = megatrain.master_state_dict(plain.model)
    got = megatrain.master_state_dict(tr.model)
    assert all(torch.equal(got[k], want[k]) for k in want)
    again = MegatrainTrainer(model=wrapped("tier2"), args=_args(str(tmp_path / "disk"), save_strategy="steps",
                                                                save_steps=5), train_dataset=_dataset())
    again.train(resume_from_checkpoint=str(tmp_path / "disk" / "checkpoint-5"))
    resumed = megatrain.master_state_dict(again.model)
    assert all(torch.equal(resumed[k], want[k]) for k in want)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names fsynced files through /proc/self/fd")
def test_trainer_checkpoint_fsyncs_each_file_once(tmp_path, monkeypatch):
    """A Trainer checkpoint (save_steps) fsyncs every file of checkpoint-N/megatrain once, not twice.

    Each fsync costs a device cache flush (milliseconds on a local SSD, far more on network or
    cloud disks) whatever the file's size, so on small models it is the save's cost; the files
    must all still be on disk before the directory is swapped into place."""
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tr, _, _ = _megatrain_trainer(str(tmp_path), max_steps=4, save_strategy="steps", save_steps=2)
    tr.train()
    monkeypatch.setattr(os, "fsync", real)
    twice = sorted({p for p in synced if synced.count(p) > 1})
    assert not twice, f"fsynced more than once: {twice}"
    for step in (2, 4):
        ckpt = tmp_path / f"checkpoint-{step}" / "megatrain"
        files = sorted(os.listdir(ckpt))
        assert "manifest.json" in files and any(f.startswith("unit-") for f in files)
        # the checkpoint was written under a temporary name beside it, then swapped in
        tmp_synced = [p for p in synced if os.path.dirname(os.path.dirname(p)) == str(ckpt.parent)
                      and os.path.basename(os.path.dirname(p)).startswith(".megatrain.tmp-")]
        assert sorted(os.path.basename(p) for p in tmp_synced) == files
        assert any(os.path.basename(p).startswith(".megatrain.tmp-") and os.path.dirname(p) == str(ckpt.parent)
                   for p in synced)  # the temporary directory itself
    assert sum(p == str(ckpt.parent) for p in synced) == 1  # the parent, after the swap


def test_plain_trainer_without_clipping_logs_no_nan_norm_warning(tmp_path):
    """A plain Trainer with max_grad_norm=0 still asks clip_grad_norm_(inf) for a norm to log; MegatrainCallback
    drops that figure, so the nan it gets is no news to warn about. The same call from a user's loop still warns."""
    import warnings

    from megatrain.integrations import MegatrainCallback
    from transformers import Trainer

    model = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    args = _args(str(tmp_path / "plain"), max_grad_norm=0.0, gradient_accumulation_steps=1, max_steps=3)
    tr = Trainer(model=model, args=args, train_dataset=_dataset(), callbacks=[MegatrainCallback()],
                 optimizers=(megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3), None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.train()
    assert tr.state.global_step == 3
    assert not [w for w in caught if "returns nan" in str(w.message)], [str(w.message) for w in caught]
    assert all("grad_norm" not in h for h in tr.state.log_history)  # the nan figure is not logged

    other = megatrain.wrap(_model(), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(other.parameters(), lr=1e-3)
    x = _dataset(2)[0]["input_ids"][None]
    other(input_ids=x, labels=x).loss.backward()
    with pytest.warns(UserWarning, match="returns nan"):
        assert torch.isnan(torch.nn.utils.clip_grad_norm_(other.parameters(), float("inf")))
    opt.step()
