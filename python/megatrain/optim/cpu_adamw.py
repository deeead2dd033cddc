"""``CPUAdamW``: torch-compatible AdamW whose state lives in megatrain's host store.

The optimizer reaches the engine of the wrapped model only through an
:class:`~megatrain.runtime.engine.optimizer_port.OptimizerPort`; the engine calls back through the
:class:`~megatrain.runtime.engine.optimizer_port.EngineOptimizer` protocol. The class is put together
from :mod:`.param_groups` (param groups, ``optimizer.state``, ``state_dict`` / ``load_state_dict``),
:mod:`.updates` (work items, eager updates, non-finite skips) and this module (construction,
``step()`` in its phases, ``zero_grad``); the argument checks are :mod:`.hyperparams`'.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, Iterable, Optional

import torch

from ..runtime.engine.optimizer_port import GradView, OptimizerPort
from .hyperparams import NONFINITE_MODES, check_arguments
from .param_groups import ParamGroups
from .updates import UpdatePlanning, forward_order

__all__ = ["CPUAdamW", "NONFINITE_MODES"]


class CPUAdamW(ParamGroups, UpdatePlanning, torch.optim.Optimizer):
    """AdamW over fp32 master weights in host memory, run by megatrain's fused CPU kernel.

    The update rule is exactly ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
    a step count per parameter) [Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019]. ``exp_avg`` / ``exp_avg_sq`` are zero-copy views of the host store (fp32, CPU);
    for the layers whose state is on disk (``wrap(offload_dir=...)``) copies read at each access
    (write them with ``load_state_dict``).
    The update also writes the compute copy (bf16, round to nearest even; or fp32) that the
    next forward streams to the device.

    Gradients are summed over every backward since the last ``step()`` / ``zero_grad()``
    (gradient accumulation: scale the loss by ``1 / gradient_accumulation_steps`` as with plain
    PyTorch). With ``max_grad_norm`` the global L2 norm over all gradients is clipped exactly
    like ``torch.nn.utils.clip_grad_norm_`` before the update (the scale is applied inside the
    fused pass). Parameters that received no gradient (``requires_grad=False``, or unused this
    step) are not touched, not even by weight decay.

    ``step()`` returns once the updates are queued; they run on megatrain's CPU worker in forward
    order while the next forward starts (each layer's load waits only for that layer's update).
    ``state_dict()`` and anything reading weights wait for them. The layers whose state is on the
    device (``device_state_layers``) are updated there in ``step()``. For a layer with a
    ``model.state_dict()`` tensor still alive, ``step()`` returns only once that tensor shows the new
    weights (it waits for the layer's CPU update, or copies a device-state layer's fp32 masters to
    host memory), so held state_dict tensors read the current weights as torch's do.

    Args:
        params: parameters of a model wrapped by ``megatrain.wrap`` (or param-group dicts).
        lr: learning rate (float, > 0 or 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: term added to the denominator, > 0 or 0.
        weight_decay: decoupled weight decay coefficient.
        max_grad_norm: clip the global gradient L2 norm to this value (None: no clipping).
        nonfinite: what a non-finite (NaN / inf) gradient does; it never reaches the master weights.
            ``"skip"`` (the default, as ``torch.amp.GradScaler`` and DeepSpeed do on overflow): the
            update is skipped with a ``RuntimeWarning`` (one per step, naming the skipped decoder
            layers, e.g. ``model.layers.0``, and resident parameters, e.g. ``lm_head.weight``, wherever
            their state is) and counted in ``skipped_steps``. ``"raise"``:
            ``step()`` raises ``FloatingPointError`` (after dropping the gradients). With
            ``max_grad_norm`` the global norm is known before any update, so the whole step is
            skipped (weights, ``exp_avg``, ``exp_avg_sq``, step counts unchanged). Without it a
            layer's update starts during backward (see ``gradient_accumulation_steps``): each
            layer's gradient is checked before its own update, and only the layers with a
            non-finite gradient are skipped (a NaN / inf loss makes every gradient non-finite, so
            then the whole step is skipped); ``"raise"`` then waits in ``step()`` for the updates.
        gradient_accumulation_steps: backward passes per ``step()``. Without clipping, a layer's
            update starts on the CPU as soon as its gradient from the last of these backward
            passes has landed, overlapping the rest of backward and the next forward
            (docs/architecture.md); a further backward before ``step()`` then raises. With clipping the
            updates wait for ``step()``. With 1 (the default) a layer's bf16 gradient is copied
            straight into its compute copy in host memory and read from there by the fused
            update: no fp32 accumulation pass. More backward passes than declared still sum
            correctly with clipping (the engine moves the gradient to the fp32 accumulator).
        amsgrad, maximize, differentiable: ``torch.optim.AdamW``'s; only ``False`` is accepted.
        foreach, fused, capturable: ``torch.optim.AdamW``'s implementation selectors; accepted and
            without effect (there is one fused CPU implementation).

    As ``torch.optim.AdamW``: ``add_param_group`` trains the new group from the next ``step()``;
    ``zero_grad(set_to_none=False)`` followed by ``step()`` runs a zero-gradient update of the
    parameters that held a gradient; ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
    clips exactly when ``max_grad_norm`` is set (see ``megatrain.runtime.model.module_api``). Unlike it,
    a second ``step()`` without a backward in between raises (the gradients were consumed).

    Raises:
        ValueError: a hyperparameter of the wrong type or out of range, here or in a param group
            (``eps`` must be > 0: with 0 a zero gradient gives 0/0 = NaN), a refused option, or a
            parameter not managed by megatrain.
    """

    megatrain_optimizer = True  # megatrain's own: the engine's guard against other optimizers lets it step

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_grad_norm: Optional[float] = None,
                 gradient_accumulation_steps: int = 1, nonfinite: str = "skip", *, amsgrad: bool = False,
                 maximize: bool = False, foreach: Optional[bool] = None, fused: Optional[bool] = None,
                 capturable: bool = False, differentiable: bool = False):
        check_arguments(lr, betas, eps, weight_decay, max_grad_norm, gradient_accumulation_steps, nonfinite,
                        amsgrad, maximize, differentiable)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, fused=fused, capturable=capturable, differentiable=False,
                        decoupled_weight_decay=True)
        self._port: Optional[OptimizerPort] = None  # built from the first parameter's engine (add_param_group)
        self._entry = {}  # (unit index, entry index) -> (group, param)
        self._moment_versions = {}  # (unit, entry, "exp_avg" | "exp_avg_sq") -> the handed-out tensor's _version seen
        # torch's p.grad, per entry: "alive" (a tensor, maybe all zeros: zero_grad(set_to_none=False))
        # or None; "zero": alive and all zeros; "consumed": the last step() applied gradients and
        # no backward / zero_grad came since (a second step() would re-apply them in torch).
        self._alive: set = set()
        self._zero: set = set()
        self._consumed = False
        # clip_grad_norm_ on the model's parameters since the last step: its coefficient(s), applied in step()
        self.user_clip_scale = 1.0
        # updates queued during backward since the last step (no clipping): id(group) -> (group, the
        # hyperparameters they ran with), so that step() / zero_grad() can say what torch would do instead
        self._eager_groups: dict = {}
        self._eager_warned: set = set()
        self._constructing = True  # add_param_group's errors then name the constructor's param group
        super().__init__(params, defaults)
        self._constructing = False
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if self._port is None:
            raise ValueError("megatrain.optim.CPUAdamW: got an empty parameter list")
        prev = self._attach()
        if prev is not None:
            self._start_fresh()
        self._last_grad_norm: Optional[float] = None
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps whose update was skipped (whole or in part): non-finite gradients
        self._skipped_ids: set = set()
        self._steps_called = 0  # step() calls that returned; the one running (or next) is number + 1
        self._skipped_units: list = []  # (step number, unit name) appended by the CPU worker (no clipping)

    def _attach(self):
        """Check and attach this optimizer to the model's engine; returns the optimizer it replaces, or None.

        Raises:
            ValueError: the model has a CPUAdamW for other parameters; accumulation without an accumulator.
            RuntimeError: a parameter frozen at wrap was unfrozen.
        """
        port = self._port
        prev = port.optimizer
        if prev is not None and not set(prev._entry) <= set(self._entry):
            # One optimizer per model: the engine routes every gradient to it (and step()/zero_grad()
            # act on the whole model). A replacement that covers the old one's parameters is fine.
            raise ValueError("megatrain.optim.CPUAdamW: this model already has a CPUAdamW for other parameters; use one "
                             "CPUAdamW with several param groups (each group can have its own lr, weight_decay, betas)")
        port.check_frozen()
        gas = self.gradient_accumulation_steps
        if gas > 1 and not port.has_accumulator:
            raise ValueError(f"megatrain.optim.CPUAdamW: gradient_accumulation_steps={gas} needs the "
                             "fp32 gradient accumulator, but the model was wrapped with grad_accumulator=False; wrap with "
                             "grad_accumulator=None (the default) or True")
        if gas > 1:
            port.enable_accumulator()  # wrap(grad_accumulator=None): allocated now, when it is known to be needed
        port.attach(self)
        return prev

    @property
    def engine(self):
        """The engine of the wrapped model whose parameters this optimizer trains (read through its port)."""
        return self._port.engine

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The global L2 norm of the gradients of the last ``step()``, before any clipping in that step.

        It is the norm ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` returns (and the HF
        Trainer logs as ``grad_norm``): neither ``max_grad_norm`` nor a ``clip_grad_norm_`` called
        before ``step()`` changes it (the weights are updated with the clipped gradient all the same).
        A float (``nan`` / ``inf`` when the step was skipped as a whole for a non-finite gradient);
        None before the first ``step()`` and otherwise without ``max_grad_norm`` (each layer's update
        then starts during backward, before any global norm is known).
        """
        return self._last_grad_norm

    @property
    def steps_called(self) -> int:
        """``step()`` calls that returned (the step running, or the next one, is this number + 1)."""
        return self._steps_called

    def _check_current(self, call: str) -> None:
        # One CPUAdamW per model: a newer one took over the model's gradients and its updates
        # (eager ones start during backward with its settings). Stepping this one would apply them silently.
        if self._port.optimizer is not self:
            raise RuntimeError(f"megatrain.optim.CPUAdamW: {call}() on an optimizer that a newer CPUAdamW for the same "
                               "model replaced (the newest one receives the gradients and runs the updates); call "
                               "the newest one's step() / zero_grad(), or create only one CPUAdamW per model")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget gradients accumulated since the last step (the next backward starts afresh).

        ``set_to_none=False`` as torch: the parameters that held a gradient (of an earlier step, or of
        a backward since the last step) now hold zeros, so a ``step()`` still updates them
        (``exp_avg`` / ``exp_avg_sq`` decay, weight decay applies) unless a backward gives them a
        gradient first. An update already queued during backward (no ``max_grad_norm``) is not repeated.
        """
        self._check_current("zero_grad")
        if self._eager_groups:
            self._eager_groups.clear()
            self._warn_once("zero_grad", "megatrain.optim.CPUAdamW: zero_grad() between backward() and step(): without "
                            "max_grad_norm the layers' updates from that backward already ran and are not undone "
                            "(torch.optim.AdamW would drop those gradients); to skip a batch, do not call backward() "
                            "on it, or set max_grad_norm so that updates wait for step()")
        held = set()
        if not set_to_none:  # torch: a gradient of a backward since the last step is held too (as zeros)
            views = self._port.wait_grads()
            held = {(ui, i) for ui, v in views.items()
                    for i, (h, e) in enumerate(zip(v.has_grad, v.eager)) if h and not e}
        self._port.zero_grad()
        self._consumed = False
        self.user_clip_scale = 1.0
        if set_to_none:
            self._alive.clear()
            self._zero.clear()
        else:
            self._zero = set(self._alive) | held

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one AdamW update to every parameter that received a gradient.

        Returns:
            The closure's loss if a closure was given, else None.

        Raises:
            RuntimeError: a newer ``CPUAdamW`` of the same model replaced this one; no backward since
                the last ``step()``; ``optimizer.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` of a
                parameter whose state is on the device was written through a tensor taken before the
                last ``step()`` (the message names that parameter; nothing of this step is applied).
            FloatingPointError: a non-finite gradient with ``nonfinite="raise"``.
        """
        self._check_current("step")
        self.check_param_groups()
        self._check_eager_hyper()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_held_moments()
        # device-state units: writes into model.state_dict() tensors, before the update
        self._port.take_state_dict_writes()
        early = self._start_device_updates()  # (no clipping) enqueued before the wait below
        views, got = self._wait_for_gradients()
        pending = self._pending(views, early)
        sq = self._norm_sq(views, pending)
        number = self._steps_called + 1
        if self.nonfinite == "raise":  # before any update of this step ("skip": one warning at the end)
            self._raise_skipped(number)
        if not math.isfinite(sq):  # known before any of these updates: skip them all
            self._report_skipped_units()  # the eager updates skipped before (each layer's own check)
            msg = self._skip_step(got, sq, number)
            if self.nonfinite == "raise":
                raise FloatingPointError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)  # past torch's step wrappers
            return loss
        self._queue_updates(pending, views, got, self._clip_scale(sq))
        self._finish_step(early, got, number)
        if self._skipped_units:
            # A non-finite gradient: this step's host-stored updates (eager ones may still run) are
            # settled first, so that one warning (or error) names every skipped update of the step.
            self._port.flush()
            self._report_skipped_units()
        return loss

    # ------------------------------------------------------------------ the phases of step()
    def _wait_for_gradients(self) -> tuple:
        """Wait until every gradient landed (eager updates may still run: loads wait per unit).

        Returns:
            ``(views, got)``: one ledger snapshot per unit (``{unit index: GradView}``) and the
            ``(unit index, entry index)`` that received a gradient (or were updated during backward).

        Raises:
            RuntimeError: no backward since the last ``step()`` consumed the gradients.
        """
        port = self._port
        views = port.wait_grads()
        got = {(ui, i) for ui, v in views.items() for i, (h, e) in enumerate(zip(v.has_grad, v.eager)) if h or e}
        if not got and self._consumed:
            raise RuntimeError(
                "megatrain.optim.CPUAdamW: step() again without a backward since the last step(): torch.optim.AdamW "
                "would apply the same gradients a second time, but megatrain's update consumes them (in host memory). "
                "Call backward() before each step() (zero_grad(set_to_none=False) + step() runs a zero-gradient step)")
        if self.nonfinite == "raise" and port.eager_queued():
            port.flush()  # their finite checks are done: a non-finite gradient raises now, not a step late
        return views, got

    def _pending(self, views: Dict[int, GradView], early: dict) -> list:
        """``[(unit, entry indices)]`` whose update was not queued during backward (all of them with
        clipping) nor enqueued early (device-state units). An eagerly queued entry may still be running:
        the ledger keeps its update apart from its gradient."""
        pending = [(u, [i for i in range(len(u.entries)) if not views[u.index].eager[i]]) for u in self._port.units
                   if u.index not in early]
        return [(u, idx) for u, idx in pending if idx]

    def _norm_sq(self, views: Dict[int, GradView], pending: list) -> float:
        """The squared global gradient norm over the ``pending`` entries that hold a gradient.

        Without clipping a device-state layer checks its own gradient before its update (as the
        host-stored layers' eager updates do), so only the layers with a non-finite one are skipped:
        its norm is left out here.
        """
        return sum(views[u.index].grad_sq[i] for u, idx in pending for i in idx
                   if views[u.index].has_grad[i] and (u.index, i) in self._entry
                   and (self.max_grad_norm is not None or not self._port.state_on_device(u)))

    def _raise_skipped(self, number: int) -> None:
        """``nonfinite="raise"``: raise ``FloatingPointError`` for an update skipped before this step queued
        any (the gradients are dropped first and the step counted as called)."""
        try:
            self._report_skipped_units()
        except FloatingPointError:
            self._port.zero_grad()
            self._steps_called = number
            raise

    def _skip_step(self, got: set, sq: float, number: int) -> str:
        """Skip step ``number`` as a whole (non-finite global norm ``sq``); returns the warning's message."""
        self._last_grad_norm = math.sqrt(sq) if sq == sq else float("nan")
        self._port.zero_grad()  # gradients dropped, compute copies rewritten from the (untouched) masters
        self._consumed = bool(got)
        self.user_clip_scale = 1.0
        self._count_skipped(number)
        self._steps_called = number
        msg = (f"megatrain.optim.CPUAdamW: non-finite (NaN/inf) gradient at step {number} (global norm "
               f"{self._last_grad_norm}): the step was skipped (weights, exp_avg, exp_avg_sq and step counts "
               "unchanged). Lower the learning rate or check the loss")
        self._port.refresh_state_dict_views()  # eager updates of other entries may have run: held tensors read them
        self._port.step_end(number)
        return msg

    def _clip_scale(self, sq: float) -> float:
        """The gradient scale of this step's updates: ``clip_grad_norm_``'s coefficient(s) called since the
        last step, times ``max_grad_norm``'s; records ``last_grad_norm``."""
        scale = self.user_clip_scale
        if self.max_grad_norm is not None:
            # reported: the norm before any clipping (what clip_grad_norm_ returned); clipped: the
            # norm of what this step receives (after any clip_grad_norm_ of the caller)
            self._last_grad_norm = math.sqrt(sq)
            received = self._last_grad_norm * self.user_clip_scale
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            scale *= min(self.max_grad_norm / (received + 1e-6), 1.0)
        else:
            self._last_grad_norm = None
        return scale

    def _queue_updates(self, pending: list, views: Dict[int, GradView], got: set, scale: float) -> None:
        """Queue the ``pending`` entries' updates (bumping their step counts), the resident unit first,
        then the layers in forward order. An entry left at zeros by ``zero_grad(set_to_none=False)``
        and written by no backward since gets a zero-gradient update."""
        zeros = {k for k in self._zero if k not in got and k in self._entry}
        for unit, idx in sorted(pending, key=lambda ui: forward_order(ui[0])):
            todo = set(idx)
            z = [i for i in idx if (unit.index, i) in zeros]
            has_grad, direct = views[unit.index].has_grad, views[unit.index].direct
            items = self._items(unit, [(has_grad[i] or i in z) and i in todo for i in range(len(unit.entries))])
            if items or any(direct[i] for i in idx):
                self._port.submit_update(unit, items, scale, entries=idx, zero_grads=z)

    def _finish_step(self, early: dict, got: set, number: int) -> None:
        """After the updates are queued: the device-state units' early updates' non-finite outcome, the
        gradients dropped, held ``model.state_dict()`` tensors current, the step's bookkeeping."""
        port = self._port
        port.count_step()  # a graph made before this step is stale
        for unit, items, z in early.values():  # the host's norms are known now: undo a skipped one's step counts
            port.undo_if_nonfinite(unit, items, z)
        port.zero_grad()
        port.refresh_state_dict_views()  # held model.state_dict() tensors read this step's weights on return
        self._steps_called = number
        self._alive |= got
        self._zero -= got
        self._consumed = bool(got)
        self.user_clip_scale = 1.0
        port.step_end(number)  # the worker timeline's step_end mark (nothing when it is off)

    def wait(self) -> None:
        """Block until every queued update has been applied."""
        self._port.flush()
