"""Device-state layers (``wrap(device_state_layers=K)``): parity with plain PyTorch, host-visible state.

On the CPU backend the "device" is the CPU: the device-state layers' master / exp_avg / exp_avg_sq /
gradient accumulator / compute copy are tensors outside the host store, updated by
``megatrain.runtime.placement.device_state`` exactly as on a GPU. The reference is torch.optim.AdamW on the
same model; parameters are compared per element after 10 steps.
"""

import copy
import importlib
import re
import warnings

import pytest
import torch

import megatrain
import megatrain.state.checkpoint
from megatrain.runtime.engine.core import locate
from parity import (PARITY_EPS, assert_close_rel, limit_auto_room, make_batches, poison_gradient_at, train_megatrain,
                    train_reference)
from test_parity_cpu import NOISE_DRIVEN, tiny

RTOL = 1e-6  # the device-state layers' parameters (torch's own AdamW math on the same gradients)
HOST_RTOL = 1e-5  # host-stored units (the fused CPU kernel), as in test_parity_cpu.py
STEPS = 10
# GPT-2's fused q/k/v bias: its key third is noise-driven (see test_parity_cpu.NOISE_DRIVEN), held to 1e-5
GPT2_QKV_BIAS = ("attn.c_attn.bias",)


def run_pair(model, *, micro_batches=1, max_grad_norm=None, groups="one", policy="recompute", steps=STEPS, **wrap_kw):
    batches = make_batches(model.config.vocab_size, steps, micro_batches, 2, 16, seed=1)
    kw = dict(lr=1e-3, wd=0.1, betas=(0.9, 0.95), max_grad_norm=max_grad_norm, groups=groups)
    ref = train_reference(copy.deepcopy(model), batches, **kw)
    got, wrapped, opt = train_megatrain(model, batches, activation_policy=policy, **kw, **wrap_kw)
    return ref, got, wrapped, opt


def check(ref, got, wrapped, rtol=RTOL):
    """Losses, clipped norms, and every parameter per element: ``rtol`` for the device-state layers."""
    # the resident unit's gradients come through the chunked loss (another summation order than the
    # reference's full logits): its entries are held to HOST_RTOL wherever their state is
    on_device = {e.name for u in wrapped.megatrain.layers if u.device_state is not None for e in u.entries}
    assert len(got.losses) == len(ref.losses) == STEPS
    for i, (a, b) in enumerate(zip(got.losses, ref.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {i}: loss {a} vs reference {b}"
    checked = 0
    for name, b in ref.params.items():
        tol = (1e-3 if name.endswith(NOISE_DRIVEN) else HOST_RTOL if name.endswith(GPT2_QKV_BIAS)
               else rtol if name in on_device else HOST_RTOL)
        assert_close_rel(got.params[name], b, tol, name)
        checked += name in on_device
    assert checked == len(on_device)
    for a, b in zip(got.grad_norms, ref.grad_norms):
        assert abs(a - b) <= 1e-5 * b


def _device_layers(wrapped) -> list:
    return [u.index for u in wrapped.megatrain.layers if u.device_state is not None]


@pytest.mark.parametrize("arch,k,clip,micro,groups", [
    ("llama", 0, 1.0, 2, "one"),      # the host path, same checks
    ("llama", 1, None, 1, "one"),     # one layer on the device, updated in step() without clipping
    ("llama", 3, 1.0, 2, "two"),      # every layer, clipping engaged, accumulation 2, two groups
    ("gpt2", 2, 0.5, 2, "one"),       # tied embedding (resident), every layer on the device
    ("gpt2", 1, None, 2, "two"),
])
def test_parity_device_state_layers(arch, k, clip, micro, groups):
    ref, got, wrapped, _ = run_pair(tiny(arch), micro_batches=micro, max_grad_norm=clip, groups=groups,
                                    device_state_layers=k)
    check(ref, got, wrapped)
    assert _device_layers(wrapped) == list(range(k))
    if clip is not None:
        assert max(ref.grad_norms) > clip, "clipping never engaged"
    st = wrapped.megatrain.stats()
    assert st["device_state_layers"] == k and st["streamed_layers"] == len(wrapped.megatrain.layers) - k


def test_parity_fused_device_adamw(monkeypatch):
    # torch._fused_adamw_ (the CUDA default) exercised on the CPU
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", "fused")
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=2, max_grad_norm=1.0, device_state_layers=2)
    assert wrapped.megatrain.device_state.impl == "fused"
    check(ref, got, wrapped, rtol=1e-5)


def test_parity_mixed_placement(monkeypatch):
    """Layer 0: state on the device + activations kept; layer 1: host store + activations kept;
    layer 2: host store + recomputed (activation_policy auto with room for two layers)."""
    limit_auto_room(monkeypatch, lambda layer_bytes, input_bytes: layer_bytes * 2.5)
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=2, max_grad_norm=1.0, policy="auto",
                                    device_state_layers=1)
    check(ref, got, wrapped)
    (d,) = wrapped.megatrain.auto_decisions.values()
    assert d["store_layers"] == 2 and _device_layers(wrapped) == [0]
    pl = wrapped.megatrain.placement()
    assert (pl["layers"], pl["device_state_layers"], pl["streamed_layers"]) == (3, 1, 2)
    assert pl["device_state_bytes"] == wrapped.megatrain.device_state.nbytes > 0
    (acts,) = pl["activations"]
    assert (acts["store_layers"], acts["recompute_layers"], acts["block_k"]) == (2, 1, 1)


def test_default_placement_is_the_planner_under_auto_on_cuda_only():
    """``device_state_layers=None`` (default): ``"auto"`` with ``activation_policy="auto"`` on CUDA,
    ``"boundary"`` under the other policies on CUDA, 0 on the CPU backend."""
    resolve = importlib.import_module("megatrain.runtime.placement.device_state_plan").resolve_device_state_layers
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve(None, "auto", cuda) == "auto"
    assert resolve(None, "recompute", cuda) == "boundary" and resolve(None, "store", cuda) == "boundary"
    assert resolve(None, "block:2", cuda) == "boundary" and resolve(None, "offload", cuda) == "boundary"
    assert resolve(None, "auto", cpu) == 0 and resolve(None, "recompute", cpu) == 0  # the host store is the CPU's memory
    assert resolve(2, "auto", cuda) == 2 and resolve(0, "auto", cuda) == 0 and resolve("auto", "store", cpu) == "auto"
    model = megatrain.wrap(tiny("llama"), device="cpu", activation_policy="auto")
    pl = model.megatrain.placement()
    assert (pl["device_state_layers"], pl["streamed_layers"], pl["activations"]) == (0, 3, [])
    assert megatrain.wrap(tiny("llama"), device="cpu").megatrain.placement()["activations"] is None


def test_parity_store_policy_all_layers_on_the_device_streams_no_layer():
    ref, got, wrapped, _ = run_pair(tiny("llama"), policy="store", device_state_layers=3)
    check(ref, got, wrapped)
    eng = wrapped.megatrain
    res = eng.resident.numel * 4  # fp32 compute copy
    assert eng.stats()["h2d_bytes"] <= (STEPS + 1) * res  # only the resident unit was ever copied
    assert all(not slots for slots in eng.slots.values())  # no streaming slot is allocated


def test_parity_frozen_entries_on_the_device():
    model = tiny("llama")
    for p in model.model.layers[1].parameters():  # a whole device-state layer frozen
        p.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)  # one frozen entry beside trained ones
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref, got, wrapped, _ = run_pair(model, max_grad_norm=1.0, device_state_layers=2)
    check(ref, got, wrapped)
    for n, before in frozen.items():
        assert torch.equal(got.params[n], before), f"frozen {n} changed"


def test_auto_places_every_layer_when_it_fits_and_bad_values_are_refused():
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers="auto")
    assert _device_layers(model) == [0, 1, 2]
    assert model.megatrain.stats()["device_state_bytes"] == model.megatrain.device_state.nbytes > 0
    for bad in (-1, 4, "all", 1.5, True):
        with pytest.raises(ValueError, match="device_state_layers"):
            megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=bad)
    plan = importlib.import_module("megatrain.runtime.placement.device_state_plan").plan_device_state_layers
    layers = model.megatrain.layers
    per = layers[0].device_state.nbytes
    assert plan(layers, torch.float32, int(per * 2.5), fraction=1.0) == 2
    assert plan(layers, torch.float32, 0) == 0


def _limit_device_room(monkeypatch, units):
    """Make ``device_state_layers="auto"`` see just enough free memory for the resident unit's fp32
    state and ``units`` more layers (fraction 1)."""
    dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")
    eng_mod = importlib.import_module("megatrain.runtime.engine.core")
    init = eng_mod.Engine.init_device_state

    def limited(self, layers):
        res = self.device_state_resident()
        room = (dsp.unit_device_bytes(res, self.compute_dtype, with_compute=False) if res is not None else 0) + \
            sum(dsp.unit_device_bytes(u, self.compute_dtype) for u in self.layers[:units])
        self.free_device_bytes = lambda: room
        return init(self, layers)

    monkeypatch.setattr(dsp, "AUTO_DEVICE_STATE_FRACTION", 1.0)
    monkeypatch.setattr(eng_mod.Engine, "init_device_state", limited)


@pytest.mark.parametrize("layers_room,clip,micro", [(3, 1.0, 2), (1, None, 1), (1, 1.0, 2), (0, 1.0, 1), (0, None, 1)])
def test_auto_keeps_the_resident_unit_first_with_parity(monkeypatch, layers_room, clip, micro):
    """``"auto"`` puts the resident unit (embedding, final norm, LM head) on the device before any
    layer: with room for it and ``layers_room`` layers, those are on the device and the rest streams;
    training matches torch.optim.AdamW (with/without clipping, accumulation)."""
    _limit_device_room(monkeypatch, layers_room)
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=micro, max_grad_norm=clip, device_state_layers="auto")
    eng = wrapped.megatrain
    assert eng.resident.device_state is not None and eng.resident.device_state.compute is eng.resident_buf
    assert _device_layers(wrapped) == list(range(layers_room))
    st = eng.stats()
    assert st["device_state_resident"] and st["device_state_layers"] == layers_room
    assert eng.placement()["device_state_resident"]
    # Every layer's gradient passes through the final norm and LM head, here updated by torch's AdamW
    # math instead of the fused CPU kernel (both exact up to rounding): 1e-5 as for the host path.
    check(ref, got, wrapped, rtol=HOST_RTOL)


def test_resident_device_state_round_trips_through_state_dict_and_checkpoint(tmp_path, monkeypatch):
    """The resident unit's device state is what state_dict / checkpoints read, and what they restore."""
    _limit_device_room(monkeypatch, 0)
    torch.manual_seed(0)
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers="auto")
    assert model.megatrain.resident.device_state is not None
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
    batches = make_batches(model.config.vocab_size, 3, 1, 2, 16, seed=3)
    for (x,) in batches[:2]:
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    emb = model.get_input_embeddings().weight
    assert torch.equal(sd["model.embed_tokens.weight"], emb.detach().float())
    megatrain.state.checkpoint.save_checkpoint(str(tmp_path / "ck"), model, opt)
    # a save reads the state without handing it out writable: no copy back to the device at the next step
    assert not any(u.device_state.host_dirty for u in model.megatrain.units if u.device_state is not None)
    x = batches[2][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    assert not torch.equal(emb.detach().float(), sd["model.embed_tokens.weight"])  # trained on
    megatrain.state.checkpoint.load_checkpoint(str(tmp_path / "ck"), model, opt)
    assert torch.equal(emb.detach().float(), sd["model.embed_tokens.weight"])  # the device buffer was restored
    du = model.megatrain.resident.device_state
    e = [i for i, en in enumerate(model.megatrain.resident.entries) if en.name.endswith("embed_tokens.weight")][0]
    assert torch.equal(du.fp32("master", e).view_as(emb), sd["model.embed_tokens.weight"])
    model.load_state_dict(dict(sd, **{"model.embed_tokens.weight": torch.zeros_like(emb, dtype=torch.float32)}))
    assert emb.detach().abs().sum() == 0 and du.fp32("master", e).abs().sum() == 0


def _setup(k, seed=0):
    torch.manual_seed(seed)
    model = megatrain.wrap(tiny("gpt2"), device="cpu", device_state_layers=k)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=0.5, gradient_accumulation_steps=2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def _steps(model, opt, sched, batches):
    out = []
    for micro in batches:
        for x in micro:
            (model(input_ids=x, labels=x).loss / len(micro)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():
            out.append(float(model(input_ids=micro[0], labels=micro[0]).loss))
    return out


def test_checkpoint_save_load_in_a_fresh_model_continues_bit_identically(tmp_path):
    batches = make_batches(96, 6, 2, 2, 12, seed=4)
    model, opt, sched = _setup(1)
    _steps(model, opt, sched, batches[:3])
    ck = str(tmp_path / "ck")
    megatrain.state.checkpoint.save_checkpoint(ck, model, opt, sched)
    saved = {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}
    cont = _steps(model, opt, sched, batches[3:])
    final = megatrain.master_state_dict(model)
    model2, opt2, sched2 = _setup(1, seed=7)
    megatrain.state.checkpoint.load_checkpoint(ck, model2, opt2, sched2)
    loaded = megatrain.master_state_dict(model2)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    cont2 = _steps(model2, opt2, sched2, batches[3:])
    assert cont == cont2
    final2 = megatrain.master_state_dict(model2)
    assert all(torch.equal(final[k], final2[k]) for k in final)
    for p, p2 in zip(model.parameters(), model2.parameters()):  # the moments too, device layer included
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key])


def test_state_dict_and_optimizer_state_round_trip_and_read_the_device_state():
    batches = make_batches(96, 4, 2, 2, 12, seed=5)
    model, opt, sched = _setup(2)
    ref = copy.deepcopy(tiny("gpt2"))
    _steps(model, opt, sched, batches[:2])
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    osd = copy.deepcopy(opt.state_dict())
    # the state dict holds what the device trained: not the initial weights
    init = tiny("gpt2").state_dict()
    assert not torch.equal(sd["transformer.h.0.mlp.c_fc.weight"], init["transformer.h.0.mlp.c_fc.weight"])
    assert float(osd["state"][2]["exp_avg_sq"].abs().sum()) > 0
    model2, opt2, sched2 = _setup(2, seed=9)
    model2.load_state_dict(sd)
    opt2.load_state_dict(osd)
    sched2.load_state_dict(sched.state_dict())
    x = batches[2][0]
    with torch.no_grad():  # the loaded weights are what the device layers compute with
        assert torch.equal(model(input_ids=x).logits, model2(input_ids=x).logits)
    assert _steps(model, opt, sched, batches[2:]) == _steps(model2, opt2, sched2, batches[2:])
    a, b = megatrain.master_state_dict(model), megatrain.master_state_dict(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    del ref


def _step_both(wrapped, opt, ref_model, ref_opt, x):
    """One step of the wrapped model (CPUAdamW, max_grad_norm 1.0) and of the reference (clip_grad_norm_ 1.0)."""
    wrapped(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    ref_model(input_ids=x, labels=x).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    ref_opt.step()
    ref_opt.zero_grad()


def test_optimizer_state_reads_match_torch_adamw():
    model = tiny("llama")
    ref_model = copy.deepcopy(model)
    batches = make_batches(96, 3, 1, 2, 12, seed=6)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=3)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=PARITY_EPS, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=PARITY_EPS, foreach=False)
    for (x,) in batches:
        _step_both(wrapped, opt, ref_model, ref_opt, x)
    names = dict(ref_model.named_parameters())
    for (n, p) in wrapped.named_parameters():
        st, rst = opt.state[p], ref_opt.state[names[n]]
        assert float(st["step"]) == float(rst["step"]) == 3
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_rel(st[key], rst[key], 1e-5, f"{n}.{key}")


def _masters(model):
    return {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_nonfinite_gradient_in_a_device_layer_without_clipping_skips_that_layer_only(monkeypatch, impl):
    """No clipping: a NaN entering backward at layer 1's output reaches layers 1, 0 and the embedding
    (skipped, on the device and in the host store alike), not layer 2 or the LM head (updated).
    ``fused`` (the CUDA default): the device updates are enqueued before step() waits for the
    gradients and skip on the device (``found_inf``); the host puts the step counts back."""
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", impl)
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=2)
    assert model.megatrain.device_state.checks_on_device == (impl == "fused")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)

    h = poison_gradient_at(model.model.layers[1])
    before = _masters(model)
    x = torch.randint(0, 96, (2, 12))
    with pytest.warns(RuntimeWarning, match=r"model\.layers\.[01]"):
        model(input_ids=x, labels=x).loss.backward()
        h.remove()
        opt.step()
        opt.zero_grad()
        opt.wait()
        mid = _masters(model)
        for k in before:  # layers 0, 1 (device) and the embedding skipped; layer 2 and the LM head updated
            skipped = k.startswith(("model.embed_tokens", "model.layers.0.", "model.layers.1."))
            assert torch.equal(before[k], mid[k]) == skipped, k
        model(input_ids=x, labels=x).loss.backward()  # finite now
        opt.step()
    assert opt.skipped_steps == 1
    steps = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    assert steps["model.layers.0.mlp.up_proj.weight"] == 1 and steps["model.layers.1.mlp.up_proj.weight"] == 1
    assert steps["model.layers.2.mlp.up_proj.weight"] == 2 and steps["lm_head.weight"] == 2
    assert all(torch.isfinite(v).all() for v in _masters(model).values())


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_nonfinite_skip_is_one_warning_per_step_in_the_host_words_with_the_boundary_on_the_device(monkeypatch, impl):
    """No clipping, a NaN loss: with the resident unit and layer 0 on the device ("boundary") the step's
    skips come as one warning, naming the parameters and layers exactly as with every unit host-stored
    (the resident ones by parameter name, not by an internal unit index)."""
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", impl)
    x = torch.randint(0, 96, (2, 12))
    said = {}
    for k in ("boundary", 0):
        model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=k)
        assert (model.megatrain.resident.device_state is not None) == (k == "boundary")
        opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (model(input_ids=x, labels=x).loss * float("nan")).backward()
            opt.step()
        said[k] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert opt.skipped_steps == 1
    assert len(said[0]) == 1 and said["boundary"] == said[0], said
    names = said[0][0].split("the update of ")[1].split(" was skipped")[0]
    assert names == ("lm_head.weight, model.embed_tokens.weight, model.layers.0, model.layers.1, model.layers.2, "
                     "model.norm.weight")


@pytest.mark.parametrize("clip", [1.0, None], ids=["max_grad_norm", "no_clipping"])
def test_nonfinite_raise_mode_with_every_layer_on_the_device(clip):
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=3)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=clip, nonfinite="raise")
    before = _masters(model)
    x = torch.randint(0, 96, (2, 12))
    (model(input_ids=x, labels=x).loss * float("nan")).backward()
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    opt.zero_grad()
    after = _masters(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    model(input_ids=x, labels=x).loss.backward()  # training goes on
    opt.step()
    assert all(torch.isfinite(v).all() for v in _masters(model).values())
    assert not torch.equal(_masters(model)["model.layers.0.mlp.up_proj.weight"],
                           before["model.layers.0.mlp.up_proj.weight"])


# The GPU parity test of a mixed placement (bf16, 20 steps, the race switch) is a case of
# tests/python/test_parity_cuda.py::test_bf16_parity_vs_gpu_resident_1b.


def test_from_config_passes_device_state_layers():
    cfg = tiny("llama").config
    model = megatrain.from_config(cfg, seed=0, device="cpu", compute_dtype=torch.float32, device_state_layers=2)
    assert _device_layers(model) == [0, 1]
    ref = megatrain.from_config(cfg, seed=0, device="cpu", compute_dtype=torch.float32)
    a, b = megatrain.master_state_dict(model), megatrain.master_state_dict(ref)
    assert all(torch.equal(a[k], b[k]) for k in b)
    x = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, ref(input_ids=x).logits)


@pytest.mark.parametrize("k", [1, "auto"])
def test_writes_into_optimizer_state_reach_the_device_state(monkeypatch, k):
    """``opt.state[p]["exp_avg"].zero_()`` on a device-state unit takes effect at the next step, as in
    torch.optim.AdamW (the same edit on both; every parameter compared after the step)."""
    if k == "auto":
        _limit_device_room(monkeypatch, 1)  # the resident unit and layer 0 on the device, the rest streamed
    model = tiny("llama")
    ref_model = copy.deepcopy(model)
    batches = make_batches(96, 3, 1, 2, 12, seed=7)
    wrapped = megatrain.wrap(model, device="cpu", device_state_layers=k)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3, eps=PARITY_EPS, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, eps=PARITY_EPS, foreach=False)
    names = dict(ref_model.named_parameters())
    edited = [n for n, _ in wrapped.named_parameters() if n.startswith(("model.layers.0.", "model.layers.1.", "lm_head"))]
    for step, (x,) in enumerate(batches):
        if step == 2:  # the same in-place edit of the moments in both optimizers
            for n, p in wrapped.named_parameters():
                if n in edited:
                    opt.state[p]["exp_avg"].zero_()
                    opt.state[p]["exp_avg_sq"].mul_(0.5)
                    ref_opt.state[names[n]]["exp_avg"].zero_()
                    ref_opt.state[names[n]]["exp_avg_sq"].mul_(0.5)
        _step_both(wrapped, opt, ref_model, ref_opt, x)
    assert wrapped.megatrain.layers[0].device_state is not None
    got = megatrain.master_state_dict(wrapped)
    for n in edited:
        assert_close_rel(got[n], names[n].detach(), HOST_RTOL, n)


def test_extra_backward_on_device_state_units_raises_as_on_the_host():
    """Without max_grad_norm, a backward beyond gradient_accumulation_steps raises whatever the placement
    (here every unit's state on the device: no host-stored unit whose queued update would raise)."""
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers="auto")
    assert all(u.device_state is not None for u in model.megatrain.units)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, gradient_accumulation_steps=2)
    x = make_batches(96, 1, 1, 2, 12, seed=8)[0][0]
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
    with pytest.raises(RuntimeError, match="more backward passes than gradient_accumulation_steps=2"):
        model(input_ids=x, labels=x).loss.backward()


@pytest.mark.parametrize("k,name", [(1, "model.layers.0.mlp.up_proj.weight"), ("auto", "model.layers.0.mlp.up_proj.weight"),
                                    ("boundary", "lm_head.weight")])
def test_a_write_through_an_optimizer_state_tensor_held_from_before_the_last_step_is_refused_naming_it(k, name):
    """A device-state unit's ``optimizer.state[p]["exp_avg"]`` is a host copy refreshed at each lookup:
    written through a tensor taken before the last ``step()``, it would put back older moments, so
    the next ``step()`` refuses before it touches anything, naming the parameter written (not its
    unit's first one: layer 0 starts with q_proj, the resident unit with the embedding); a fresh
    lookup's write is taken."""
    batches = make_batches(96, 4, 1, 2, 12, seed=6)
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers=k)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)
    p = dict(model.named_parameters())[name]
    assert locate(p)[1].device_state is not None  # the parameter's state is on the device

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    step(batches[0][0])
    held = opt.state[p]["exp_avg"]
    step(batches[1][0])
    opt.state[p]["exp_avg"].mul_(0.5)  # a fresh lookup: taken
    step(batches[2][0])
    held.mul_(0.5)  # taken two steps ago
    model(input_ids=batches[3][0], labels=batches[3][0]).loss.backward()
    before = {n: t.clone() for n, t in megatrain.master_state_dict(model).items()}
    with pytest.raises(RuntimeError, match=rf"\['exp_avg'\] of {re.escape(name)} \(its state is on the device\) "
                                           "was written through a tensor taken before the last optimizer.step"):
        opt.step()
    after = megatrain.master_state_dict(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # nothing of the step was applied


def test_boundary_places_the_resident_unit_then_layer_0_within_its_share():
    """``device_state_layers="boundary"`` (the CUDA default of the streamed policies): the resident
    unit, then layer 0, while together they fit in ``BOUNDARY_DEVICE_STATE_FRACTION`` of the free memory."""
    dsp = importlib.import_module("megatrain.runtime.placement.device_state_plan")
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers="boundary")
    eng = model.megatrain
    assert _device_layers(model) == [0] and eng.resident.device_state is not None
    pl = eng.placement()
    assert (pl["device_state_layers"], pl["device_state_resident"], pl["streamed_layers"]) == (1, True, 2)
    res = dsp.unit_device_bytes(eng.resident, torch.float32, with_compute=False)
    lay = dsp.unit_device_bytes(eng.layers[0], torch.float32)
    plan = dsp.plan_boundary_units
    assert plan(eng.resident, eng.layers[0], torch.float32, res + lay, fraction=1.0) == ([eng.resident], 1)
    assert plan(eng.resident, eng.layers[0], torch.float32, res + lay - 1, fraction=1.0) == ([eng.resident], 0)
    assert plan(eng.resident, eng.layers[0], torch.float32, res - 1, fraction=1.0) == ([], 1 if lay < res else 0)
    assert plan(None, eng.layers[0], torch.float32, lay, fraction=1.0) == ([], 1)  # no resident unit to place
    assert plan(eng.resident, eng.layers[0], torch.float32, 8 * (res + lay)) == ([eng.resident], 1)  # 1/8
    assert plan(eng.resident, eng.layers[0], torch.float32, 8 * (res + lay) - 8) == ([eng.resident], 0)


@pytest.mark.parametrize("clip,micro,groups", [(None, 1, "one"), (None, 2, "two"), (1.0, 2, "one")])
def test_parity_boundary_placement_with_the_fused_device_adamw(monkeypatch, clip, micro, groups):
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", "fused")
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=micro, max_grad_norm=clip, groups=groups,
                                    device_state_layers="boundary")
    assert _device_layers(wrapped) == [0] and wrapped.megatrain.resident.device_state is not None
    check(ref, got, wrapped, rtol=HOST_RTOL)


def _record_step_order(monkeypatch, eng):
    """Log, in order, each device-state update (by unit kind and index) and each ``wait_grads`` of ``eng``."""
    order = []
    ds_mod = importlib.import_module("megatrain.runtime.placement.device_state")
    update, wait = ds_mod.DeviceState.update, type(eng).wait_grads

    def logged_update(self, unit, *a, **kw):
        order.append((unit.kind, unit.index, kw.get("finite_on_device", False)))
        return update(self, unit, *a, **kw)

    def logged_wait(self):
        order.append("wait_grads")
        return wait(self)

    monkeypatch.setattr(ds_mod.DeviceState, "update", logged_update)
    monkeypatch.setattr(type(eng), "wait_grads", logged_wait)
    return order


@pytest.mark.parametrize("clip,nonfinite,impl,early", [
    (None, "skip", "fused", True),      # the CUDA default without clipping: enqueued before the wait
    (1.0, "skip", "fused", False),      # the global norm first
    (None, "raise", "fused", False),    # a host unit's non-finite gradient must stop the step first
    (None, "skip", "foreach", False),   # no on-device check
])
def test_device_updates_are_enqueued_before_the_gradient_wait_only_without_clipping(monkeypatch, clip, nonfinite,
                                                                                     impl, early):
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", impl)
    model = megatrain.wrap(tiny("llama"), device="cpu", device_state_layers="boundary")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=clip, nonfinite=nonfinite)
    order = _record_step_order(monkeypatch, model.megatrain)
    x = torch.randint(0, 96, (2, 12))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    updates = [("resident", model.megatrain.resident.index, early), ("layer", 0, early)]
    step = updates + ["wait_grads"] if early else ["wait_grads"] + updates
    assert order == step * 2
    steps = {n: float(opt.state[p]["step"]) for n, p in model.named_parameters()}
    assert set(steps.values()) == {2.0}


def test_early_device_updates_take_zero_gradients_and_partial_gradients_as_torch(monkeypatch):
    """``zero_grad(set_to_none=False)`` then a step where layer 0 gets no gradient (its input is
    detached) while the LM head does: the early device updates run zero-gradient AdamW where torch
    does and leave alone what torch leaves alone (entries never given a gradient)."""
    monkeypatch.setenv("MEGATRAIN_DEVICE_ADAM", "fused")
    ref_model = tiny("llama")
    model = megatrain.wrap(copy.deepcopy(ref_model), device="cpu", device_state_layers="boundary")
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, eps=PARITY_EPS)
    opt = megatrain.optim.CPUAdamW(model.parameters(), **kw)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), **kw)
    x = torch.randint(0, 96, (2, 12))

    def cut_at_layer_1(m):  # layer 1 onwards only: layer 0 and the embedding get no gradient
        def hook(_module, args, kwargs):
            return (args[0].detach(),) + args[1:], kwargs
        return m.model.layers[1].register_forward_pre_hook(hook, with_kwargs=True)

    for step in range(3):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            h = cut_at_layer_1(m) if step == 2 else None
            m(input_ids=x, labels=x).loss.backward()
            if h is not None:
                h.remove()
            o.step()
            o.zero_grad(set_to_none=False)
    got = {n: p.detach() for n, p in model.state_dict().items()}
    for n, b in ref_model.state_dict().items():
        assert_close_rel(got[n], b, HOST_RTOL, n)
