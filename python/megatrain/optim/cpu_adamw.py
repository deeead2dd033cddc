"""``CPUAdamW``: torch-compatible AdamW whose state lives in megatrain's host store."""

from __future__ import annotations

import math
import os
import warnings
from typing import Iterable, Optional

import torch

NONFINITE_MODES = ("skip", "raise")


def _ref(p: torch.Tensor):
    ref = getattr(p, "_megatrain", None)
    if ref is None:
        raise ValueError(
            f"megatrain.optim.CPUAdamW: got a parameter of shape {tuple(p.shape)} that megatrain does not manage; "
            "call megatrain.wrap(model) first and pass model.parameters() (or groups of them) to CPUAdamW")
    return ref


class CPUAdamW(torch.optim.Optimizer):
    """AdamW over fp32 master weights in host memory, run by megatrain's fused CPU kernel.

    The update rule is exactly ``torch.optim.AdamW`` (decoupled weight decay, bias correction,
    a step count per parameter) [Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
    ICLR 2019]. ``exp_avg`` / ``exp_avg_sq`` are zero-copy views of the host store (fp32, CPU).
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
    ``state_dict()`` and anything reading weights wait for them.

    Args:
        params: parameters of a model wrapped by ``megatrain.wrap`` (or param-group dicts).
        lr: learning rate (float, > 0 or 0).
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: term added to the denominator, > 0 or 0.
        weight_decay: decoupled weight decay coefficient.
        max_grad_norm: clip the global gradient L2 norm to this value (None: no clipping).
        nonfinite: what a non-finite (NaN / inf) gradient does; it never reaches the master weights.
            ``"skip"`` (the default, as ``torch.amp.GradScaler`` and DeepSpeed do on overflow): the
            update is skipped with a warning and counted in ``skipped_steps``. ``"raise"``:
            ``step()`` raises ``FloatingPointError`` (after dropping the gradients). With
            ``max_grad_norm`` the global norm is known before any update, so the whole step is
            skipped (weights, ``exp_avg``, ``exp_avg_sq``, step counts unchanged). Without it a
            layer's update starts during backward (see ``gradient_accumulation_steps``): each
            layer's gradient is checked before its own update, and only the layers with a
            non-finite gradient are skipped (a NaN / inf loss makes every gradient non-finite, so
            then the whole step is skipped); ``"raise"`` then waits in ``step()`` for the updates.
        gradient_accumulation_steps: backward passes per ``step()``. Without clipping, a layer's
            update starts on the CPU as soon as its gradient from the last of these backward
            passes has landed, overlapping the rest of backward and the next forward (DESIGN.md
            section 4); a further backward before ``step()`` then raises. With clipping the
            updates wait for ``step()``. With 1 (the default) a layer's bf16 gradient is copied
            straight into its compute copy in host memory and read from there by the fused
            update: no fp32 accumulation pass. More backward passes than declared still sum
            correctly with clipping (the engine moves the gradient to the fp32 accumulator).

    Raises:
        ValueError: a hyperparameter out of range (``eps`` must be > 0: with 0 a zero gradient
            gives 0/0 = NaN), or a parameter not managed by megatrain.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_grad_norm: Optional[float] = None,
                 gradient_accumulation_steps: int = 1, nonfinite: str = "skip"):
        for name, v in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"megatrain.optim.CPUAdamW: {name} must be a finite number >= 0, got {v!r}")
        if eps == 0:
            raise ValueError("megatrain.optim.CPUAdamW: eps must be > 0 (with eps=0 a zero gradient gives 0/0 = NaN "
                             "weights); use e.g. 1e-8")
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"megatrain.optim.CPUAdamW: nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"megatrain.optim.CPUAdamW: betas must be two numbers in [0, 1), got {betas!r}")
        if max_grad_norm is not None and not (max_grad_norm > 0):
            raise ValueError(f"megatrain.optim.CPUAdamW: max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
            raise ValueError("megatrain.optim.CPUAdamW: gradient_accumulation_steps must be an int >= 1, "
                             f"got {gradient_accumulation_steps!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.engine = None
        self._entry = {}  # (unit index, entry index) -> (group, param)
        for group in self.param_groups:
            for p in group["params"]:
                eng, unit, i = _ref(p)
                self._entry[(unit.index, i)] = (group, p)
                if self.engine is None:
                    self.engine = eng
                elif eng is not self.engine:
                    raise ValueError("megatrain.optim.CPUAdamW: parameters come from two different wrapped models")
                self.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": eng.entry_view(unit, i, "exp_avg"),
                    "exp_avg_sq": eng.entry_view(unit, i, "exp_avg_sq"),
                }
        if self.engine is None:
            raise ValueError("megatrain.optim.CPUAdamW: got an empty parameter list")
        prev = self.engine.optimizer
        if prev is not None and not set(prev._entry) <= set(self._entry):
            # One optimizer per model: the engine routes every gradient to it (and step()/zero_grad()
            # act on the whole model). A replacement that covers the old one's parameters is fine.
            raise ValueError("megatrain.optim.CPUAdamW: this model already has a CPUAdamW for other parameters; use one "
                             "CPUAdamW with several param groups (each group can have its own lr, weight_decay, betas)")
        if gradient_accumulation_steps > 1 and not self.engine.has_accumulator:
            raise ValueError(f"megatrain.optim.CPUAdamW: gradient_accumulation_steps={gradient_accumulation_steps} needs the "
                             "fp32 gradient accumulator, but the model was wrapped with grad_accumulator=False; wrap with "
                             "grad_accumulator=True (the default)")
        self.engine.optimizer = self
        self.last_grad_norm: Optional[float] = None
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps whose update was skipped (whole or in part): non-finite gradients
        self._skipped_ids: set = set()
        self._steps_called = 0  # step() calls that returned; the one running (or next) is number + 1
        self._skipped_units: list = []  # (step number, unit name) appended by the CPU worker (no clipping)

    def skip_unit_update(self, unit, items, step_number: int) -> None:
        """CPU worker: ``unit``'s gradient is non-finite, its update is not applied: undo the step counts.

        ``step_number``: the ``step()`` call the update belongs to (1-based)."""
        for i, *_ in items:
            self.state[self._entry[(unit.index, i)][1]]["step"] -= 1
        names = [unit.entries[i].name for i, *_ in items]
        label = names[0] if len(names) == 1 else (os.path.commonprefix(names).rsplit(".", 1)[0] or f"unit {unit.index}")
        self._skipped_units.append((step_number, label))

    def _count_skipped(self, step_number: int) -> None:
        self._skipped_ids.add(step_number)
        self.skipped_steps = len(self._skipped_ids)

    def _report_skipped_units(self) -> None:
        done, self._skipped_units = self._skipped_units, []
        if not done:
            return
        for s, _ in done:
            self._count_skipped(s)
        names = ", ".join(sorted({n for _, n in done}))
        msg = (f"megatrain.optim.CPUAdamW: non-finite (NaN/inf) gradient at step {done[0][0]}: the update of {names} "
               "was skipped (its weights, exp_avg, exp_avg_sq and step count are unchanged; without max_grad_norm "
               "layers with finite gradients were updated). Lower the learning rate or check the loss")
        if self.nonfinite == "raise":
            raise FloatingPointError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)

    def _items(self, unit, has_grad):
        """Adam work items of ``unit`` (main thread: bumps the per-parameter step counts)."""
        items = []
        for i in range(len(unit.entries)):
            gp = self._entry.get((unit.index, i))
            if gp is None or not has_grad[i]:
                continue
            group, p = gp  # a gradient that arrived counts even if p was frozen since (as in torch)
            st = self.state[p]
            st["step"] += 1
            b1, b2 = group["betas"]
            items.append((i, float(group["lr"]), float(b1), float(b2), float(group["eps"]),
                          float(group["weight_decay"]), int(st["step"].item())))
        return items

    def raise_extra_backward(self, same_backward: bool = False):
        """Raise the error for a gradient after a unit's update was already queued (no clipping).

        ``same_backward``: the gradient comes from the backward pass that queued the update (a
        layer called more than once in one forward).
        """
        if same_backward:
            raise RuntimeError(
                "megatrain: a decoder layer received a second gradient in the same backward pass (the layer is "
                "called more than once per forward); without max_grad_norm its update starts at its first gradient. "
                "Set max_grad_norm in CPUAdamW (updates then wait for step() and the gradients are summed)")
        raise RuntimeError(
            f"megatrain: more backward passes than gradient_accumulation_steps="
            f"{self.gradient_accumulation_steps} before optimizer.step(); pass the right "
            "gradient_accumulation_steps to CPUAdamW (or call step() after each accumulation window)")

    def plan_eager(self, unit, present):
        """Called by the engine when gradients of ``unit``'s entries (``present[i]``) are handed to D2H.

        Returns ``(items, scale)`` when the update of those entries can start now (no clipping and
        this backward is their last micro-batch), else None. A layer hands over all its entries
        at once; the resident unit (embedding, final norm, LM head) one entry at a time, as
        autograd finishes each: the LM head's update then runs during backward instead of
        delaying the next forward.
        """
        if self.max_grad_norm is not None:
            return None
        if any(p and unit.batches[i] < self.gradient_accumulation_steps for i, p in enumerate(present)):
            return None
        return self._items(unit, present), 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget gradients accumulated since the last step (the next backward starts afresh)."""
        self.engine.zero_grad()

    @torch.no_grad()
    def step(self, closure=None):
        """Apply one AdamW update to every parameter that received a gradient.

        Returns:
            The closure's loss if a closure was given, else None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        eng = self.engine
        eng.wait_grads()  # every gradient landed (eager updates may still run: loads wait per unit)
        if self.nonfinite == "raise" and any(u.eager_queued for u in eng.units):
            eng.flush()  # their finite checks are done: a non-finite gradient raises now, not a step late
        # Entries whose update was not queued during backward (all of them with clipping). An
        # eagerly queued entry may still be running: its has_grad is the worker's to reset.
        pending = [(u, [i for i in range(len(u.entries)) if not u.eager[i]]) for u in eng.units]
        pending = [(u, idx) for u, idx in pending if idx]
        scale = 1.0
        sq = sum(u.grad_sq[i] for u, idx in pending for i in idx
                 if u.has_grad[i] and (u.index, i) in self._entry)
        number = self._steps_called + 1
        try:
            self._report_skipped_units()
        except FloatingPointError:
            eng.zero_grad()
            self._steps_called = number
            raise
        if not math.isfinite(sq):  # known before any of these updates: skip them all
            self.last_grad_norm = math.sqrt(sq) if sq == sq else float("nan")
            eng.zero_grad()  # gradients dropped, compute copies rewritten from the (untouched) masters
            self._count_skipped(number)
            self._steps_called = number
            msg = (f"megatrain.optim.CPUAdamW: non-finite (NaN/inf) gradient at step {number} (global norm "
                   f"{self.last_grad_norm}): the step was skipped (weights, exp_avg, exp_avg_sq and step counts "
                   "unchanged). Lower the learning rate or check the loss")
            if self.nonfinite == "raise":
                raise FloatingPointError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            return loss
        if self.max_grad_norm is not None:
            self.last_grad_norm = math.sqrt(sq)
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            scale = min(self.max_grad_norm / (self.last_grad_norm + 1e-6), 1.0)
        else:
            self.last_grad_norm = None
        # Resident unit first (the next forward needs the embedding first), then layers in forward order.
        for unit, idx in sorted(pending, key=lambda ui: (ui[0].kind != "resident", ui[0].index)):
            todo = set(idx)
            items = self._items(unit, [unit.has_grad[i] and i in todo for i in range(len(unit.entries))])
            if items or any(unit.direct[i] for i in idx):
                eng.submit_update(unit, items, scale, entries=idx)
        eng.zero_grad()
        self._steps_called = number
        return loss

    def wait(self) -> None:
        """Block until every queued update has been applied."""
        self.engine.flush()

    def state_dict(self):
        self.wait()
        sd = super().state_dict()
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict produced by ``state_dict()`` (same parameter order) into the host store.

        Raises:
            ValueError: if the groups or state shapes do not match this optimizer's parameters.
        """
        self.wait()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"megatrain.optim.CPUAdamW.load_state_dict: {len(groups)} param groups in the state dict, "
                             f"{len(self.param_groups)} in the optimizer")
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in groups for i in g["params"]]
        if len(ids) != len(params):
            raise ValueError("megatrain.optim.CPUAdamW.load_state_dict: the number of parameters does not match")
        for pid, p in zip(ids, params):
            st = state_dict["state"].get(pid)
            if st is None:
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                if tuple(st[k].shape) != tuple(p.shape):
                    raise ValueError(f"megatrain.optim.CPUAdamW.load_state_dict: {k} of parameter {pid} has shape "
                                     f"{tuple(st[k].shape)}, expected {tuple(p.shape)}")
        for pid, p in zip(ids, params):
            st = state_dict["state"].get(pid)
            if st is None:
                continue
            self.state[p]["exp_avg"].copy_(st["exp_avg"])
            self.state[p]["exp_avg_sq"].copy_(st["exp_avg_sq"])
            self.state[p]["step"] = torch.as_tensor(st["step"], dtype=torch.float32).clone()
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v

