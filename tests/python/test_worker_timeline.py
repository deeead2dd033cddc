"""The per-step worker timeline (``Options.worker_timeline``, ``model.megatrain.worker_timeline()``) on the CPU."""

import copy
import os
import sys
import threading

import pytest
import torch
import transformers

import megatrain
from megatrain import _C
from megatrain.runtime.options import Options, options_set
from megatrain.runtime.engine.timeline import timeline_summary
from megatrain.runtime.engine.worker import _Worker
from parity import make_batches, tiny_llama_config

STEPS = 2
TASKS = ("update", "grad", "wait")


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_llama_config())


def _train(base, timeline: bool, clip, wait_each_step: bool = True):
    """Train a copy of ``base`` for STEPS steps; returns (masters, per-step timelines, model)."""
    with options_set(worker_timeline=timeline):
        model = megatrain.wrap(copy.deepcopy(base), device="cpu", compute_dtype=torch.float32)
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=clip)
    timelines = []
    for micro in make_batches(96, STEPS, 1, 2, 16, seed=3):
        for x in micro:
            model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if wait_each_step:
            opt.wait()  # this step's updates applied: the step is complete
            timelines.append(model.megatrain.worker_timeline())
    return megatrain.master_state_dict(model), timelines, model


def _trainable_entries(eng):
    return {u.index: sum(not e.frozen for e in u.entries) for u in eng.units if any(not e.frozen for e in u.entries)}


@pytest.mark.parametrize("clip", [None, 1.0])
def test_timeline_has_each_units_updates_in_order(base_model, clip):
    _, timelines, model = _train(base_model, True, clip)
    eng = model.megatrain
    trainable = _trainable_entries(eng)
    assert len(trainable) == len(eng.units)
    for number, events in enumerate(timelines, start=1):
        kinds = [e["kind"] for e in events]
        assert kinds.count("step_begin") == 1 and kinds.count("step_end") == 1 and kinds.count("backward_end") == 1
        begin = next(e for e in events if e["kind"] == "step_begin")
        assert begin["step"] == number and begin["t_s"] == 0.0
        marks = {e["kind"]: e["t_s"] for e in events if "t_s" in e}
        assert 0.0 < marks["backward_end"] <= marks["step_end"]
        updates = [e for e in events if e["kind"] == "update"]
        per_unit = {u: sum(e["unit"] == u for e in updates) for u in trainable}
        # one update per unit; without clipping the resident unit's entries are updated one by one as
        # autograd finishes each of them (eager updates), with clipping all at once in step()
        want = {u: (1 if clip is not None or eng.units[u].kind == "layer" else n) for u, n in trainable.items()}
        assert per_unit == want, (per_unit, want)
        assert {e["unit"] for e in events if e["kind"] == "grad"} == set(trainable)
        for e in events:
            if e["kind"] in TASKS:
                assert e["start_s"] <= e["end_s"], e
        for e in updates:
            assert e["start_s"] > 0.0, e  # after the step's begin
            if clip is not None:  # every update waits for the global norm, known after backward
                assert e["start_s"] >= marks["backward_end"], (e, marks)
        assert [e.get("start_s", e.get("t_s")) for e in events] == \
            sorted(e.get("start_s", e.get("t_s")) for e in events)
        # the only waits: opt.wait() after step() (a flush, unit None) for the step's last updates
        assert all(e["unit"] is None and e["start_s"] >= marks["step_end"] for e in events if e["kind"] == "wait")
    eng.close()


@pytest.mark.parametrize("clip", [None, 1.0])
def test_timeline_off_is_empty_and_changes_no_bits(base_model, clip):
    on, timelines_on, m_on = _train(base_model, True, clip)
    off, timelines_off, m_off = _train(base_model, False, clip)
    assert all(timelines_on) and timelines_off == [[]] * STEPS
    assert m_off.megatrain.timeline.open_steps == []
    assert on.keys() == off.keys()
    for k in on:
        assert torch.equal(on[k], off[k]), k
    m_on.megatrain.close()
    m_off.megatrain.close()


def test_last_complete_step_without_waiting_and_switching_off(base_model):
    _, _, model = _train(base_model, True, 1.0, wait_each_step=False)
    eng = model.megatrain
    events = eng.worker_timeline()
    assert events and events[0]["kind"] == "step_begin" and events[0]["step"] in (1, 2)
    # the next forward's loads wait for (or find done) the last step's updates: it completes
    x = make_batches(96, 1, 1, 2, 16, seed=9)[0][0]
    with torch.no_grad():
        model(input_ids=x)
    assert eng.worker_timeline()[0]["step"] == STEPS
    assert eng.worker_timeline(step=1)[0]["step"] == 1 and eng.worker_timeline(step=STEPS + 1) == []
    eng.set_worker_timeline(False)
    assert eng.worker_timeline() == []
    eng.close()


def test_next_forward_waits_belong_to_the_step_whose_updates_they_wait_for(base_model):
    # A task holding the worker delays the step's updates past step(): the next forward's loads wait for them.
    with options_set(worker_timeline=True):
        model = megatrain.wrap(copy.deepcopy(base_model), device="cpu", compute_dtype=torch.float32)
    eng = model.megatrain
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    (x,), (y,) = make_batches(96, 2, 1, 2, 16, seed=4)
    model(input_ids=x, labels=x).loss.backward()
    eng.wait_grads()  # the gradient tasks ran: the worker is free for the holding task
    release = threading.Event()
    eng.worker.submit(release.wait, _Worker.UPDATE, -1)
    opt.step()
    opt.zero_grad()
    threading.Timer(0.05, release.set).start()
    model(input_ids=y, labels=y).loss.backward()  # its loads wait for step 1's updates
    opt.step()
    events = eng.worker_timeline(step=1)
    marks = {e["kind"]: e["t_s"] for e in events if "t_s" in e}
    waits = [e for e in events if e["kind"] == "wait"]
    assert waits and all(e["unit"] is not None and e["start_s"] >= marks["step_end"] for e in waits), events
    assert max(e["end_s"] - e["start_s"] for e in waits) > 0.02
    first_update = min(e["start_s"] for e in events if e["kind"] == "update")
    assert first_update >= min(e["start_s"] for e in waits)  # held until the next forward waited
    eng.close()


def test_summary_totals_and_longest_waits():
    events = [dict(kind="step_begin", t_s=0.0, step=3), dict(kind="grad", unit=1, start_s=0.1, end_s=0.2),
              dict(kind="backward_end", t_s=0.25), dict(kind="update", unit=1, start_s=0.3, end_s=0.5),
              dict(kind="step_end", t_s=0.55), dict(kind="update", unit=0, start_s=0.5, end_s=0.9),
              dict(kind="wait", unit=0, start_s=0.6, end_s=0.9), dict(kind="wait", unit=1, start_s=0.6, end_s=0.65)]
    s = timeline_summary(events)
    assert s["counts"] == dict(update=2, grad=1, wait=2)
    assert s["totals_s"]["update"] == pytest.approx(0.6) and s["totals_s"]["wait"] == pytest.approx(0.35)
    assert s["marks"] == dict(step_begin=0.0, backward_end=0.25, step_end=0.55)
    assert [w["unit"] for w in s["longest_waits"]] == [0, 1]
    assert s["update_first_start_s"] == 0.3 and s["update_last_end_s"] == 0.9
    assert s["update_span_s"] == pytest.approx(0.6)
    assert timeline_summary([])["update_span_s"] is None


def test_bench_train_row_and_lines(base_model, capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import bench_train

    _, _, model = _train(base_model, True, 1.0)
    row = bench_train.worker_timeline_row(model.megatrain)
    assert row["step"] == STEPS and row["counts"]["update"] == len(model.megatrain.units)
    assert bench_train.worker_timeline_row(model.megatrain, 1)["step"] == 1  # an earlier complete step, kept
    assert bench_train.worker_timeline_row(model.megatrain, 99)["step"] == STEPS  # not recorded: the last one
    bench_train.print_worker_timeline(row)
    bench_train.print_worker_timeline(dict(events=[]))
    out = capsys.readouterr().out
    assert f"worker timeline of step {STEPS}" in out and "after backward_end" in out
    assert "no complete step recorded" in out
    model.megatrain.close()


def test_option_and_clock():
    assert Options().worker_timeline is False
    assert Options.from_env({"MEGATRAIN_WORKER_TIMELINE": "1"}).worker_timeline is True
    assert Options.from_env({"MEGATRAIN_WORKER_TIMELINE": "0"}).worker_timeline is False
    a = _C.steady_now()
    b = _C.steady_now()
    assert 0 < a <= b
    outcome = _C.GradOutcome()
    assert outcome.started_s == -1.0 and outcome.finished_s == -1.0
