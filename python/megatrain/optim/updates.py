"""The update side of :class:`~megatrain.optim.CPUAdamW`: Adam work items and step counts, updates that
start during backward (``plan_eager``, the device-state units' early updates), and the skips for
non-finite gradients (``skip_unit_update`` and the step's one warning).

:class:`UpdatePlanning` is mixed into ``CPUAdamW`` (before ``torch.optim.Optimizer``). The engine calls
``plan_eager``, ``raise_extra_backward`` and ``skip_unit_update`` (the
:class:`~megatrain.runtime.engine.optimizer_port.EngineOptimizer` protocol); ``CPUAdamW.step`` the rest.
The engine is reached through the optimizer's port (``self._port``) only.
"""

from __future__ import annotations

import os
import warnings

from .hyperparams import check_group_values, hyper_of


def skip_labels(unit, items) -> list:
    """What a skipped update of ``unit``'s ``items`` is called in the non-finite warning: the decoder
    layer's module name (``model.layers.3``) for several entries of a layer, else the parameter names
    (the resident unit's embedding / final norm / LM head each by name, as their eager updates come
    one parameter at a time)."""
    names = sorted(unit.entries[i].name for i, *_ in items)
    if unit.kind == "layer" and len(names) > 1:
        prefix = os.path.commonprefix(names).rsplit(".", 1)[0]
        if prefix:
            return [prefix]
    return names


def forward_order(unit) -> tuple:
    """Sort key of the updates of one step: the resident unit first (the next forward needs the
    embedding first), then the layers in forward order."""
    return unit.kind != "resident", unit.index


class UpdatePlanning:
    """Work items, eager updates and non-finite skips of ``CPUAdamW`` (see module docstring).

    Uses the optimizer's ``_port``, ``_entry``, ``_zero``, ``_eager_groups`` / ``_eager_warned``
    (eager updates' hyperparameters, warnings shown), ``_skipped_units`` / ``_skipped_ids``.
    """

    def _items(self, unit, has_grad):
        """Adam work items of ``unit`` (main thread: bumps the per-parameter step counts)."""
        items = []
        for i in range(len(unit.entries)):
            gp = self._entry.get((unit.index, i))
            if gp is None or not has_grad[i]:
                continue
            group, p = gp  # a gradient that arrived counts even if p was frozen since (as in torch)
            st = self.state[p]
            step = dict.get(st, "step") + 1  # not st["step"]: that waits for the unit's update in flight
            dict.__setitem__(st, "step", step)
            lr, (b1, b2), eps, wd = hyper_of(group)
            items.append((i, lr, b1, b2, eps, wd, int(step.item())))
        return items

    def check_param_groups(self) -> None:
        """Raise ValueError (one line) for a param group no update can run with (:func:`.check_group_values`);
        called by ``step()`` and, before anything is touched, by each forward with autograd on (without
        ``max_grad_norm`` that backward starts the updates)."""
        check_group_values(self.param_groups)

    def raise_extra_backward(self, same_backward: bool = False):
        """Raise the error for a gradient after a unit's update was already queued (no clipping).

        ``same_backward``: the gradient comes from the backward pass that queued the update (a
        layer called more than once in one forward).
        """
        if same_backward:
            raise RuntimeError(
                "megatrain: a decoder layer received a second gradient in the same backward pass (it was called more "
                "than once in this backward's graph: twice in one forward, or two forwards summed into one loss); "
                "without max_grad_norm its update starts at its first gradient. "
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
        batches = self._port.grad_batches(unit)
        if any(p and batches[i] < self.gradient_accumulation_steps for i, p in enumerate(present)):
            return None
        items = self._items(unit, present)
        for i, lr, b1, b2, eps, wd, _ in items:  # the values these updates run with, per group
            group = self._entry[(unit.index, i)][0]
            self._eager_groups.setdefault(id(group), (group, (lr, (b1, b2), eps, wd)))
        return items, 1.0

    def _warn_once(self, kind: str, msg: str) -> None:
        if kind not in self._eager_warned:
            self._eager_warned.add(kind)
            warnings.warn(msg + " (shown once)", RuntimeWarning, stacklevel=3)

    def _check_eager_hyper(self) -> None:
        """At step(): warn if a param group's lr / betas / eps / weight_decay changed after updates of this
        step already ran during backward with the old values (no clipping; torch would use the new ones)."""
        changed = [(old, hyper_of(g)) for g, old in self._eager_groups.values() if hyper_of(g) != old]
        self._eager_groups.clear()
        if changed:
            old, new = changed[0]
            diff = ", ".join(f"{k} {a} -> {b}" for k, a, b in zip(("lr", "betas", "eps", "weight_decay"), old, new)
                             if a != b)
            self._warn_once("hyper", "megatrain.optim.CPUAdamW: a param group changed between backward() and step() "
                            f"({diff}), but without max_grad_norm the layers' updates of this step ran during backward "
                            "with the old values (torch.optim.AdamW would use the new ones in step()); set "
                            "hyperparameters before the forward (an lr scheduler's step() after optimizer.step() "
                            "does), or set max_grad_norm so that updates wait for step()")

    def _start_device_updates(self) -> dict:
        """Without clipping, enqueue the device-state units' updates before ``step()`` waits for gradients.

        Those units are the last of backward (layer 0, the resident unit): their gradients are done
        only when the GPU ends backward, and ``wait_grads`` would hold their updates until the host
        had seen that, with the GPU idle meanwhile. Enqueued now, they run right after backward; the
        non-finite check is made on the device (``finite_on_device``) and, once the host has the
        norms, a skipped update's step counts are put back (``CPUAdamW.step``). Nothing is enqueued early
        with clipping (the global norm is needed first), with ``nonfinite="raise"`` (a host-stored
        unit's non-finite gradient must stop the step before any update), where the device AdamW
        cannot check on the device, or while a host-stored entry with a gradient was not updated
        during backward (its non-finite check may skip the whole step).

        Returns:
            ``{unit index: (unit, items, zero-gradient entries)}`` of the updates enqueued.
        """
        port = self._port
        if self.max_grad_norm is not None or self.nonfinite == "raise" or not port.device_checks_finite:
            return {}
        units = {}
        for u in port.units:
            states = port.grad_states(u)
            if not port.state_on_device(u):
                if any(batches and not eager for batches, eager in states):
                    return {}
                continue
            units[u.index] = (u, [batches > 0 for batches, _ in states])
        if not any(any(b) for _, b in units.values()):
            return {}  # no gradient reached the device units: step()'s own checks decide
        early = {}
        # resident unit first, then layers in forward order (as step()'s own loop)
        for index, (u, got) in sorted(units.items(), key=lambda kv: forward_order(kv[1][0])):
            z = [i for i in range(len(u.entries))
                 if (index, i) in self._zero and not got[i] and (index, i) in self._entry]
            items = self._items(u, [g or i in z for i, g in enumerate(got)])
            if items:
                port.submit_update(u, items, 1.0, entries=list(range(len(u.entries))), zero_grads=z,
                                   finite_on_device=True)
                early[index] = (u, items, z)
        return early

    def skip_unit_update(self, unit, items, step_number: int) -> None:
        """The CPU worker skipped ``unit``'s update (a non-finite gradient): undo the step counts.

        Called by the engine on the main thread at its next sync point after the update was skipped.
        ``step_number``: the ``step()`` call the update belongs to (1-based)."""
        for i, *_ in items:
            st = self.state[self._entry[(unit.index, i)][1]]  # (dict access: no waiting for the unit's update)
            dict.__setitem__(st, "step", dict.get(st, "step") - 1)
        self._skipped_units.extend((step_number, label) for label in skip_labels(unit, items))

    def _count_skipped(self, step_number: int) -> None:
        self._skipped_ids.add(step_number)
        self.skipped_steps = len(self._skipped_ids)

    def _report_skipped_units(self) -> None:
        """One warning (``nonfinite="raise"``: ``FloatingPointError``) per step whose updates were skipped
        for a non-finite gradient since the last report, naming every skipped update of that step,
        host-stored and device-state alike. Called from ``step()`` itself (the warning's stack level)."""
        done, self._skipped_units = self._skipped_units, []
        by_step: dict = {}
        for s, label in done:
            self._count_skipped(s)
            by_step.setdefault(s, set()).add(label)
        for s, labels in sorted(by_step.items()):
            names = ", ".join(sorted(labels))
            msg = (f"megatrain.optim.CPUAdamW: non-finite (NaN/inf) gradient at step {s}: the update of {names} "
                   "was skipped (its weights, exp_avg, exp_avg_sq and step count are unchanged; without "
                   "max_grad_norm layers with finite gradients were updated). Lower the learning rate or check the loss")
            if self.nonfinite == "raise":
                raise FloatingPointError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=5)  # past torch's step wrappers
