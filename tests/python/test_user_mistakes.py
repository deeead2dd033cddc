"""What a torch / Hugging Face user calls on a wrapped model and its CPUAdamW by habit or by mistake:
each behaves as on the plain model with torch.optim.AdamW (CPU, fp32), or is refused in one line
before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch

from test_drop_in import assert_params_close, batches, make, weights


@pytest.mark.parametrize("set_to_none", [True, False])
def test_model_zero_grad_drops_the_gradients_as_on_the_plain_model(set_to_none):
    """``model.zero_grad()`` (nn.Module's, which the HF Trainer and many scripts call instead of the
    optimizer's) between two backward passes drops the first one's gradients, as torch does; it used to
    leave them in the host store, and the next step() summed both micro-batches (silently)."""
    ref, ropt = make(False)
    w, opt = make(True, copy.deepcopy(ref), max_grad_norm=1e9)
    x0, x1 = batches(2)
    for model, o in ((w, opt), (ref, ropt)):
        model(input_ids=x0, labels=x0).loss.backward()
        model.zero_grad(set_to_none=set_to_none)
        model(input_ids=x1, labels=x1).loss.backward()
        o.step()
    assert_params_close(weights(w), weights(ref))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_containers_zero_grad_drops_the_wrapped_models_gradients_as_torch_does(set_to_none):
    """``outer.zero_grad()`` on a module holding the wrapped model between two backward passes drops the first
    one's gradients, as on the plain container; torch's zero_grad only cleared ``.grad`` of the parameters it
    found (the layers' placeholders have none), and the next step() summed both micro-batches (silently)."""
    class Outer(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, x):
            return self.lm(input_ids=x, labels=x).loss

    ref_lm, ropt = make(False)
    w_lm, opt = make(True, copy.deepcopy(ref_lm), max_grad_norm=1e9)
    x0, x1 = batches(2)
    for model, o in ((Outer(w_lm), opt), (Outer(ref_lm), ropt)):
        for _ in range(2):
            model(x0).backward()
            model.zero_grad(set_to_none=set_to_none)
            model(x1).backward()
            o.step()
            o.zero_grad()
    assert_params_close(weights(w_lm), weights(ref_lm))


@pytest.mark.parametrize("clip", [1e9, None])
@pytest.mark.parametrize("key,bad", [("lr", "3e-4"), ("lr", float("nan")), ("weight_decay", None), ("betas", (0.9,))])
def test_a_param_group_edited_to_a_bad_value_is_refused_before_anything_changes(clip, key, bad):
    """A param group set to what no update can run with (a string read from a config, a scheduler
    lambda's NaN) raised a bare ``could not convert string to float`` from inside step() after the step
    counts were bumped, or, without max_grad_norm, from inside backward, leaving the gradient ledger
    broken (every later backward raised ``LedgerError``). Now one line naming the group and key, from the
    forward (no max_grad_norm) or step(); fixing the value lets training go on exactly as torch's."""
    ref, ropt = make(False)
    w, opt = make(True, copy.deepcopy(ref), max_grad_norm=clip)
    x0, x1 = batches(2)
    good = opt.param_groups[0][key]
    opt.param_groups[0][key] = bad
    with pytest.raises(ValueError, match=rf"megatrain.optim.CPUAdamW: param_groups\[0\]\['{key}'\] is .*, not "):
        w(input_ids=x0, labels=x0).loss.backward()
        opt.step()
    opt.param_groups[0][key] = good
    opt.zero_grad()
    for model, o in ((w, opt), (ref, ropt)):
        model(input_ids=x1, labels=x1).loss.backward()
        if clip is not None and model is ref:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        o.step()
    assert_params_close(weights(w), weights(ref))


@pytest.mark.parametrize("clip", [1e9, None])
@pytest.mark.parametrize("key,bad", [("decoupled_weight_decay", False), ("decoupled_weight_decay", 0),
                                     ("amsgrad", True), ("maximize", True)])
def test_a_param_group_switched_to_a_refused_option_is_refused_before_anything_changes(clip, key, bad):
    """torch.optim.AdamW reads these keys from param_groups at every step (False decoupled_weight_decay: an L2
    penalty instead of decoupled decay). CPUAdamW refused them only where a group was added, so one set by hand
    afterwards trained silently as plain AdamW, and its state_dict could not be loaded back. Now step() (or the
    forward) refuses it in one line; putting the value back trains on exactly as torch."""
    ref, ropt = make(False)
    w, opt = make(True, copy.deepcopy(ref), max_grad_norm=clip)
    x0, x1 = batches(2)
    good = opt.param_groups[0][key]
    before = weights(w)
    opt.param_groups[0][key] = bad
    with pytest.raises(ValueError, match=rf"megatrain.optim.CPUAdamW: param_groups\[0\]: {key}={bad!r} .*not "):
        w(input_ids=x0, labels=x0).loss.backward()
        opt.step()
    for k, v in before.items():
        assert torch.equal(weights(w)[k], v), k
    opt.param_groups[0][key] = good
    opt.zero_grad()
    for model, o in ((w, opt), (ref, ropt)):
        model(input_ids=x1, labels=x1).loss.backward()
        if clip is not None and model is ref:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        o.step()
    assert_params_close(weights(w), weights(ref))


@pytest.mark.parametrize("bad", [0, None, torch.tensor(False)])
def test_a_falsy_decoupled_weight_decay_is_refused_like_false(bad):
    """torch reads decoupled_weight_decay by truth value: 0, None and tensor(False) mean an L2 penalty as False
    does; they were accepted (only the literal False was refused) and trained as AdamW."""
    import megatrain
    from test_drop_in import tiny

    params = list(megatrain.wrap(tiny(), device="cpu").parameters())
    opt = megatrain.optim.CPUAdamW(params[:1])
    with pytest.raises(ValueError, match="add_param_group: decoupled_weight_decay="):
        opt.add_param_group({"params": params[1:], "decoupled_weight_decay": bad})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("group", [{"amsgrad": True}, {"maximize": True}, {"decoupled_weight_decay": False}])
def test_a_refused_option_in_a_constructor_group_names_the_group_not_add_param_group(group):
    """A refused option in a group given to the constructor: the one-line error names that group by its
    index (it named CPUAdamW.add_param_group, a call the user never made)."""
    import megatrain
    from test_drop_in import tiny

    params = list(megatrain.wrap(tiny(), device="cpu").parameters())
    with pytest.raises(ValueError, match=r"^megatrain.optim.CPUAdamW \(param group 1\): " + list(group)[0]):
        megatrain.optim.CPUAdamW([{"params": params[:1]}, {"params": params[1:], **group}])


@pytest.mark.parametrize("sched", [{"step": 3}, "cosine"])
def test_save_checkpoint_refuses_a_scheduler_that_is_not_one_before_writing(tmp_path, sched):
    """``save_checkpoint(dir, model, opt, {"step": 3})`` (``extra`` given where the scheduler goes) raised a
    bare ``AttributeError: 'dict' object has no attribute 'state_dict'`` halfway through the save; as
    ``load_checkpoint`` does, it is refused in one line before anything is written."""
    import megatrain

    w, opt = make(True, max_grad_norm=1.0)
    x = batches(1)[0]
    w(input_ids=x, labels=x).loss.backward()
    opt.step()
    with pytest.raises(ValueError, match=r"megatrain.save_checkpoint: lr_scheduler must be an LR scheduler \(with "
                                         r"state_dict\), got a (dict|str)"):
        megatrain.save_checkpoint(str(tmp_path / "ckpt"), w, opt, sched)
    assert list(tmp_path.iterdir()) == []


def test_load_state_dict_of_a_non_mapping_raises_torchs_type_error():
    """``model.load_state_dict(path)`` (a path instead of ``torch.load(path)``) raised a bare
    ``AttributeError: 'str' object has no attribute 'keys'`` from megatrain's check; torch's ``TypeError``
    now, before anything is touched."""
    ref, _ = make(False)
    w, _ = make(True, copy.deepcopy(ref))
    with pytest.raises(TypeError) as plain:
        ref.load_state_dict("model.pt")
    with pytest.raises(TypeError) as wrapped:
        w.load_state_dict("model.pt")
    assert str(wrapped.value) == str(plain.value)
    assert_params_close(weights(w), weights(ref), rtol=0)


def test_a_parameter_listed_twice_in_a_group_is_refused_in_one_line():
    """``CPUAdamW(list(params) * 2)``: torch.optim.AdamW warns and updates such a parameter twice per step;
    CPUAdamW updated it once (0.04 away from torch after one step, silently). Now refused, as torch says
    it will be, before any state is made."""
    import megatrain
    from test_drop_in import tiny

    model = megatrain.wrap(tiny(), device="cpu", compute_dtype=torch.float32)
    params = list(model.parameters())
    with pytest.raises(ValueError, match="lists a parameter more than once") as e:
        megatrain.optim.CPUAdamW(params * 2, lr=1e-3)
    assert "\n" not in str(e.value)
    opt = megatrain.optim.CPUAdamW(params, lr=1e-3)  # the same parameters once: fine
    assert len(opt.param_groups[0]["params"]) == len(params)


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double", "to_dtype"])
def test_a_dtype_cast_of_a_decoder_layer_raises_instead_of_changing_nothing(cast):
    """``model.model.layers[0].half()`` returned as if done while the layer kept computing in fp32 from the host
    store (its parameters are meta placeholders); it raises like ``model.half()`` does. Casts and moves that
    change nothing (``.float()``, ``.to("cpu")``, ``.train()``) still run, and the model still trains."""
    import megatrain
    from test_drop_in import tiny

    model = megatrain.wrap(tiny(), device="cpu")
    layer = model.model.layers[0]
    with pytest.raises(TypeError, match="^megatrain: casting a decoder layer to torch"):
        layer.to(torch.float16) if cast == "to_dtype" else getattr(layer, cast)()
    with pytest.raises(TypeError, match="^megatrain: casting a decoder layer to torch"):
        model.model.layers.half()
    assert {p.dtype for p in layer.parameters()} == {torch.float32}
    layer.float()
    model.to("cpu").float().train()
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert all(torch.isfinite(v).all() for v in model.state_dict().values())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_save_checkpoint_between_backward_and_step_warns_that_those_gradients_are_not_saved(tmp_path, clip):
    """A checkpoint written after 1 of 2 micro-batches holds no gradients (as torch's state_dicts hold none): it
    said nothing, and a resume silently ran that micro-batch again. It warns; after step() it does not."""
    import warnings

    import megatrain
    from test_drop_in import tiny

    model = megatrain.wrap(tiny(), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3, max_grad_norm=clip, gradient_accumulation_steps=2)
    x = batches(1)[0]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        megatrain.save_checkpoint(str(tmp_path / "fresh"), model, opt)
        (model(input_ids=x, labels=x).loss / 2).backward()
        megatrain.save_checkpoint(str(tmp_path / "mid"), model, opt)
        (model(input_ids=x, labels=x).loss / 2).backward()
        opt.step()
        megatrain.save_checkpoint(str(tmp_path / "after"), model, opt)
        opt.zero_grad()
    ours = [str(w.message) for w in seen if "save_checkpoint: called between backward()" in str(w.message)]
    assert len(ours) == 1 and "are not saved" in ours[0], [str(w.message) for w in seen]
