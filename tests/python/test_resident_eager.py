"""Per-entry eager updates of the resident unit (no clipping): failure paths and parity with torch."""

import copy
import threading
import time

import pytest
import torch

import megatrain
from parity import assert_close_rel
from test_parity_cpu import RTOL, tiny


def _forward_in_another_thread(model, x) -> list:
    """Run ``model(input_ids=x, labels=x)`` on a new thread (waiting up to 30 s): ``["ran"]``, ``[the
    RuntimeError's message]``, or ``[]`` when it hangs."""
    outcome = []

    def forward():
        try:
            model(input_ids=x, labels=x)
            outcome.append("ran")
        except RuntimeError as e:
            outcome.append(str(e))

    t = threading.Thread(target=forward, daemon=True)
    t.start()
    t.join(30)
    return outcome


def test_worker_failure_during_backward_leaves_no_unit_waiting_forever():
    # The LM head's eager update fails on the worker (a step count the Adam kernel refuses); the
    # failure surfaces at the next resident entry's hand-over (its update was already planned).
    # No unit may be left with an update in flight for a task that was never queued: the next
    # forward would wait for it forever.
    from test_parity_cpu import _corrupt_step_count

    model = megatrain.wrap(tiny("llama"), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)  # no clipping: eager updates
    eng = model.megatrain
    _corrupt_step_count(opt, model.lm_head.weight)

    def wait_for_the_failure(p):  # runs after megatrain's hook on the LM head queued its update
        t0 = time.monotonic()
        while not eng.worker.failed and time.monotonic() - t0 < 30:
            time.sleep(0.001)

    model.lm_head.weight.register_post_accumulate_grad_hook(wait_for_the_failure)
    x = torch.randint(0, 96, (2, 8))
    with pytest.raises(RuntimeError, match="CPU worker failed.*AdamW step must be >= 1"):
        model(input_ids=x, labels=x).loss.backward()
    t0 = time.monotonic()  # the tasks queued behind the failure are skipped: wait until all are
    while eng.worker.unfinished and time.monotonic() - t0 < 30:
        time.sleep(0.001)
    assert eng.worker.unfinished == 0
    stuck = [u.index for u in eng.units if not u.update_settled]
    assert not stuck, f"units {stuck} wait for an update that was never queued"
    outcome = _forward_in_another_thread(model, x)
    assert outcome, "the next forward hangs"
    assert "CPU worker failed" in outcome[0] and "cannot train on" in outcome[0]  # sticky, not a hang


def _assert_masters_match(wrapped, opt, ref):
    """Every fp32 master weight of ``wrapped`` equals ``ref``'s parameter (after the queued updates)."""
    opt.wait()
    got = megatrain.master_state_dict(wrapped)
    for n, p in ref.named_parameters():
        assert_close_rel(got[n], p.detach(), RTOL, n)


def _pair(arch, ga, plan, *, groups=None, sched=None, ckpt=None, steps=3):
    """Train ``arch`` with torch AdamW and with megatrain (no clipping: eager resident entries).

    ``plan(step)`` lists the ops of one step: ``"ids"`` a micro-batch from input_ids, ``"embeds"``
    one from detached inputs_embeds (the embedding gets no gradient), ``"extra"`` a backward that
    megatrain must refuse (the reference skips it), ``"zero"`` zero_grad, ``"step"`` step + zero_grad
    (+ scheduler step, + megatrain checkpoint save/load).
    """
    model = tiny(arch)
    ref = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu")
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-6)
    pick = groups or (lambda m: m.parameters())
    ref_opt = torch.optim.AdamW(pick(ref), foreach=False, **kw)
    opt = megatrain.optim.CPUAdamW(pick(wrapped), gradient_accumulation_steps=ga, **kw)
    scheds = [sched(o) if sched else None for o in (ref_opt, opt)]
    g = torch.Generator().manual_seed(3)
    losses = ([], [])
    for s in range(steps):
        for op in plan(s):
            x = torch.randint(0, 96, (2, 12), generator=g)
            for k, (m, o, sc) in enumerate(((ref, ref_opt, scheds[0]), (wrapped, opt, scheds[1]))):
                if op in ("ids", "embeds"):
                    kwargs = dict(input_ids=x)
                    if op == "embeds":
                        if m is wrapped:
                            m.megatrain.load_resident()  # the device copy is refreshed at the model's forward
                        with torch.no_grad():
                            kwargs = dict(inputs_embeds=m.get_input_embeddings()(x).clone())
                    loss = m(labels=x, **kwargs).loss / ga
                    loss.backward()
                    losses[k].append(loss.item())
                elif op == "extra" and m is wrapped:
                    with pytest.raises(RuntimeError, match="more backward passes than gradient_accumulation_steps"):
                        m(input_ids=x, labels=x).loss.backward()
                elif op == "zero":
                    o.zero_grad()
                elif op == "step":
                    o.step()
                    o.zero_grad()
                    if sc is not None:
                        sc.step()
                    if ckpt is not None and m is wrapped:
                        megatrain.save_checkpoint(str(ckpt), m, o, sc)
                        megatrain.load_checkpoint(str(ckpt), m, o, sc)
    for a, b in zip(*losses):
        assert abs(a - b) <= RTOL * abs(a), (a, b)
    assert len(losses[0]) == len(losses[1]) > 0
    got = megatrain.master_state_dict(wrapped)
    for n, p in ref.named_parameters():
        assert_close_rel(got[n], p.detach(), RTOL, n)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # untied / tied embeddings
def test_parity_refused_extra_backward_then_training_goes_on(arch):
    # The refusal comes from the first resident hook of the extra backward (LM head / final norm),
    # after the last micro-batch had queued every resident entry's update: nothing may change.
    _pair(arch, 2, lambda s: ["ids", "ids", "extra", "step"] if s != 1 else ["ids", "ids", "extra", "extra", "step"])


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_parity_embedding_without_gradient_in_some_micro_batches_with_scheduler_and_checkpoint(arch, tmp_path):
    # The embedding's update waits for step() when it missed a micro-batch (its last gradient is
    # not the window's last); the other resident entries go eagerly. LR schedule + checkpoint
    # round trip after each step.
    plans = [["embeds", "ids"], ["ids", "embeds"], ["ids", "ids"], ["embeds", "embeds"]]
    _pair(arch, 2, lambda s: plans[s] + ["step"], steps=4, ckpt=tmp_path / "c",
          sched=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.6 ** k))


def test_parity_lm_head_outside_the_optimizer_and_a_skipped_partial_window():
    # lm_head trains (requires_grad) but no param group holds it: its gradient is dropped and its
    # weights stay; zero_grad() after the first of two micro-batches drops that micro-batch.
    _pair("llama", 2, lambda s: ["ids", "zero", "ids", "ids", "step"],
          groups=lambda m: [p for n, p in m.named_parameters() if not n.startswith("lm_head")])


def test_after_a_worker_failure_every_later_call_raises_instead_of_hanging():
    # A failed task skips the ones queued after it; their waiters (the next forward's load, step())
    # must get the error again, not wait forever.
    import threading
    from test_parity_cpu import _corrupt_step_count

    model = megatrain.wrap(tiny("llama"), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    _corrupt_step_count(opt, model.model.layers[0].self_attn.q_proj.weight)
    x = torch.randint(0, 96, (2, 8))
    with pytest.raises(RuntimeError, match="CPU worker failed.*AdamW step must be >= 1"):
        for _ in range(3):
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
    errors = []

    def train_on():
        try:
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=train_on, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the next training step hung after a CPU worker failure"
    assert errors and "cannot train on" in errors[0]


def test_resident_parameter_unfrozen_after_wrap_is_refused():
    # A parameter frozen at wrap time holds only its compute copy (no master / Adam state):
    # unfreezing it later is refused at the next forward, before any state changes.
    model = tiny("llama")
    model.get_input_embeddings().weight.requires_grad_(False)
    wrapped = megatrain.wrap(model, device="cpu")
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (2, 12))
    wrapped(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()
    before = megatrain.master_state_dict(wrapped)
    wrapped.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="frozen .* when the model was wrapped.*cannot be unfrozen"):
        wrapped(input_ids=x, labels=x)
    with pytest.raises(RuntimeError, match="cannot be unfrozen"):
        megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-3)
    after = megatrain.master_state_dict(wrapped)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_inner_model_called_directly_after_step_sees_the_new_weights():
    # The resident device copy is refreshed by any module that owns resident weights, not only by
    # the outer model's forward.
    model = tiny("llama")
    ref = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-2)
    x = torch.randint(0, 96, (2, 12))
    for m, o in ((ref, ref_opt), (wrapped, opt)):
        m(input_ids=x, labels=x).loss.backward()
        o.step()
        o.zero_grad()
    with torch.no_grad():
        want = ref.model(input_ids=x).last_hidden_state
        got = wrapped.model(input_ids=x).last_hidden_state
        emb_want = ref.get_input_embeddings()(x)
        emb_got = wrapped.get_input_embeddings()(x)
    assert_close_rel(emb_got, emb_want, RTOL, "embedding output")
    assert_close_rel(got, want, RTOL, "inner model output")


def test_parity_parameter_frozen_between_backward_and_step():
    # torch.optim.AdamW updates every parameter that holds a gradient at step(), frozen since or
    # not; so does CPUAdamW (clipping on: nothing is updated before step()).
    model = tiny("llama")
    ref = copy.deepcopy(model)
    wrapped = megatrain.wrap(model, device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = megatrain.optim.CPUAdamW(wrapped.parameters(), lr=1e-2, max_grad_norm=1e9)
    x = torch.randint(0, 96, (2, 12))
    for m, o in ((ref, ref_opt), (wrapped, opt)):
        m(input_ids=x, labels=x).loss.backward()
        m.lm_head.weight.requires_grad_(False)
        m.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
        o.step()
        o.zero_grad()
    _assert_masters_match(wrapped, opt, ref)


@pytest.mark.parametrize("switch", ["eager_updates", "d2h_overlap", "overlap"])
def test_parity_with_each_benchmark_before_switch(switch):
    # The "before" switches of bench_train's ratios change scheduling only: training must not change.
    from megatrain.runtime.options import options_set

    with options_set(**{switch: False}):
        assert getattr(megatrain.wrap(tiny("llama"), device="cpu").megatrain, switch) is False
        _pair("llama", 2, lambda s: ["ids", "ids", "step"])


def test_worker_failure_is_what_another_thread_sees_while_the_failed_graph_is_still_held():
    # The failed backward's graph may still be referenced (here: the loss is kept; in general until the
    # traceback is dropped): another thread's forward gets the sticky worker failure, not "in use".
    from test_parity_cpu import _corrupt_step_count

    model = megatrain.wrap(tiny("llama"), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)
    eng = model.megatrain
    _corrupt_step_count(opt, model.lm_head.weight)

    def wait_for_the_failure(p):
        t0 = time.monotonic()
        while not eng.worker.failed and time.monotonic() - t0 < 30:
            time.sleep(0.001)

    model.lm_head.weight.register_post_accumulate_grad_hook(wait_for_the_failure)
    x = torch.randint(0, 96, (2, 8))
    loss = model(input_ids=x, labels=x).loss  # held: its graph stays alive
    with pytest.raises(RuntimeError, match="CPU worker failed"):
        loss.backward()
    outcome = _forward_in_another_thread(model, x)
    assert outcome and "CPU worker failed" in outcome[0], outcome
    del loss
