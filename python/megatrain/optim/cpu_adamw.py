"""``CPUAdamW``: torch-compatible AdamW whose state lives in megatrain's host store."""

from __future__ import annotations

import math
import numbers
import os
import warnings
from typing import Iterable, Optional

import torch

from ..runtime.engine.core import locate

NONFINITE_MODES = ("skip", "raise")


# torch.optim.AdamW options with no effect on the result here (implementation selectors): accepted.
_NO_OP_OPTIONS = ("foreach", "fused", "capturable")
# torch.optim.AdamW options megatrain's fused update does not implement: refused when switched on.
_REFUSED_OPTIONS = {
    "amsgrad": "amsgrad=True is not implemented by megatrain's fused CPU AdamW (it keeps no max_exp_avg_sq); "
               "use amsgrad=False",
    "maximize": "maximize=True is not implemented by megatrain's fused CPU AdamW; minimise the negated loss instead",
    "differentiable": "differentiable=True is not supported: megatrain's update runs outside autograd, on the CPU",
}


def _check_options(where: str, opts: dict) -> None:
    for k, msg in _REFUSED_OPTIONS.items():
        if opts.get(k):
            raise ValueError(f"megatrain.optim.CPUAdamW{where}: {msg}")


def _is_number(v) -> bool:
    """A real Python / NumPy number (not a bool, a string or a tensor)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _hyper_of(group) -> tuple:
    """``(lr, betas, eps, weight_decay)`` of a param group as floats (what an update runs with)."""
    b1, b2 = group["betas"]
    return float(group["lr"]), (float(b1), float(b2)), float(group["eps"]), float(group["weight_decay"])


def _check_hyper(where: str, hp: dict) -> None:
    """ValueError (one line) for a bad ``lr`` / ``eps`` / ``weight_decay`` / ``betas`` among the keys of ``hp``."""
    for name in ("lr", "eps", "weight_decay"):
        if name in hp:
            v = hp[name]
            if name == "lr" and isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex():
                v = float(v)  # a tensor lr, as torch.optim.AdamW takes (read as a float at each step)
            if not _is_number(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"megatrain.optim.CPUAdamW{where}: {name} must be a finite number >= 0, got {v!r}")
    if "eps" in hp and hp["eps"] == 0:
        raise ValueError(f"megatrain.optim.CPUAdamW{where}: eps must be > 0 (with eps=0 a zero gradient gives 0/0 = NaN "
                         "weights); use e.g. 1e-8")
    if "betas" in hp:
        b = hp["betas"]
        if (not isinstance(b, (tuple, list)) or len(b) != 2
                or not all(_is_number(x) and 0.0 <= x < 1.0 for x in b)):
            raise ValueError(f"megatrain.optim.CPUAdamW{where}: betas must be two numbers in [0, 1), got {b!r}")


class _TierValue:
    """``exp_avg`` / ``exp_avg_sq`` of a parameter whose fp32 state is in the disk tier
    (``wrap(offload_dir=...)``): :class:`_ParamState` reads it (a CPU copy) when it is accessed."""

    __slots__ = ("read",)

    def __init__(self, read):
        self.read = read


def _value(v):
    return v.read() if isinstance(v, _TierValue) else v


class _ParamState(dict):
    """``optimizer.state[p]``: reading a value first waits for the parameter's update in flight, so
    ``exp_avg`` / ``exp_avg_sq`` read right after ``step()`` show the new values (as torch's do).
    For a parameter whose state is on disk they are copies read from the tier at each access."""

    __slots__ = ("_wait",)

    def __init__(self, wait, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._wait = wait

    def __getitem__(self, k):
        self._wait()
        return _value(super().__getitem__(k))

    def get(self, k, default=None):
        self._wait()
        return _value(super().get(k, default))

    def items(self):
        self._wait()
        return [(k, _value(v)) for k, v in super().items()]

    def values(self):
        self._wait()
        return [_value(v) for v in super().values()]

    def __reduce__(self):
        return (dict, (dict(self.items()),))


def _ref(p: torch.Tensor):
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"megatrain.optim.CPUAdamW: expected parameters (tensors) or (name, parameter) pairs, got a "
                        f"{type(p).__name__}; pass model.parameters(), model.named_parameters() or groups of them")
    ref = locate(p)
    if ref is None:
        raise ValueError(
            f"megatrain.optim.CPUAdamW: got a parameter of shape {tuple(p.shape)} that megatrain does not manage; "
            "call megatrain.wrap(model) first and pass model.parameters() (or groups of them) to CPUAdamW; a parameter "
            "added to the model after wrap (e.g. by peft.get_peft_model) is not in its store: apply PEFT before "
            "megatrain.wrap, or use megatrain.from_config / from_pretrained(transform=...)")
    return ref


def _skip_labels(unit, items) -> list:
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


class CPUAdamW(torch.optim.Optimizer):
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
            passes has landed, overlapping the rest of backward and the next forward (DESIGN.md
            section 4); a further backward before ``step()`` then raises. With clipping the
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
        _check_hyper("", dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if nonfinite not in NONFINITE_MODES:
            raise ValueError(f"megatrain.optim.CPUAdamW: nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
        if max_grad_norm is not None and not (_is_number(max_grad_norm) and max_grad_norm > 0):
            raise ValueError(f"megatrain.optim.CPUAdamW: max_grad_norm must be a number > 0 or None, got {max_grad_norm!r}")
        if (not isinstance(gradient_accumulation_steps, int) or isinstance(gradient_accumulation_steps, bool)
                or gradient_accumulation_steps < 1):
            raise ValueError("megatrain.optim.CPUAdamW: gradient_accumulation_steps must be an int >= 1, "
                             f"got {gradient_accumulation_steps!r}")
        _check_options("", dict(amsgrad=amsgrad, maximize=maximize, differentiable=differentiable))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=False,
                        foreach=foreach, fused=fused, capturable=capturable, differentiable=False)
        self.engine = None
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
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if self.engine is None:
            raise ValueError("megatrain.optim.CPUAdamW: got an empty parameter list")
        prev = self.engine.optimizer
        if prev is not None and not set(prev._entry) <= set(self._entry):
            # One optimizer per model: the engine routes every gradient to it (and step()/zero_grad()
            # act on the whole model). A replacement that covers the old one's parameters is fine.
            raise ValueError("megatrain.optim.CPUAdamW: this model already has a CPUAdamW for other parameters; use one "
                             "CPUAdamW with several param groups (each group can have its own lr, weight_decay, betas)")
        self.engine.check_frozen()
        self.engine.check_frozen()
        if gradient_accumulation_steps > 1 and not self.engine.has_accumulator:
            raise ValueError(f"megatrain.optim.CPUAdamW: gradient_accumulation_steps={gradient_accumulation_steps} needs the "
                             "fp32 gradient accumulator, but the model was wrapped with grad_accumulator=False; wrap with "
                             "grad_accumulator=None (the default) or True")
        if gradient_accumulation_steps > 1:
            self.engine.enable_accumulator()  # wrap(grad_accumulator=None): allocated now, when it is known to be needed
        self.engine.attach_optimizer(self)
        if prev is not None:
            self._start_fresh()
        self._last_grad_norm: Optional[float] = None
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps whose update was skipped (whole or in part): non-finite gradients
        self._skipped_ids: set = set()
        self._steps_called = 0  # step() calls that returned; the one running (or next) is number + 1
        self._skipped_units: list = []  # (step number, unit name) appended by the CPU worker (no clipping)

    def _start_fresh(self) -> None:
        """A CPUAdamW that replaces the model's earlier one starts as a new ``torch.optim.AdamW`` does:
        ``exp_avg`` / ``exp_avg_sq`` zero (its step counts are 0 already). The moments live in the
        host store, so without this they stayed the earlier optimizer's under fresh step counts (a
        notebook cell run again trained 0.25 relative away from torch within 3 steps)."""
        eng = self.engine
        eng.sync_host(for_write=True)  # the earlier optimizer's updates land first
        for (ui, i), (_group, p) in self._entry.items():
            unit = _ref(p)[1]
            if unit.disk is not None:
                z = torch.zeros(tuple(p.shape), dtype=torch.float32)
                eng.disk.write(unit, {(i, "exp_avg"): z, (i, "exp_avg_sq"): z})
                continue
            st = self.state[p]
            for k in ("exp_avg", "exp_avg_sq"):
                t = dict.__getitem__(st, k)  # the host-store view handed out as optimizer.state[p][k]
                t.zero_()
                self._moment_versions[(ui, i, k)] = t._version  # megatrain's write, not the user's
        eng.host_written()  # device-state layers take the zeros

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

    def moments_written(self, unit) -> bool:
        """Whether a tensor handed out as ``optimizer.state[p]["exp_avg"]`` / ``["exp_avg_sq"]`` of one of
        ``unit``'s parameters was written in place since the last call (its version counter moved)."""
        return bool(self._written_moments(unit))

    def _written_moments(self, unit) -> list:
        """``[(entry index, "exp_avg" | "exp_avg_sq")]`` of ``unit`` whose handed-out tensor was written in
        place since the last call (:meth:`moments_written`; the versions seen are updated)."""
        written = []
        for i in range(len(unit.entries)):
            gp = self._entry.get((unit.index, i))
            if gp is None:
                continue
            st = self.state[gp[1]]
            for k in ("exp_avg", "exp_avg_sq"):
                t = dict.get(st, k)
                if isinstance(t, torch.Tensor) and self._moment_versions.get((unit.index, i, k), 0) != t._version:
                    self._moment_versions[(unit.index, i, k)] = t._version
                    written.append((i, k))
        return written

    def _check_held_moments(self) -> None:
        """Refuse a write into ``optimizer.state[p]["exp_avg"]`` of a device-state unit through a tensor
        taken before its last update (the host copy it views was not refreshed since: the write would
        put back the older moments), before anything of this step is touched."""
        for u in self.engine.units:
            du = getattr(u, "device_state", None)
            written = [] if du is None or du.host_dirty else self._written_moments(u)
            if not written:
                continue
            keys = " / ".join(f"['{k}']" for k in ("exp_avg", "exp_avg_sq") if any(w == k for _, w in written))
            names = ", ".join(dict.fromkeys(u.entries[i].name for i, _ in written))  # the parameters written
            raise RuntimeError(
                f"megatrain: optimizer.state[p]{keys} of {names} (its state is on the "
                "device) was written through a tensor taken before the last optimizer.step(); that tensor holds the "
                "moments of that time, so the write would undo the steps since. Look the tensor up again "
                "(optimizer.state[p]['exp_avg']) after each step() before writing into it")

    def skip_unit_update(self, unit, items, step_number: int) -> None:
        """The CPU worker skipped ``unit``'s update (a non-finite gradient): undo the step counts.

        Called by the engine on the main thread at its next sync point after the update was skipped.
        ``step_number``: the ``step()`` call the update belongs to (1-based)."""
        for i, *_ in items:
            st = self.state[self._entry[(unit.index, i)][1]]  # (dict access: no waiting for the unit's update)
            dict.__setitem__(st, "step", dict.get(st, "step") - 1)
        self._skipped_units.extend((step_number, label) for label in _skip_labels(unit, items))

    def _count_skipped(self, step_number: int) -> None:
        self._skipped_ids.add(step_number)
        self.skipped_steps = len(self._skipped_ids)

    def _report_skipped_units(self) -> None:
        """One warning (``nonfinite="raise"``: ``FloatingPointError``) per step whose updates were skipped
        for a non-finite gradient since the last report, naming every skipped update of that step,
        host-stored and device-state alike."""
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

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim.Optimizer.add_param_group``: the group's parameters are updated from the next ``step()``.

        Raises:
            ValueError: a parameter not managed by megatrain, from another wrapped model, already in
                a group, or an option CPUAdamW refuses (``amsgrad`` / ``maximize`` / ``differentiable``).
        """
        _check_options(".add_param_group", param_group)
        _check_hyper(".add_param_group", param_group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        # torch >= 2.6 takes model.named_parameters(): (name, parameter) pairs, kept as the group's param_names
        params = [q[1] if isinstance(q, tuple) and len(q) == 2 and isinstance(q[0], str) else q for q in params]
        refs = [_ref(p) for p in params]
        for eng, _, _ in refs:
            if self.engine is None:
                self.engine = eng
            elif eng is not self.engine:
                raise ValueError("megatrain.optim.CPUAdamW: parameters come from two different wrapped models")
        super().add_param_group(param_group)  # torch's checks (duplicates, defaults)
        group = self.param_groups[-1]
        for p, (eng, unit, i) in zip(group["params"], refs):
            if unit.entries[i].frozen:  # frozen at wrap: no fp32 state, never trains (torch keeps no state either)
                continue
            self._entry[(unit.index, i)] = (group, p)
            # a read waits for the unit's update (and copies a device-state layer's state to the host store)
            if unit.disk is not None:  # on disk: read at each access
                moments = {k: _TierValue(lambda u=unit, i=i, k=k, e=eng: e.disk.read(u, i, k))
                           for k in ("exp_avg", "exp_avg_sq")}
            else:
                moments = {k: eng.entry_view(unit, i, k) for k in ("exp_avg", "exp_avg_sq")}
                for k, t in moments.items():
                    self._moment_versions[(unit.index, i, k)] = t._version
            self.state[p] = _ParamState(lambda u=unit, e=eng: e.sync_host([u], for_write=True),
                                        {"step": torch.tensor(0.0), **moments})

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
            lr, (b1, b2), eps, wd = _hyper_of(group)
            items.append((i, lr, b1, b2, eps, wd, int(step.item())))
        return items

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
        batches = unit.batches
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
        changed = [(old, _hyper_of(g)) for g, old in self._eager_groups.values() if _hyper_of(g) != old]
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

    def _check_current(self, call: str) -> None:
        # One CPUAdamW per model: a newer one took over the model's gradients and its updates
        # (eager ones start during backward with its settings). Stepping this one would apply them silently.
        if self.engine.optimizer is not self:
            raise RuntimeError(f"megatrain.optim.CPUAdamW: {call}() on an optimizer that a newer CPUAdamW for the same "
                               "model replaced (the newest one receives the gradients and runs the updates); call "
                               "the newest one's step() / zero_grad(), or create only one CPUAdamW per model")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget gradients accumulated since the last step (the next backward starts afresh).

        ``set_to_none=False`` as torch: the parameters that held a gradient now hold zeros, so a
        ``step()`` still updates them (``exp_avg`` / ``exp_avg_sq`` decay, weight decay applies)
        unless a backward gives them a gradient first.
        """
        self._check_current("zero_grad")
        if self._eager_groups:
            self._eager_groups.clear()
            self._warn_once("zero_grad", "megatrain.optim.CPUAdamW: zero_grad() between backward() and step(): without "
                            "max_grad_norm the layers' updates from that backward already ran and are not undone "
                            "(torch.optim.AdamW would drop those gradients); to skip a batch, do not call backward() "
                            "on it, or set max_grad_norm so that updates wait for step()")
        self.engine.zero_grad()
        self._consumed = False
        self.user_clip_scale = 1.0
        if set_to_none:
            self._alive.clear()
            self._zero.clear()
        else:
            self._zero = set(self._alive)

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
        self._check_eager_hyper()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        eng = self.engine
        self._check_held_moments()
        eng.take_state_dict_writes()  # device-state units: writes into model.state_dict() tensors, before the update
        early = self._start_device_updates()  # (no clipping) enqueued before the wait below
        eng.wait_grads()  # every gradient landed (eager updates may still run: loads wait per unit)
        views = {u.index: (u.has_grad, u.eager, u.grad_sq, u.direct) for u in eng.units}  # one ledger snapshot each
        got = {(u.index, i) for u in eng.units for i, (h, e) in enumerate(zip(*views[u.index][:2])) if h or e}
        if not got and self._consumed:
            raise RuntimeError(
                "megatrain.optim.CPUAdamW: step() again without a backward since the last step(): torch.optim.AdamW "
                "would apply the same gradients a second time, but megatrain's update consumes them (in host memory). "
                "Call backward() before each step() (zero_grad(set_to_none=False) + step() runs a zero-gradient step)")
        if self.nonfinite == "raise" and any(u.eager_queued for u in eng.units):
            eng.flush()  # their finite checks are done: a non-finite gradient raises now, not a step late
        # Entries whose update was not queued during backward (all of them with clipping). An
        # eagerly queued entry may still be running: the ledger keeps its update apart from its gradient.
        pending = [(u, [i for i in range(len(u.entries)) if not views[u.index][1][i]]) for u in eng.units
                   if u.index not in early]
        pending = [(u, idx) for u, idx in pending if idx]
        # zero_grad(set_to_none=False) left zeros where no backward wrote since: a zero-gradient update
        zeros = {k for k in self._zero if k not in got and k in self._entry}
        scale = self.user_clip_scale
        # Without clipping a device-state layer checks its own gradient before its update (as the
        # host-stored layers' eager updates do), so only the layers with a non-finite one are skipped.
        sq = sum(views[u.index][2][i] for u, idx in pending for i in idx
                 if views[u.index][0][i] and (u.index, i) in self._entry
                 and (self.max_grad_norm is not None or u.device_state is None))
        number = self._steps_called + 1
        if self.nonfinite == "raise":  # before any update of this step ("skip": one warning at the end)
            try:
                self._report_skipped_units()
            except FloatingPointError:
                eng.zero_grad()
                self._steps_called = number
                raise
        if not math.isfinite(sq):  # known before any of these updates: skip them all
            self._report_skipped_units()  # the eager updates skipped before (each layer's own check)
            self._last_grad_norm = math.sqrt(sq) if sq == sq else float("nan")
            eng.zero_grad()  # gradients dropped, compute copies rewritten from the (untouched) masters
            self._consumed = bool(got)
            self.user_clip_scale = 1.0
            self._count_skipped(number)
            self._steps_called = number
            msg = (f"megatrain.optim.CPUAdamW: non-finite (NaN/inf) gradient at step {number} (global norm "
                   f"{self._last_grad_norm}): the step was skipped (weights, exp_avg, exp_avg_sq and step counts "
                   "unchanged). Lower the learning rate or check the loss")
            eng.refresh_state_dict_views()  # eager updates of other entries may have run: held tensors read them
            eng.timeline_step_end(number)
            if self.nonfinite == "raise":
                raise FloatingPointError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=4)  # past torch's step wrappers
            return loss
        if self.max_grad_norm is not None:
            # reported: the norm before any clipping (what clip_grad_norm_ returned); clipped: the
            # norm of what this step receives (after any clip_grad_norm_ of the caller)
            self._last_grad_norm = math.sqrt(sq)
            received = self._last_grad_norm * self.user_clip_scale
            # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total_norm + 1e-6), clamped to 1.
            scale *= min(self.max_grad_norm / (received + 1e-6), 1.0)
        else:
            self._last_grad_norm = None
        # Resident unit first (the next forward needs the embedding first), then layers in forward order.
        for unit, idx in sorted(pending, key=lambda ui: (ui[0].kind != "resident", ui[0].index)):
            todo = set(idx)
            z = [i for i in idx if (unit.index, i) in zeros]
            has_grad, _, _, direct = views[unit.index]
            items = self._items(unit, [(has_grad[i] or i in z) and i in todo for i in range(len(unit.entries))])
            if items or any(direct[i] for i in idx):
                eng.submit_update(unit, items, scale, entries=idx, zero_grads=z)
        for unit, items, z in early.values():  # the host's norms are known now: undo a skipped one's step counts
            eng.device_state.skip_if_nonfinite(unit, items, z)
        eng.zero_grad()
        eng.refresh_state_dict_views()  # held model.state_dict() tensors read this step's weights on return
        self._steps_called = number
        self._alive |= got
        self._zero -= got
        self._consumed = bool(got)
        self.user_clip_scale = 1.0
        eng.timeline_step_end(number)  # the worker timeline's step_end mark (nothing when it is off)
        if self._skipped_units:
            # A non-finite gradient: this step's host-stored updates (eager ones may still run) are
            # settled first, so that one warning (or error) names every skipped update of the step.
            eng.flush()
            self._report_skipped_units()
        return loss

    def _start_device_updates(self) -> dict:
        """Without clipping, enqueue the device-state units' updates before ``step()`` waits for gradients.

        Those units are the last of backward (layer 0, the resident unit): their gradients are done
        only when the GPU ends backward, and ``wait_grads`` would hold their updates until the host
        had seen that, with the GPU idle meanwhile. Enqueued now, they run right after backward; the
        non-finite check is made on the device (``finite_on_device``) and, once the host has the
        norms, a skipped update's step counts are put back (:meth:`step`). Nothing is enqueued early
        with clipping (the global norm is needed first), with ``nonfinite="raise"`` (a host-stored
        unit's non-finite gradient must stop the step before any update), where the device AdamW
        cannot check on the device, or while a host-stored entry with a gradient was not updated
        during backward (its non-finite check may skip the whole step).

        Returns:
            ``{unit index: (unit, items, zero-gradient entries)}`` of the updates enqueued.
        """
        eng = self.engine
        ds = eng.device_state
        if self.max_grad_norm is not None or self.nonfinite == "raise" or ds is None or not ds.checks_on_device:
            return {}
        units = {}
        for u in eng.units:
            states = u.grad_states()
            if u.device_state is None:
                if any(s.micro_batches and not s.eager for s in states):
                    return {}
                continue
            units[u.index] = (u, [s.micro_batches > 0 for s in states])
        if not any(any(b) for _, b in units.values()):
            return {}  # no gradient reached the device units: step()'s own checks decide
        early = {}
        # resident unit first, then layers in forward order (as step()'s own loop)
        for index, (u, got) in sorted(units.items(), key=lambda kv: (kv[1][0].kind != "resident", kv[0])):
            z = [i for i in range(len(u.entries))
                 if (index, i) in self._zero and not got[i] and (index, i) in self._entry]
            items = self._items(u, [g or i in z for i, g in enumerate(got)])
            if items:
                eng.submit_update(u, items, 1.0, entries=list(range(len(u.entries))), zero_grads=z,
                                  finite_on_device=True)
                early[index] = (u, items, z)
        return early

    def wait(self) -> None:
        """Block until every queued update has been applied."""
        self.engine.flush()

    def state_dict(self):
        """``torch.optim.Optimizer.state_dict()`` after the updates in flight: ``exp_avg`` / ``exp_avg_sq``
        are zero-copy fp32 CPU views of the host store (plain dicts and tensors: ``torch.load(...,
        weights_only=True)`` reads them)."""
        self.engine.sync_host()
        sd = super().state_dict()
        # (no waiting per parameter: synced above; disk units: copies read from the tier)
        sd["state"] = {k: {n: _value(x) for n, x in dict.items(v)} for k, v in sd["state"].items()}
        return sd

    def load_state_dict(self, state_dict) -> None:
        """Load a state dict produced by ``state_dict()`` (same parameter order) into the host store.

        Data parallel: a collective call (every rank calls it with the same ``state_dict``, at the
        same point; :mod:`megatrain.runtime.data_parallel.calls`): each node's local rank 0 writes
        ``exp_avg`` / ``exp_avg_sq`` into the shared store, every rank sets its step counts and groups.

        Raises:
            ValueError: if the groups or state shapes do not match this optimizer's parameters.
        """
        dp = getattr(self.engine, "dp", None)
        if dp is None:
            return self._load_state_dict(state_dict, write_moments=True)
        from ..runtime.data_parallel.calls import fingerprint

        with dp.collective("optimizer.load_state_dict", fingerprint(state_dict)):
            self._load_state_dict(state_dict, write_moments=False)  # checks and per-rank state (same on every rank)
            dp.on_local0(lambda: self._load_state_dict(state_dict, write_moments=True), "optimizer.load_state_dict")

    def _load_state_dict(self, state_dict, write_moments: bool) -> None:
        self.engine.sync_host()
        groups = state_dict["param_groups"]
        for g in groups:
            _check_options(".load_state_dict", g)
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
            eng, unit, i = _ref(p)
            if write_moments and unit.disk is not None:  # written through the tier's buffer
                eng.disk.write(unit, {(i, k): st[k] for k in ("exp_avg", "exp_avg_sq")})
            elif write_moments:
                self.state[p]["exp_avg"].copy_(st["exp_avg"])
                self.state[p]["exp_avg_sq"].copy_(st["exp_avg_sq"])
            self.state[p]["step"] = torch.as_tensor(st["step"], dtype=torch.float32).to("cpu").clone()
        for g, sg in zip(self.param_groups, groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        self.engine.host_written()  # device-state layers take the loaded exp_avg / exp_avg_sq

