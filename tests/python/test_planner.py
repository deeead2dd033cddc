"""The placement planner's second decision (``megatrain.runtime.planner``): device-state layers
against kept graphs after the first optimizer step, by measured sizes and times.

The rule itself is checked on numbers (``plan_placement`` / ``hide_layers``); the re-placement
it leads to (device state given back to the host store or taken from it, kept graphs changed
between steps) is checked for parity with torch.optim.AdamW on CPU, where the "device" is the CPU.
"""

import importlib

import pytest

from test_device_state import HOST_RTOL, _device_layers, _limit_device_room, check, run_pair
from test_parity_cpu import tiny

planner = importlib.import_module("megatrain.runtime.planner")
GiB = 1 << 30


def test_hide_layers_is_the_smallest_k_whose_host_adam_fits_behind_the_gpu():
    n, a, f, b = 32, 0.060, 0.016, 0.033
    k = planner.hide_layers(n, a, f, b)
    am = planner.ADAM_MARGIN * a
    assert (n - k) * am <= (n - 1) * b + k * f  # hidden with k
    assert (n - k + 1) * am > (n - 1) * b + (k - 1) * f  # not with k - 1
    assert planner.hide_layers(n, 0.001, f, b) == 0  # a fast CPU: every layer may stay on the host
    assert planner.hide_layers(n, 10.0, f, b) == n  # a slow CPU: every layer's state on the device
    assert planner.hide_layers(n, 0.0, f, b) == 0


def test_without_clipping_every_graph_is_kept_when_it_fits_next_to_the_hiding_state():
    n, S, G, I = 32, 3 * GiB, 3 * GiB, GiB // 4
    hide = planner.hide_layers(n, 0.06, 0.016, 0.033)
    cap = n * G + hide * S + S // 2  # room for all graphs, the hiding layers and half a layer more
    p = planner.plan_placement(n, n, S, G, I, cap, 0.06, 0.016, 0.033)
    assert p["store_layers"] == n and p["device_state_layers"] == hide == p["hide_layers"]
    used = p["device_state_layers"] * S + n * I + n * (G - I)
    assert used <= cap
    # more room: more device-state layers (fewer streamed weights), every graph still kept
    p2 = planner.plan_placement(n, n, S, G, I, cap + 5 * S, 0.06, 0.016, 0.033)
    assert p2["store_layers"] == n and p2["device_state_layers"] == hide + 5


def test_without_clipping_and_too_little_room_the_hiding_state_comes_first_then_graphs():
    n, S, G, I = 32, 3 * GiB, 3 * GiB, GiB // 4
    hide = planner.hide_layers(n, 0.06, 0.016, 0.033)
    cap = 100 * GiB
    p = planner.plan_placement(n, n, S, G, I, cap, 0.06, 0.016, 0.033)
    assert p["device_state_layers"] == hide
    k = p["store_layers"]
    assert 0 < k < n
    used = hide * S + n * I + k * (G - I)
    assert used <= cap < used + (G - I)  # one more graph would not fit


def test_the_layers_that_may_go_to_the_device_bound_k_and_nothing_fitting_is_the_recompute_engine():
    n, S, G, I = 32, 3 * GiB, 3 * GiB, GiB // 4
    p = planner.plan_placement(n, 10, S, G, I, 400 * GiB, 0.06, 0.016, 0.033)
    assert p["device_state_layers"] == 10 and p["store_layers"] == n  # disk layers never go to the device
    p0 = planner.plan_placement(n, n, S, G, I, n * I - 1, 0.06, 0.016, 0.033)
    assert p0["device_state_layers"] == 0 and p0["store_layers"] == 0


def test_with_clipping_the_first_placement_is_kept():
    m = dict(clip=True, before=dict(device_state_layers=19, store_layers=13))
    p = planner.choose_placement(m)
    assert (p["device_state_layers"], p["store_layers"]) == (19, 13) and p["rule"].startswith("clip")
    m = dict(m, clip=False, layers=32, max_device_layers=32, state_bytes_per_layer=3 * GiB,
             graph_bytes_per_layer=3 * GiB, input_bytes_per_layer=GiB // 4, capacity_bytes=130 * GiB,
             adam_s_per_layer=0.06, fwd_s_per_layer=0.016, bwd_s_per_layer=0.033)
    assert planner.choose_placement(m) == planner.plan_placement(32, 32, 3 * GiB, 3 * GiB, GiB // 4, 130 * GiB,
                                                                 0.06, 0.016, 0.033)


def test_unknown_cpu_adam_time_keeps_as_much_state_as_fits():
    n, S, G, I = 8, GiB, GiB, GiB // 8
    p = planner.plan_placement(n, n, S, G, I, 6 * GiB, None, 0.01, 0.02)
    assert p["device_state_layers"] == (6 * GiB - n * I) // S == 5
    assert p["device_state_layers"] * S + n * I + p["store_layers"] * (G - I) <= 6 * GiB


def _force_plan(monkeypatch, K, k):
    seen = []

    def choose(m):
        seen.append(m)
        return dict(device_state_layers=K, store_layers=k, hide_layers=None, rule="forced by the test")

    monkeypatch.setattr(planner, "choose_placement", choose)
    return seen


@pytest.mark.parametrize("start,K,k,clip,micro", [
    (3, 1, 1, None, 1),   # every layer's state on the device, then two given back to the host store
    (0, 2, 3, 1.0, 1),    # only the resident unit at first, then two layers taken onto the device
    (3, 0, 0, 1.0, 1),    # every layer back on the host, every graph dropped (recompute)
    (1, 3, 2, None, 2),
])
def test_replan_after_the_first_step_moves_state_and_graphs_with_parity(monkeypatch, start, K, k, clip, micro):
    """After step 1 the planner's choice is applied between steps (state copied to / from the host
    store, slots made / dropped, kept graphs changed); training matches torch.optim.AdamW throughout."""
    _limit_device_room(monkeypatch, start)
    seen = _force_plan(monkeypatch, K, k)
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=micro, max_grad_norm=clip,
                                    device_state_layers="auto", policy="auto")
    eng = wrapped.megatrain
    assert len(seen) == 1, "placed again exactly once"
    s = seen[0]
    assert s["layers"] == 3 and s["graph_bytes_per_layer"] > s["input_bytes_per_layer"] > 0
    assert s["clip"] == (clip is not None) and s["before"]["device_state_layers"] == start
    assert s["adam_s_per_layer"] > 0 and s["fwd_s_per_layer"] > 0 and s["bwd_s_per_layer"] >= 0
    assert _device_layers(wrapped) == list(range(K))
    (d,) = eng.auto_decisions.values()
    assert d["store_layers"] == k and d["recompute_layers"] == 3 - k
    info = eng.placement()["replan"]
    assert info["before"]["device_state_layers"] == start and info["device_state_layers"] == K
    assert info["adam_from"] == ("measured" if start < 3 else "scratch kernel")
    assert eng.stats()["device_state_layers"] == K
    check(ref, got, wrapped, rtol=HOST_RTOL)  # a layer's updates ran on both paths


def test_no_replan_for_an_explicit_placement(monkeypatch):
    seen = _force_plan(monkeypatch, 0, 0)
    _, _, wrapped, _ = run_pair(tiny("llama"), device_state_layers=2, policy="auto")
    assert not seen and wrapped.megatrain.placement()["replan"] is None
    assert _device_layers(wrapped) == [0, 1]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_replan_with_the_real_rule_keeps_parity(monkeypatch, clip):
    """The unforced rule on CPU (capacity: the host's available memory) still trains as torch."""
    _limit_device_room(monkeypatch, 1)
    ref, got, wrapped, _ = run_pair(tiny("llama"), micro_batches=2, max_grad_norm=clip,
                                    device_state_layers="auto", policy="auto")
    info = wrapped.megatrain.placement()["replan"]
    assert info is not None and info["rule"].startswith("clip" if clip else "no clip")
    assert info["store_layers"] == 3  # the CPU has room for every graph
    if clip:  # the first placement kept
        assert info["device_state_layers"] == 1 == len(_device_layers(wrapped))
    check(ref, got, wrapped, rtol=HOST_RTOL)
