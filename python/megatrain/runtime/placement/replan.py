"""The placement planner's second decision: device-state layers against kept activations.

``device_state_layers="auto"`` with ``activation_policy="auto"`` (the default on CUDA) first
places by a fixed share of the free device memory (:func:`~.device_state_plan.plan_device_state_layers`
at wrap, then as many kept layer graphs as fit what is left at the first forward). During the
first optimizer step the engine measures what the choice depends on; at the first training
forward after it, it places once more (:meth:`PlacementReplan.replan`, by :func:`choose_placement`):

* one more device-state layer costs its state bytes ``S`` (compute copy + fp32 master,
  exp_avg, exp_avg_sq; + the fp32 grad accumulator when gradients are summed) and takes that layer's CPU AdamW (``adam_s`` per layer,
  measured on the CPU worker) off the host;
* one more kept graph (``store``) costs ``G - I`` (its graph bytes minus the saved input a
  recomputed layer keeps anyway) and saves one layer forward in backward.

Without clipping a host layer's update runs on the CPU worker while the GPU goes on: the deepest
layers' gradients come first in backward, and layer ``j``'s update must be done before the next
forward reaches layer ``j``. With the deepest ``n - K`` layers on the host, the worker's
``(n - K) * adam_s`` seconds fit in ``(n - 1) * bwd_s + K * fwd_s`` (the rest of the backward, then
the forward of the device-state layers), so the smallest such ``K`` hides the CPU work
(:func:`hide_layers`); beyond it a device-state layer saves nothing, while a kept graph saves a
forward. :func:`plan_placement` therefore keeps ``K >= hide_layers`` device-state layers, then
every layer's graph if it fits, then more device-state layers in what is left (fewer streamed
weights). Measured on the H200 (docs/placement.md): Llama 3.37B, 4 x 4096 tokens: every graph
and every layer's state on the device, 0.864 s/step against 0.901 for GPU-resident PyTorch
without checkpointing; 6.74B: 16 device-state layers and 23 kept graphs (before: 19 and 13),
1.811 s/step against 2.097 with checkpointing.

With clipping every update waits for the global norm, after the whole backward; the host layers'
updates then run in forward order while the next forward goes on, and each must be done before
the main thread prefetches its layer (one layer ahead). :func:`clip_hide_layers` gives the
smallest ``K`` for which they all are; when it is more than the first placement's ``K``, the state
of layers up to it moves to the device and the kept graphs are decided again by
``activation_policy="auto"``'s own rule on the memory then free (:func:`~..activations.policies.auto_store_layers`),
not by the measured capacity: filled to that capacity (6.74B: 24 layers' state and 13 graphs, 134 of
139.8 GiB held by the caching allocator) a clipped step took 2.12 s, against 1.91 s with 24 layers'
state and the 10 graphs the auto rule keeps (119 GiB), and 2.09 s for the first placement (19 and
13: the 13 host layers' CPU AdamW, 0.62 s, outlasts the next forward). Otherwise the first
placement is kept. Measured with this rule (6.74B, 19 -> 25 layers' state, 9 graphs): 2.07-2.09 s
per timed step, PyTorch with checkpointing 2.08 in the same call; the 24 + 10 given at wrap took
1.91 (another call): a placement reached after the first step runs slower, for a reason not yet
measured (docs/placement.md).

Side effect: the first step resets the device's peak-memory statistics
(``torch.cuda.reset_peak_memory_stats``) to measure the step's transient memory.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Optional

import torch

from ..activations.policies import auto_store_layers

# Margin on the measured CPU AdamW time per layer in the hiding condition (the worker also copies
# gradients and contends with the H2D / D2H copies for host memory bandwidth).
ADAM_MARGIN = 1.25


def hide_layers(n: int, adam_s: float, fwd_s: float, bwd_s: float) -> int:
    """Smallest ``K`` (device-state layers ``0 .. K-1``) whose host layers' CPU AdamW hides behind
    the GPU without clipping: ``(n - K) * ADAM_MARGIN * adam_s <= (n - 1) * bwd_s + K * fwd_s``.

    Args:
        n: decoder layers.
        adam_s: measured CPU AdamW seconds of one layer.
        fwd_s / bwd_s: measured seconds of one layer's forward / backward on the device.

    Returns:
        ``K`` in ``0 .. n`` (``n``: the CPU cannot keep up even with one host layer).
    """
    a = ADAM_MARGIN * max(0.0, adam_s)
    if a <= 0.0:
        return 0
    k = math.ceil((n * a - (n - 1) * max(0.0, bwd_s)) / (a + max(0.0, fwd_s)))
    return min(n, max(0, k))


def clip_hide_layers(n: int, adam_s: float, fwd_s: float) -> int:
    """Smallest ``K`` (device-state layers ``0 .. K-1``) whose host layers' CPU AdamW hides behind the
    next forward under clipping.

    With ``max_grad_norm`` no update starts before the global norm, after the whole backward; the
    worker then runs the host layers ``K .. n-1`` in forward order, one every ``ADAM_MARGIN * adam_s``
    seconds, while the next forward runs layer after layer (``fwd_s`` each) and the main thread, one
    layer ahead, prefetches layer ``K + i`` when the forward starts layer ``K + i - 1``. Hidden when
    ``(i + 1) * ADAM_MARGIN * adam_s <= (K + i - 1) * fwd_s`` for every host layer ``K + i``.

    Args:
        n: decoder layers.
        adam_s: measured CPU AdamW seconds of one layer.
        fwd_s: measured seconds of one layer's forward on the device.

    Returns:
        ``K`` in ``0 .. n`` (``n``: not even one host layer's update hides).
    """
    a, f = ADAM_MARGIN * max(0.0, adam_s), max(0.0, fwd_s)
    if a <= 0.0:
        return 0
    for k in range(n + 1):
        if all((i + 1) * a <= (k + i - 1) * f for i in range(n - k)):
            return k
    return n


def plan_placement(n: int, max_device_layers: int, state_bytes: int, graph_bytes: int, input_bytes: int,
                   capacity: int, adam_s: Optional[float], fwd_s: float, bwd_s: float) -> dict:
    """Device-state layers ``K`` and kept graphs ``k`` for one input shape without clipping, within ``capacity``.

    Args:
        n: decoder layers.
        max_device_layers: the most layers whose state may go to the device (layers on disk never).
        state_bytes: device bytes of one layer's training state (``S``).
        graph_bytes / input_bytes: measured bytes one layer's kept graph / saved input holds (``G``, ``I``).
        capacity: device bytes for the state of the ``K`` layers and every layer's activations.
        adam_s: measured CPU AdamW seconds per layer, or None when unknown (then ``K`` does not
            go below the most that fits).
        fwd_s / bwd_s: measured seconds per layer forward / backward.

    Returns:
        ``dict(device_state_layers=K, store_layers=k, hide_layers=..., rule=...)``: ``K * S`` plus
        ``k`` graphs and ``n - k`` saved inputs fit ``capacity`` (``K`` and ``k`` may be 0 when
        nothing fits: the recompute engine).
    """
    S, G, I = max(1, int(state_bytes)), max(0, int(graph_bytes)), max(0, int(input_bytes))
    extra = max(1, G - I)  # a kept graph replaces the layer's saved input
    kmax = max(0, min(n, int(max_device_layers)))

    def fit_state(room: int) -> int:
        return max(0, min(kmax, room // S))

    def fit_graphs(room: int) -> int:
        return max(0, min(n, room // extra))

    inputs = n * I
    hide = kmax if adam_s is None else min(kmax, hide_layers(n, adam_s, fwd_s, bwd_s))
    all_graphs = inputs + n * extra
    if all_graphs + hide * S <= capacity:
        return dict(device_state_layers=max(hide, fit_state(capacity - all_graphs)), store_layers=n,
                    hide_layers=hide, rule="no clip: every graph kept, device state in what is left")
    K = min(hide, fit_state(capacity - inputs))
    k = fit_graphs(capacity - inputs - K * S)
    return dict(device_state_layers=K, store_layers=k, hide_layers=hide,
                rule="no clip: device state to hide the CPU AdamW, graphs in what is left")


def choose_placement(m: dict) -> dict:
    """The second decision from the first step's measurements ``m`` (the keys of
    ``PlacementReplan.info``): under clipping the first placement, or the state of the layers
    :func:`clip_hide_layers` asks for, no more than the capacity holds beside every layer's input (``store_layers``
    None: decided after the move by the auto rule), else :func:`plan_placement`."""
    if m["clip"]:
        K_now, k_now = m["before"]["device_state_layers"], m["before"]["store_layers"]
        adam_s = m.get("adam_s_per_layer")
        # no more layers' state than the measured capacity holds beside every layer's input (the least the
        # activations need): the hiding count alone ran a GPU with too little room out of memory
        inputs = m["layers"] * m["input_bytes_per_layer"]
        room = max(0, (m["capacity_bytes"] - inputs) // max(1, m["state_bytes_per_layer"]))
        hide = None if adam_s is None else min(m["max_device_layers"], room, clip_hide_layers(m["layers"], adam_s,
                                                                                           m["fwd_s_per_layer"]))
        if hide is None or hide <= K_now:
            return dict(device_state_layers=K_now, store_layers=k_now, hide_layers=hide,
                        rule="clip: the first placement kept")
        # store_layers None: decided again by the auto rule on the memory free after the move
        return dict(device_state_layers=hide, store_layers=None, hide_layers=hide,
                    rule="clip: device state to hide the CPU AdamW behind the next forward, graphs by the auto rule")
    return plan_placement(m["layers"], m["max_device_layers"], m["state_bytes_per_layer"], m["graph_bytes_per_layer"],
                          m["input_bytes_per_layer"], m["capacity_bytes"], m["adam_s_per_layer"],
                          m["fwd_s_per_layer"], m["bwd_s_per_layer"])


# Device bytes kept free when placing again: fragmentation, cuBLAS workspaces, what a later step's
# batch adds (a share of the device's memory, plus a constant).
REPLAN_MARGIN_FRACTION = 0.04
REPLAN_MARGIN_BYTES = 1 << 30


def scratch_adam_seconds(numel: int, probe: int = 1 << 24) -> float:
    """CPU AdamW seconds for ``numel`` parameters, from two timed runs of the fused kernel on
    ``probe`` scratch parameters (fp32 state, bf16 compute copy; memory bound, so linear in size)."""
    from ... import ops

    n = int(max(1, min(numel, probe)))
    t = [torch.zeros(n, dtype=torch.float32) for _ in range(4)]
    out = torch.empty(n, dtype=torch.bfloat16)
    best = math.inf
    for _ in range(2):
        t0 = time.perf_counter()
        ops.adamw_step_(t[0], t[1], t[2], t[3], out, lr=1e-3, step=1)
        best = min(best, time.perf_counter() - t0)
    return best * numel / n


class PlacementReplan:
    """The placement planner's second decision, the ``replanner`` part of a
    :class:`~megatrain.runtime.model.wrapped_engine.WrappedEngine`: measures the first optimizer step
    (per-layer forward / backward time on the compute stream, CPU AdamW time per host layer, the
    device memory beyond the planned activations) and then places once more by :func:`choose_placement`
    (``device_state_layers="auto"`` with ``activation_policy="auto"``; see the module docstring).

    Args:
        engine: the engine whose device-state layers it places; what it uses of it: ``layers``,
            ``units``, ``device``, ``cuda``, ``compute_dtype``, ``dp``, ``disk``, ``device_state``,
            ``optimizer``, ``gpu_memory_limit_bytes``, ``compute_stream()``, ``stats()``, ``flush()``,
            ``free_device_bytes()`` and ``resize_device_state(K)``.
        policy: the engine's :class:`~..activations.policies.LayerActivations` (its ``auto_decisions``
            are read and their kept graphs changed).
        enabled: whether it measures and places again at all.

    ``info``: None until it ran; then what it measured and chose (``placement()["replan"]``).
    """

    def __init__(self, engine, policy, enabled: bool):
        self.engine = engine
        self.policy = policy
        self._state = "measure" if enabled else "off"
        self._marks = {"fwd": [], "bwd": []}
        self._base = None
        self.info: Optional[dict] = None

    def mark(self, kind: str) -> None:
        """A layer call of the measured step starts (``"fwd"``: with grad; ``"bwd"``: its backward)."""
        eng = self.engine
        if self._state != "measuring" or len(self._marks[kind]) >= 8 * max(1, len(eng.layers)):
            return
        if eng.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(eng.compute_stream())
            self._marks[kind].append(ev)
        else:
            self._marks[kind].append(time.perf_counter())

    def begin_forward(self) -> None:
        """At a training forward: start measuring (at a step's first forward: the first step of a
        run, or of a resumed one), or, once that step is done, place again."""
        eng = self.engine
        state = self._state
        if state == "off" or state == "done" or not torch.is_grad_enabled():
            return
        opt = eng.optimizer
        steps = getattr(opt, "steps_called", 0) if opt is not None else 0
        if any(b for u in eng.units for b in u.batches):
            return  # gradients accumulated since the last step: inside a step
        if state == "measure":
            self._state = "measuring"
            stats = eng.stats()
            if eng.cuda:
                torch.cuda.reset_peak_memory_stats(eng.device)
            self._base = dict(adam_time_s=stats["adam_time_s"], steps=steps,
                              allocated=torch.cuda.memory_allocated(eng.device) if eng.cuda else 0)
            return
        if steps == self._base["steps"]:
            return  # the measured step has not been taken yet
        self._state = "done"
        self.replan()

    def _layer_seconds(self, kind: str) -> float:
        marks = self._marks[kind]
        n = len(self.engine.layers)
        if len(marks) < 2:
            return 0.0
        if self.engine.cuda:
            marks[-1].synchronize()
            diffs = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            diffs = [b - a for a, b in zip(marks, marks[1:])]
        # consecutive calls of one pass (n - 1 gaps per forward / backward; the step boundary dropped)
        per_pass = [d for i, d in enumerate(diffs) if (i + 1) % n != 0]
        return statistics.median_high(per_pass) if per_pass else 0.0

    def _capacity(self, dev_layers, acts: int) -> tuple:
        """``(capacity, transient)``: device bytes for the device-state layers and every layer's
        activations (free now + what ``dev_layers`` hold - the step's transient peak - a margin)."""
        from . import device_state_plan as dsp

        eng = self.engine
        free = eng.free_device_bytes()
        if eng.cuda:
            total = torch.cuda.get_device_properties(eng.device).total_memory
            if eng.gpu_memory_limit_bytes is not None:  # wrap(gpu_memory_limit=): the margin of the capped device
                total = min(total, eng.gpu_memory_limit_bytes)
            transient = max(0, torch.cuda.max_memory_allocated(eng.device) - self._base["allocated"] - acts)
        else:
            total, transient = free, 0
        margin = int(REPLAN_MARGIN_FRACTION * total) + REPLAN_MARGIN_BYTES if eng.cuda else 0
        capacity = free + sum(u.device_state.nbytes for u in dev_layers) - transient - margin
        return capacity, transient

    def replan(self) -> Optional[dict]:
        """Place the device-state layers and kept graphs again from the first step's measurements.

        Called once, at the first training forward after the measured step (the first step of the
        run, or of a resumed run), with no gradient accumulated since. Does nothing for a shape decided as ``block:K`` (long context),
        under data parallel or the disk tier, with exclusive device-state layers (the host store did not fit: the
        device was planned for capacity, and moving more state there ran the 17B pool model out of GPU memory on
        the H200), or before an ``auto`` decision was measured.
        Returns ``self.info``.
        """
        from . import device_state_plan as dsp

        eng = self.engine
        decisions = [d for d in self.policy.auto_decisions.values() if d.get("block_k", 1) == 1]
        fwd_s, bwd_s = self._layer_seconds("fwd"), self._layer_seconds("bwd")
        self._marks = {"fwd": [], "bwd": []}
        if not decisions or eng.dp is not None or eng.disk is not None or not eng.layers:
            return None
        if eng.device_state is not None and eng.device_state.exclusive:
            return None  # the store did not fit: wrap planned the device for capacity, not for speed
        d = max(decisions, key=lambda x: x["bytes_per_layer"])
        n = len(eng.layers)
        G, I, k_now = int(d["bytes_per_layer"]), int(d["bytes_per_input"]), int(d["store_layers"])
        if k_now < n:  # the backward diffs of recomputed layers hold one forward too
            bwd_s = max(0.0, bwd_s - fwd_s * (n - k_now) / n)
        dev_layers = eng.device_state.layers if eng.device_state is not None else []
        opt = eng.optimizer
        summed = getattr(opt, "gradient_accumulation_steps", 1) > 1 or any(u.device_state.grad is not None
                                                                           for u in dev_layers)
        S = dsp.unit_device_bytes(eng.layers[0], eng.compute_dtype, with_grad=summed)
        K_now = len(dev_layers)
        host_layers = n - K_now
        eng.flush()  # the first step's CPU updates, all of them timed
        steps = max(1, getattr(opt, "steps_called", 1) - self._base["steps"])  # steps measured
        adam_delta = (eng.stats()["adam_time_s"] - self._base["adam_time_s"]) / steps
        if host_layers > 0 and adam_delta > 0:
            adam_s, adam_from = adam_delta / host_layers, "measured"
        else:
            adam_s, adam_from = scratch_adam_seconds(eng.layers[0].state_numel), "scratch kernel"
        capacity, transient = self._capacity(dev_layers, k_now * G + (n - k_now) * I)
        measured = dict(before=dict(device_state_layers=K_now, store_layers=k_now), layers=n, max_device_layers=n,
                        clip=opt is not None and opt.max_grad_norm is not None, state_bytes_per_layer=S,
                        graph_bytes_per_layer=G, input_bytes_per_layer=I, capacity_bytes=int(capacity),
                        transient_bytes=int(transient), adam_s_per_layer=adam_s, adam_from=adam_from,
                        fwd_s_per_layer=fwd_s, bwd_s_per_layer=bwd_s)
        plan = choose_placement(measured)
        K, k = plan["device_state_layers"], plan["store_layers"]
        if eng.cuda and K > K_now:
            # the new state in fresh segments, not split out of the freed activations' ones
            torch.cuda.empty_cache()
        eng.resize_device_state(K)
        if k is None:  # the auto rule's share of what is free now (see clip_hide_layers)
            free = eng.free_device_bytes()
            k = auto_store_layers(n, G, I, free)[0]
            plan = dict(plan, store_layers=k, free_bytes_after_move=int(free))
        for dd in decisions:
            kk = k if dd is d else min(n, k if dd["bytes_per_layer"] <= G else dd["store_layers"])
            dd.update(store=kk == n, store_layers=kk, recompute_layers=n - kk)
        self.info = dict(measured, **plan)
        return self.info
