"""Per-entry eager updates of the resident unit (no clipping): failure paths and parity with torch."""

import copy
import threading
import time

import pytest
import torch

import megatrain
from parity import assert_close_rel
from test_parity_cpu import RTOL, tiny


def test_worker_failure_during_backward_leaves_no_unit_waiting_forever(monkeypatch):
    # The LM head's eager update fails on the worker; the failure surfaces at the next resident
    # entry's hand-over (its update was already planned). No unit may be left marked "update in
    # flight" for a task that was never queued: the next forward would wait for it forever.
    from megatrain.runtime import engine as engine_mod

    model = megatrain.wrap(tiny("llama"), device="cpu")
    opt = megatrain.optim.CPUAdamW(model.parameters(), lr=1e-3)  # no clipping: eager updates
    eng = model.megatrain
    real = engine_mod._C_ops

    class Broken:
        def __getattr__(self, name):
            if name == "adamw_step_":
                def fail(*a):
                    raise RuntimeError("simulated adam failure")
                return fail
            return getattr(real(), name)

    def wait_for_the_failure(p):  # runs after megatrain's hook on the LM head queued its update
        t0 = time.monotonic()
        while eng._worker._error is None and time.monotonic() - t0 < 30:
            time.sleep(0.001)

    model.lm_head.weight.register_post_accumulate_grad_hook(wait_for_the_failure)
    monkeypatch.setattr(engine_mod, "_C_ops", lambda: Broken())
    x = torch.randint(0, 96, (2, 8))
    with pytest.raises(RuntimeError, match="CPU worker failed.*simulated adam failure"):
        model(input_ids=x, labels=x).loss.backward()
    monkeypatch.setattr(engine_mod, "_C_ops", real)
    eng.flush()
    stuck = [u.index for u in eng.units if not u.update_done.is_set()]
    assert not stuck, f"units {stuck} wait for an update that was never queued"
    done = threading.Event()
    t = threading.Thread(target=lambda: (model(input_ids=x, labels=x), done.set()), daemon=True)
    t.start()
    t.join(30)
    assert done.is_set(), "the next forward hangs"
