"""A wrapped model used from two threads: a second thread's forward while the first thread's forward,
its pending graph or its backward is running raises one line in the second thread (before anything
is touched) and the first thread's result is the single-threaded one; sequential use from several
threads (forward/backward/step in one, later in another; a backward of another thread's forward)
gives exactly the single-threaded results."""

from __future__ import annotations

import threading

import pytest
import torch

import megatrain

pytest.importorskip("transformers")

WAIT_S = 30


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = megatrain.wrap(LlamaForCausalLM(cfg), device="cpu", compute_dtype=torch.float32)
    return model, megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2)


def _batch(seed):
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def _masters(model):
    return {k: v.clone() for k, v in megatrain.master_state_dict(model).items()}


def _step(model, opt, x):
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


class _Thread(threading.Thread):
    """A daemon thread keeping its target's result or exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.result, self.error = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _second_thread_is_refused(model, x):
    """A no-grad forward in another thread: returns its exception (asserted to be the one-line refusal)."""
    b = _Thread(lambda: model(input_ids=x).logits)
    b.start()
    b.join(WAIT_S)
    assert not b.is_alive(), "the second thread's forward neither finished nor raised (it waits on the first)"
    assert b.error is not None, "the second thread's forward ran while the first thread was using the model"
    msg = str(b.error)
    assert isinstance(b.error, megatrain.ModelInUseError) and "\n" not in msg, msg
    assert msg.startswith("megatrain: this wrapped model cannot start a forward here: it is in use by another "
                          "thread"), msg
    assert "one threading.Lock" in msg and "its own wrapped model" in msg, msg
    return b.error


class _Pause:
    """A forward pre-hook on layer 1's MLP that stops the thread ``owner`` at its ``nth`` call (the
    forward's is the first; a backward's re-run of the layer the second) until ``go`` is set."""

    def __init__(self, model, nth):
        self.nth, self.calls, self.owner = nth, 0, None
        self.inside, self.go = threading.Event(), threading.Event()
        self.handle = model.model.layers[1].mlp.register_forward_pre_hook(self)

    def __call__(self, mod, args):
        if threading.current_thread() is not self.owner:
            return
        self.calls += 1
        if self.calls == self.nth:
            self.inside.set()
            assert self.go.wait(WAIT_S)


def test_second_thread_forward_during_a_no_grad_forward_raises_and_the_first_is_exact():
    model, _ = _model()
    x, y = _batch(1), _batch(2)
    with torch.no_grad():
        want = model(input_ids=x).logits
    pause = _Pause(model, nth=1)

    def first():
        with torch.no_grad():
            return model(input_ids=x).logits
    a = _Thread(first)
    pause.owner = a
    a.start()
    try:
        assert pause.inside.wait(WAIT_S)
        _second_thread_is_refused(model, y)
    finally:
        pause.go.set()
        a.join(WAIT_S)
    assert a.error is None, a.error
    assert torch.equal(a.result, want)
    pause.handle.remove()
    with torch.no_grad():  # the refused thread left nothing behind: the model is usable at once, from any thread
        assert torch.equal(model(input_ids=x).logits, want)


@pytest.mark.parametrize("phase", ["forward", "between_forward_and_backward", "backward"])
def test_second_thread_during_a_training_step_raises_and_the_step_is_exact(phase):
    x, y = _batch(1), _batch(2)
    ref_model, ref_opt = _model()
    want_loss = _step(ref_model, ref_opt, x)
    want = _masters(ref_model)

    model, opt = _model()
    pause = _Pause(model, nth={"forward": 1, "backward": 2}.get(phase, 0))
    between, resume = threading.Event(), threading.Event()

    def train():
        loss = model(input_ids=x, labels=x).loss
        if phase == "between_forward_and_backward":
            between.set()
            assert resume.wait(WAIT_S)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    a = _Thread(train)
    pause.owner = a
    a.start()
    try:
        assert (between if phase == "between_forward_and_backward" else pause.inside).wait(WAIT_S)
        err = _second_thread_is_refused(model, y)
        doing = {"forward": "is running a forward", "backward": "is running a backward"}.get(
            phase, "ran a forward with autograd on whose backward has not finished")
        assert doing in str(err), str(err)
    finally:
        pause.go.set()
        resume.set()
        a.join(WAIT_S)
    assert a.error is None, a.error
    assert a.result == want_loss
    got = _masters(model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_sequential_use_from_several_threads_equals_one_thread():
    x1, x2, x3 = _batch(1), _batch(2), _batch(3)
    ref_model, ref_opt = _model()
    want_losses = [_step(ref_model, ref_opt, x) for x in (x1, x2, x3)]
    with torch.no_grad():
        want_logits = ref_model(input_ids=x1).logits
    want = _masters(ref_model)

    model, opt = _model()
    losses = []

    def run(fn):
        t = _Thread(fn)
        t.start()
        t.join(WAIT_S)
        assert not t.is_alive() and t.error is None, t.error
        return t.result

    losses.append(run(lambda: _step(model, opt, x1)))  # a step in thread A
    losses.append(run(lambda: _step(model, opt, x2)))  # later, one in thread B
    # a forward in thread C, its backward in thread D, the step in this thread
    loss = run(lambda: model(input_ids=x3, labels=x3).loss)
    run(loss.backward)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    assert losses == want_losses
    logits = run(lambda: model(input_ids=x1).logits.detach())  # evaluation in yet another thread
    assert torch.equal(logits, want_logits)
    got = _masters(model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_dropped_forward_graph_frees_the_model_for_other_threads():
    model, _ = _model()
    x = _batch(1)
    out = model(input_ids=x).logits  # autograd on, no backward: the model is this thread's while it lives
    t = _Thread(lambda: model(input_ids=x).logits)
    t.start()
    t.join(WAIT_S)
    assert isinstance(t.error, RuntimeError) and "whose backward has not finished" in str(t.error), t.error
    del out
    t = _Thread(lambda: model(input_ids=x).logits.sum().item())
    t.start()
    t.join(WAIT_S)
    assert t.error is None, t.error
