"""Saved directories and files get the permissions a plain ``mkdir`` / ``open`` gives under the
process's umask (0755 / 0644 under umask 022), not ``tempfile.mkdtemp``'s 0700: another user or
a serving process must be able to read a trained model. Checked for every writer: save_checkpoint,
export_pretrained, the CLI's out/model and out/checkpoints, the HF Trainer's checkpoint-N/megatrain.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch

import megatrain

UMASKS = [0o022, 0o077]


@pytest.fixture(params=UMASKS, ids=lambda m: f"umask{m:03o}")
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _assert_modes(root, mask):
    """``root`` and everything under it: directories 0777 & ~mask, files 0666 & ~mask."""
    root = str(root)
    want_dir, want_file = 0o777 & ~mask, 0o666 & ~mask
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        got = stat.S_IMODE(os.stat(dirpath).st_mode)
        assert got == want_dir, f"{dirpath}: mode {got:o}, expected {want_dir:o} under umask {mask:03o}"
        for name in filenames:
            p = os.path.join(dirpath, name)
            got = stat.S_IMODE(os.stat(p).st_mode)
            assert got == want_file, f"{p}: mode {got:o}, expected {want_file:o} under umask {mask:03o}"
            seen += 1
    assert seen, f"{root} holds no file"


def _tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _wrapped():
    model = megatrain.wrap(_tiny_model(), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_save_checkpoint_and_export_pretrained_follow_the_umask(tmp_path, umask):
    model, opt = _wrapped()
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    _assert_modes(tmp_path / "ckpt", umask)
    megatrain.save_checkpoint(str(tmp_path / "ckpt"), model, opt)  # replacing its own earlier output
    _assert_modes(tmp_path / "ckpt", umask)
    megatrain.export_pretrained(model, str(tmp_path / "model"))
    _assert_modes(tmp_path / "model", umask)
    # an export into a run directory that keeps its checkpoint-N/ folders (files moved in one by one)
    run = tmp_path / "run"
    os.makedirs(run / "checkpoint-1")
    (run / "checkpoint-1" / "x").write_text("kept")
    megatrain.export_pretrained(model, str(run))
    _assert_modes(run, umask)


def test_cli_model_and_checkpoints_follow_the_umask(tmp_path, umask):
    from megatrain.cli import main

    out = tmp_path / "out"
    argv = ["train", "--out", str(out), "--steps", "2", "--micro-batch-size", "2", "--eval-every", "2",
            "--compute-dtype", "fp32", "--device", "cpu", "--no-progress", "--seq-len", "32",
            "--set", "model.hidden_size=32", "--set", "model.num_layers=1", "--set", "model.num_heads=2",
            "--set", "model.num_kv_heads=1", "--set", "model.intermediate_size=64",
            "--set", "data.max_documents=20", "--set", "eval.batches=1", "--set", "train.warmup_steps=1",
            "--set", "train.save_every=1"]  # fmt: skip
    assert main(argv) == 0
    ckpts = out / "checkpoints"
    assert os.listdir(ckpts), "no checkpoint written"
    _assert_modes(ckpts, umask)
    _assert_modes(out / "model", umask)


def test_hf_trainer_checkpoint_follows_the_umask(tmp_path, umask):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    from transformers import TrainingArguments

    from megatrain.integrations import MegatrainTrainer

    model = megatrain.wrap(_tiny_model(), device="cpu", compute_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(0, 96, (8, 8), generator=g)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="steps",
                             save_steps=2, dataloader_num_workers=0, disable_tqdm=True)
    MegatrainTrainer(model=model, args=args, train_dataset=data).train()
    ckpt = tmp_path / "checkpoint-2" / "megatrain"
    assert (ckpt / "manifest.json").is_file()
    _assert_modes(ckpt, umask)


def test_peft_adapter_and_merged_exports_follow_the_umask(tmp_path, umask):
    """safetensors' ``save_file`` creates its file 0600 whatever the umask: the adapter and the merged model
    that export_pretrained writes for a PEFT model were 0600 under umask 022."""
    peft = pytest.importorskip("peft")
    base = peft.get_peft_model(_tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model = megatrain.wrap(base, device="cpu", compute_dtype=torch.float32)
    megatrain.export_pretrained(model, str(tmp_path / "adapter"))
    _assert_modes(tmp_path / "adapter", umask)
    megatrain.export_pretrained(model, str(tmp_path / "merged"), merge_adapter=True)
    _assert_modes(tmp_path / "merged", umask)
