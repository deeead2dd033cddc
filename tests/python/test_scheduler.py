"""The C++ scheduler core through its bindings: worker order and failure, ledger, kernel tasks.

The kernel tasks must give the bits the torch ops give (same drivers, same chunk order).
"""

import threading

import pytest
import torch

from megatrain._loader import load_extension

_C = load_extension()
ops = torch.ops.megatrain


def test_python_tasks_run_gradients_first_then_updates_by_deadline():
    w = _C.Worker()
    gate = threading.Event()
    order = []
    w.submit(gate.wait)
    for key in (5, 1, 3):
        w.submit(lambda k=key: order.append(("update", k)), _C.Worker.UPDATE, key)
    w.submit(lambda: order.append(("grad", 0)))
    h = w.submit(lambda: order.append(("grad", 1)))
    w.submit(lambda: order.append(("after", 1)), _C.Worker.UPDATE, 0, ready=h)
    gate.set()
    w.drain()
    w.close()
    # The update gated on grad 1 has key 0: once grad 1 ran it is the earliest deadline.
    assert order == [("grad", 0), ("grad", 1), ("after", 1), ("update", 1), ("update", 3), ("update", 5)]
    assert h.done


def test_failure_is_sticky_and_names_the_python_error():
    w = _C.Worker()
    ran = []

    def boom():
        raise ValueError("simulated accumulate failure")

    w.submit(boom)
    w.submit(lambda: ran.append(1))
    with pytest.raises(RuntimeError, match=r"CPU worker failed: ValueError\('simulated accumulate failure'\).*cannot "
                                           r"train on"):
        w.drain()
    assert ran == [] and w.failed
    with pytest.raises(_C.WorkerFailed, match="simulated accumulate failure"):
        w.submit(lambda: None)
    with pytest.raises(RuntimeError, match="simulated accumulate failure"):
        w.wait_grads()
    w.close()


def test_ready_must_be_a_handle_or_an_event():
    w = _C.Worker()
    with pytest.raises(TypeError, match="ready must be None, a TaskHandle"):
        w.submit(lambda: None, ready=threading.Event())
    w.close()


def test_ledger_refuses_an_illegal_transition_with_the_state_named():
    led = _C.Ledger([2])
    assert led.begin_d2h(0, 1, True) is True
    with pytest.raises(_C.LedgerError, match="illegal transition reset of unit 0 entry 1 .gradient in_flight_direct"):
        led.reset(0, 1)
    led.landed_direct(0, 1, 4.0, True)
    s = led.get(0, 1)
    assert s.place == _C.GradPlace.direct and s.grad_sq == 4.0 and s.micro_batches == 1
    assert led.any_in_compute(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accumulate_task_gives_the_op_bits(dtype):
    g = torch.Generator().manual_seed(0)
    n = 2 * 65536 + 17
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(2)]
    want = torch.zeros(n)
    sq_want = [float(ops.grad_accumulate_(want, gr, k == 0)) for k, gr in enumerate(grads)]
    got = torch.full((n,), 7.0)
    led = _C.Ledger([1])
    w = _C.Worker()
    for gr in grads:
        over = led.begin_d2h(0, 0, False)
        h, outcome = w.submit_accumulate(led, 0, [], [(0, got, gr, over)])
        w.wait(h)
        assert outcome.ran and outcome.finite
    w.close()
    assert torch.equal(got, want)
    assert led.get(0, 0).grad_sq == sq_want[-1]
    assert led.get(0, 0).place == _C.GradPlace.accumulated


def test_adam_task_gives_the_op_bits_and_records_the_update():
    g = torch.Generator().manual_seed(1)
    n = 65536 + 33
    master = torch.randn(n, generator=g)
    grad = (0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)
    state = lambda: [master.clone(), torch.full((n,), 0.01), torch.full((n,), 0.02), torch.empty(n, dtype=torch.bfloat16)]
    want, got = state(), state()
    ops.adamw_step_(want[0], want[1], want[2], grad, want[3], 1e-3, 0.9, 0.95, 1e-6, 0.1, 4, 0.25)
    led = _C.Ledger([1])
    w = _C.Worker()
    h, outcome = w.submit_adam(led, 0, [(0, got[0], got[1], got[2], grad, got[3], 1e-3, 0.9, 0.95, 1e-6, 0.1, 4)],
                               0.25, ledger_entries=[0])
    assert led.get(0, 0).update in (_C.UpdateState.queued, _C.UpdateState.running, _C.UpdateState.done)
    w.wait(h)
    w.close()
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], master)
    assert led.get(0, 0).update == _C.UpdateState.done and not outcome.skipped


def test_adam_task_skips_a_non_finite_gradient_and_restores_the_weights():
    n = 100
    master = torch.randn(n)
    compute = torch.full((n,), float("nan")).to(torch.bfloat16)  # the gradient sits in the compute copy
    m, v = torch.zeros(n), torch.zeros(n)
    led = _C.Ledger([1])
    w = _C.Worker()
    led.begin_d2h(0, 0, True)
    norms = torch.tensor([float("nan")], dtype=torch.float64)
    gh, gout = w.submit_accumulate(led, 0, [(0, norms, 0)], [])
    h, outcome = w.submit_adam(led, 0, [(0, master, m, v, compute, compute, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)], 1.0,
                               ledger_entries=[0], finite_from=gout, restore_on_skip=[(master, compute)], ready=gh)
    before = master.clone()
    w.drain()
    w.close()
    assert not gout.finite and outcome.skipped
    assert torch.equal(master, before) and torch.equal(compute, master.to(torch.bfloat16))
    assert torch.count_nonzero(m) == 0
