"""The placement planner's second decision (``megatrain.runtime.placement.replan``): device-state layers
against kept graphs after the first optimizer step, by measured sizes and times.

The rule itself is checked on numbers (``plan_placement`` / ``hide_layers``); the re-placement
it leads to (device state given back to the host store or taken from it, kept graphs changed
between steps) is checked for parity with torch.optim.AdamW on CPU, where the "device" is the CPU.
"""

import importlib

import pytest

from test_device_state import HOST_RTOL, _device_layers, _limit_device_room, check, run_pair
from test_parity_cpu import tiny

planner = importlib.import_module("megatrain.runtime.placement.replan")
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


def test_clip_hide_layers_is_the_smallest_k_whose_host_adam_fits_behind_the_next_forward():
    n, a, f = 32, 0.048, 0.0148  # 6.74B Llama, 4 x 4096 tokens, on the H200
    k = planner.clip_hide_layers(n, a, f)
    am = planner.ADAM_MARGIN * a
    assert all((i + 1) * am <= (k + i - 1) * f for i in range(n - k))  # every host layer's update in time
    assert any((i + 1) * am > (k - 1 + i - 1) * f for i in range(n - k + 1))  # not with k - 1
    assert k == 25
    assert planner.clip_hide_layers(n, 0.0, f) == 0
    assert planner.clip_hide_layers(n, 10.0, f) == n  # a slow CPU: every layer's state on the device
    assert planner.clip_hide_layers(n, 0.001, f) == 2  # prefetched one layer ahead: layers 0 and 1 cannot wait


def _clip_measurement(K_now, k_now, adam_s=0.048):
    return dict(clip=True, before=dict(device_state_layers=K_now, store_layers=k_now), layers=32, max_device_layers=32,
                state_bytes_per_layer=3 * GiB, graph_bytes_per_layer=3 * GiB, input_bytes_per_layer=GiB // 4,
                capacity_bytes=130 * GiB, adam_s_per_layer=adam_s, fwd_s_per_layer=0.0148, bwd_s_per_layer=0.035)


def test_with_clipping_the_state_moves_to_the_device_only_when_the_host_updates_would_outlast_the_forward():
    hide = planner.clip_hide_layers(32, 0.048, 0.0148)
    p = planner.choose_placement(_clip_measurement(19, 13))  # 13 host layers: their updates outlast the forward
    assert p["device_state_layers"] == hide and p["store_layers"] is None  # graphs: the auto rule, after the move
    assert p["rule"].startswith("clip: device state")
    for K_now in (hide, 28):  # already hidden: the first placement kept
        p = planner.choose_placement(_clip_measurement(K_now, 7))
        assert (p["device_state_layers"], p["store_layers"]) == (K_now, 7) and p["rule"] == "clip: the first placement kept"
    m = dict(_clip_measurement(19, 13), max_device_layers=20)  # layers 20.. on disk: never on the device
    assert planner.choose_placement(m)["device_state_layers"] == 20
    m = dict(_clip_measurement(19, 13), clip=False)
    assert planner.choose_placement(m) == planner.plan_placement(32, 32, 3 * GiB, 3 * GiB, GiB // 4, 130 * GiB,
                                                                 0.048, 0.0148, 0.035)


def test_the_auto_rule_keeps_what_fits_its_share_of_the_free_memory():
    policies = importlib.import_module("megatrain.runtime.activations.policies")
    G, I, free = 3057778704, 134217728, 56947037696  # 6.74B, 24 layers' state on the H200: 10 graphs measured
    k, block_k = policies.auto_store_layers(32, G, I, free)
    assert (k, block_k) == (10, 1)
    assert 32 * I + k * (G - I) <= policies.AUTO_STORE_FRACTION * free < 32 * I + (k + 1) * (G - I)
    assert policies.auto_store_layers(32, I, I, free) == (32, 1)  # a graph no larger than its input: all kept
    k0, bk = policies.auto_store_layers(32, G, 2 * GiB, 100 * GiB)  # not even the inputs fit: block:K
    assert k0 == 0 and bk > 1


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
    if clip:  # the first placement kept, or the state of the layers that hide the host updates moved
        want = max(1, min(3, planner.clip_hide_layers(3, info["adam_s_per_layer"], info["fwd_s_per_layer"])))
        assert info["device_state_layers"] == want == len(_device_layers(wrapped))
        assert info["rule"] == ("clip: the first placement kept" if want == 1 else info["rule"])
    check(ref, got, wrapped, rtol=HOST_RTOL)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_no_replan_when_layers_are_exclusive(monkeypatch, clip):
    """A host store that does not fit makes leading layers exclusive (their state on the device only): the
    device was then planned for capacity. The replanner used to place again after the first step and take
    more layers' state onto the device, which ran the 17B pool model (25 exclusive layers) out of GPU memory on
    the H200; now it keeps the first placement, and training still matches torch."""
    import copy

    import megatrain

    _limit_device_room(monkeypatch, 1)
    model = tiny("llama")
    sizer = megatrain.wrap(copy.deepcopy(model), device="cpu", device_state_layers="auto", activation_policy="auto")
    limit = sizer.megatrain.offload_plan.host_bytes - 1  # one byte short: leading layers exclusive
    sizer.megatrain.close()
    seen = _force_plan(monkeypatch, 3, 3)  # what the replanner would be asked to do: every layer's state moved
    ref, got, wrapped, _ = run_pair(model, max_grad_norm=clip, device_state_layers="auto", policy="auto",
                                    host_memory_limit=limit)
    pl = wrapped.megatrain.placement()
    assert pl["exclusive_layers"] and pl["exclusive_layers"] == list(range(len(pl["exclusive_layers"])))
    assert not seen and pl["replan"] is None
    check(ref, got, wrapped, rtol=HOST_RTOL)


def test_with_clipping_no_more_state_moves_than_the_capacity_holds():
    """The clip rule asked for ``clip_hide_layers`` layers' state whatever the measured capacity: on a GPU
    with room for fewer, the move ran it out of memory. Now the count is capped by what the capacity holds
    beside every layer's input; with room for no more than the first placement, that placement is kept."""
    hide = planner.clip_hide_layers(32, 0.048, 0.0148)
    inputs = 32 * (GiB // 4)
    m = dict(_clip_measurement(19, 13), capacity_bytes=inputs + 22 * 3 * GiB + GiB)  # room for 22 layers' state
    assert hide > 22
    p = planner.choose_placement(m)
    assert p["device_state_layers"] == 22 and p["rule"].startswith("clip: device state")
    m = dict(_clip_measurement(19, 13), capacity_bytes=inputs + 10 * 3 * GiB)  # less than the 19 placed now
    p = planner.choose_placement(m)
    assert (p["device_state_layers"], p["store_layers"]) == (19, 13) and p["rule"] == "clip: the first placement kept"
