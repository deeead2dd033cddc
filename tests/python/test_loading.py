"""Streamed loading: from_pretrained / from_config fill the host store without building the model in memory."""

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

import megatrain  # noqa: E402
from parity import tiny_gpt2_config, tiny_llama_config  # noqa: E402
from megatrain import CheckpointError  # noqa: E402


_llama = tiny_llama_config
_gpt2 = tiny_gpt2_config


def _store_equal(a, b):
    """Masters and compute copies of two wrapped models, entry by entry, bit for bit."""
    ea, eb = a.megatrain, b.megatrain
    assert [e.name for u in ea.units for e in u.entries] == [e.name for u in eb.units for e in u.entries]
    for ua, ub in zip(ea.units, eb.units):
        for i, e in enumerate(ua.entries):
            for sec in ("master", "compute"):
                assert torch.equal(ea.entry_view(ua, i, sec), eb.entry_view(ub, i, sec)), (e.name, sec)
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys()
    for k in ba:
        assert torch.equal(ba[k].cpu(), bb[k].cpu()), k


@pytest.mark.parametrize("cfg", [_llama(), _llama(tied=True), _gpt2()], ids=["llama", "llama-tied", "gpt2-tied"])
def test_from_config_equals_hf_init_for_the_same_seed(cfg):
    torch.manual_seed(11)
    ref = AutoModelForCausalLM.from_config(cfg)
    rng_after_ref = torch.get_rng_state()
    model = megatrain.from_config(cfg, seed=11, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng_after_ref)  # the generator advanced exactly as HF's init
    ref_w = megatrain.wrap(ref, device="cpu")
    _store_equal(model, ref_w)


def _save(model, path, dtype, shard):
    model = model.to(dtype)
    model.save_pretrained(path, max_shard_size="20KB" if shard else "10GB")
    files = os.listdir(path)
    assert ("model.safetensors.index.json" in files) == shard
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_pretrained_equals_hf_from_pretrained_plus_wrap(tmp_path, dtype, shard, tied):
    torch.manual_seed(0)
    path = _save(AutoModelForCausalLM.from_config(_llama(tied)), str(tmp_path / "m"), dtype, shard)
    ref = megatrain.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), device="cpu",
                         compute_dtype=torch.bfloat16)
    got = megatrain.from_pretrained(path, device="cpu", compute_dtype=torch.bfloat16)
    assert got.training == ref.training
    _store_equal(got, ref)
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_from_pretrained_gpt2_tied(tmp_path):
    torch.manual_seed(0)
    path = _save(AutoModelForCausalLM.from_config(_gpt2()), str(tmp_path / "g"), torch.float32, False)
    ref = megatrain.wrap(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), device="cpu")
    _store_equal(megatrain.from_pretrained(path, device="cpu"), ref)


# --------------------------------------------------------------------------------------------- bad input
@pytest.fixture
def sharded(tmp_path):
    torch.manual_seed(0)
    return _save(AutoModelForCausalLM.from_config(_llama()), str(tmp_path / "s"), torch.float32, True)


def _index(path):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return json.load(f)


def _refuses(path, *needles):
    import gc
    gc.collect()
    with pytest.raises(CheckpointError) as ei:
        megatrain.from_pretrained(path, device="cpu")
    msg = str(ei.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_missing_shard_is_refused(sharded):
    fn = sorted(set(_index(sharded)["weight_map"].values()))[1]
    os.remove(os.path.join(sharded, fn))
    _refuses(sharded, fn, "does not exist")


def test_index_naming_absent_file_is_refused(sharded):
    idx = _index(sharded)
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "model-99999-of-99999.safetensors"
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)
    _refuses(sharded, "model-99999-of-99999.safetensors", name)


def test_truncated_file_is_refused(sharded):
    fn = sorted(set(_index(sharded)["weight_map"].values()))[0]
    p = os.path.join(sharded, fn)
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.truncate(size - 16)
    _refuses(sharded, fn, "truncated")


def _rewrite(path, name, tensor):
    from safetensors.torch import load_file, save_file
    fn = _index(path)["weight_map"][name]
    p = os.path.join(path, fn)
    sd = load_file(p)
    sd[name] = tensor
    save_file(sd, p, metadata={"format": "pt"})
    return fn


def test_wrong_shape_is_refused(sharded):
    name = "model.layers.1.mlp.up_proj.weight"
    fn = _rewrite(sharded, name, torch.zeros(63, 32))
    _refuses(sharded, fn, name, "shape")


def test_wrong_dtype_is_refused(sharded):
    name = "model.layers.0.self_attn.q_proj.weight"
    fn = _rewrite(sharded, name, torch.zeros(32, 32, dtype=torch.int32))
    _refuses(sharded, fn, name, "dtype")


def test_missing_tensor_is_refused(sharded):
    name = "model.layers.1.self_attn.v_proj.weight"
    idx = _index(sharded)
    del idx["weight_map"][name]
    with open(os.path.join(sharded, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)
    _refuses(sharded, name, "missing")


def test_refusal_allocates_no_store(sharded, monkeypatch):
    import megatrain.runtime.engine.core as engine_mod
    built = []
    orig = engine_mod.Engine.__init__
    monkeypatch.setattr(engine_mod.Engine, "__init__", lambda self, *a, **k: (built.append(1), orig(self, *a, **k)))
    os.remove(os.path.join(sharded, sorted(set(_index(sharded)["weight_map"].values()))[0]))
    _refuses(sharded, "does not exist")
    assert built == []


@pytest.mark.parametrize("kw,needle", [
    (dict(dtype=torch.bfloat16), "compute_dtype=torch.bfloat16"), (dict(torch_dtype=torch.float16), "compute_dtype"),
    (dict(device_map="auto"), "device='cuda'"), (dict(load_in_4bit=True), "full-precision"),
])
def test_hf_loading_options_megatrain_would_ignore_are_refused(sharded, kw, needle):
    cfg = transformers.AutoConfig.from_pretrained(sharded)
    for f in (lambda: megatrain.from_pretrained(sharded, **kw), lambda: megatrain.from_config(cfg, seed=0, **kw),
              lambda: megatrain.estimate(sharded, **kw)):
        with pytest.raises(ValueError, match=re.escape(needle)) as ei:
            f()
        assert "\n" not in str(ei.value)
    w = megatrain.from_pretrained(sharded, dtype="auto")  # "auto" and float32 mean what megatrain does anyway
    assert all(v.dtype == torch.float32 for v in w.state_dict().values())


def test_wrap_frees_layer_weights_as_it_copies(monkeypatch):
    """Layer 0's own parameters are gone before layer 1 is copied (peak: store + one layer)."""
    import gc
    import weakref

    from megatrain.runtime.model.wrap import WrappedEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_llama())
    refs0 = [weakref.ref(p) for p in model.model.layers[0].parameters()]
    seen = []
    orig = WrappedEngine.entry_view

    def spy(self, unit, i, name):
        if unit.index == 1 and name == "master" and not seen:
            gc.collect()
            seen.append([r() is None for r in refs0])
        return orig(self, unit, i, name)

    monkeypatch.setattr(WrappedEngine, "entry_view", spy)
    megatrain.wrap(model, device="cpu")
    assert seen and all(seen[0]), seen


@pytest.mark.cuda
def test_from_config_on_cuda_equals_hf_init_under_cuda_device():
    if megatrain.cuda_status() != "ok":
        pytest.skip(megatrain.cuda_status())
    cfg = _llama()
    torch.manual_seed(2)
    with torch.device("cuda"):
        ref = AutoModelForCausalLM.from_config(cfg)
    ref = ref.to("cpu")
    got = megatrain.from_config(cfg, seed=2, init_device="cuda", device="cpu")
    _store_equal(got, megatrain.wrap(ref, device="cpu"))
