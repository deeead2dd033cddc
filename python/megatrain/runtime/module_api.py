"""The ``nn.Module`` surface of a wrapped model: ``state_dict``, ``load_state_dict``, ``save_pretrained``,
``clip_grad_norm_``, pickling.

A wrapped model's decoder-layer parameters are meta-device placeholders and its resident
parameters are views of a device buffer holding the compute copy; the authoritative weights are
the fp32 master weights in the host store. This module makes the ordinary calls of a training
script read and write those masters:

* ``model.state_dict()`` (and any submodule's): the parameters are zero-copy fp32 CPU views of the
  host store's master section (no copy of the model in RAM; tied parameters are one tensor under
  every name, as torch gives them); buffers are torch's.
* ``model.load_state_dict(sd, strict=..., assign=False)``: torch's own loading (dtype conversion,
  shape checks, ``_IncompatibleKeys`` return value, error messages) copies each parameter straight
  into its master; the compute copy (and the resident device buffer) is then rebuilt from the
  masters. On the model itself the strict key check and the shape checks run before anything is
  written, so a refused load changes nothing.
* ``model.save_pretrained(dir, ...)``: transformers' own ``save_pretrained`` (its arguments, its
  sharding and tied-weight handling) over that state dict, with each safetensors shard written
  tensor by tensor straight from the host store (no shard-sized copy in RAM); ``config.json``
  records ``dtype: float32`` (the masters' dtype) and ``use_cache: true``.
* ``torch.nn.utils.clip_grad_norm_`` over a wrapped model's parameters: the exact global norm
  from the engine's per-parameter squared norms, and the clip coefficient applied inside the
  next ``CPUAdamW.step()`` (see :func:`clip_grad_norm_`).
* ``torch.save(model)`` / ``copy.deepcopy(model)``: refused with one line naming what to use.

Every read waits for the CPU updates in flight and copies the device-state layers' state to the host
store first (``engine.sync_host()``); every write refreshes them after (``engine.host_written()``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import types
import warnings
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from .engine import locate

_PICKLE_MSG = ("megatrain: a model wrapped by megatrain.wrap cannot be pickled (torch.save(model), copy.deepcopy): its "
               "weights live in megatrain's host store. Save with torch.save(model.state_dict(), path) (fp32 master "
               "weights), model.save_pretrained(dir), or megatrain.save_checkpoint(dir, model, optimizer, scheduler) "
               "to resume training")


class EngineModuleApi:
    """Mixed into the wrapped engine: refuses pickling (it holds a host store and a worker thread)."""

    def __reduce_ex__(self, protocol):
        raise TypeError(_PICKLE_MSG)


# ---------------------------------------------------------------------------- state_dict
def _owned(eng) -> Dict[int, List[Tuple[str, object, int]]]:
    """id(module) -> [(attribute, unit, entry index)] for every module holding a parameter of ``eng``."""
    out: Dict[int, list] = {}
    for u in eng.units:
        for i, e in enumerate(u.entries):
            for mod, attr in e.owners:
                out.setdefault(id(mod), []).append((attr, u, i))
    return out


class _Masters:
    """One cached zero-copy fp32 view of each entry's master weights (the same tensor for tied names)."""

    def __init__(self, eng):
        self.eng = eng
        self._views: dict = {}

    def get(self, u, i) -> torch.Tensor:
        key = (u.index, i)
        v = self._views.get(key)
        if v is None:
            if getattr(u.entries[i], "frozen", False):  # no fp32 sections: its compute copy is its value
                return self.eng.entry_view(u, i, "compute").float()
            v = self.eng.entry_view(u, i, "master")
            self._views[key] = v
        return v


def install(eng, model: nn.Module) -> None:
    """Give ``model`` (wrapped, engine ``eng``) the state_dict / load_state_dict / save_pretrained surface."""
    masters = _Masters(eng)
    eng.masters = masters
    owned = _owned(eng)
    loading = threading.local()
    # Checks first: whichever module load_state_dict is called on (prefix "") validates before any
    # write (registered before the owners' hooks, so it runs before their swap).
    for m in model.modules():
        m.register_load_state_dict_pre_hook(_make_load_check_hook(eng, loading))
    mods = {id(m): m for m in model.modules()}
    for mid, items in owned.items():
        mod = mods.get(mid)
        if mod is None:
            continue
        mod.register_state_dict_post_hook(_make_sd_hook(eng, masters, items))
        mod.register_load_state_dict_pre_hook(_make_load_pre_hook(masters, items))
        mod.register_load_state_dict_post_hook(_make_load_post_hook(eng, items))
    model.register_load_state_dict_post_hook(lambda m, incompatible: eng.load_resident())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into the fp32 master weights (checks run before any write)."""
        loading.strict = bool(strict)
        try:
            return nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)
        finally:
            loading.strict = None
            _restore_placeholders(eng, [(mod, attr, u, i) for u in eng.units for i, e in enumerate(u.entries)
                                        for mod, attr in e.owners])

    object.__setattr__(model, "load_state_dict", types.MethodType(load_state_dict, model))
    _install_cast_guard(eng, model)
    _install_peft_merge_guard(model)
    _install_resize_guard(model)
    if hasattr(model, "save_pretrained"):
        object.__setattr__(model, "save_pretrained", types.MethodType(_save_pretrained, model))
    # Pickling walks the model's __dict__ in order: the engine goes first, so its refusal is the
    # error a user sees (not one about a hook's lambda further down).
    d = model.__dict__
    eng_ref = d.pop("megatrain")
    rest = dict(d)
    d.clear()
    d["megatrain"] = eng_ref
    d.update(rest)


_CAST_MSG = ("megatrain: {call} would change the {what} of a model wrapped by megatrain.wrap (its resident weights "
             "are views of megatrain's {dtype} buffer on {device}; the streamed layers live in the host store): "
             "choose them at wrap: megatrain.wrap(model, compute_dtype=..., device=...)")


def _install_cast_guard(eng, model: nn.Module) -> None:
    """``model.half()`` / ``.to(torch.bfloat16)`` / ``.to(other_device)`` on the model or a module holding
    resident weights raise before any tensor is converted (torch would cast only the resident part and
    detach it from the engine's buffer). Calls that change nothing (``.to(its device)``, the
    Trainer's placement) still run."""
    u = getattr(eng, "resident", None)
    if u is None:
        return
    owners = [(mod, attr) for e in u.entries for mod, attr in e.owners]
    holders = {id(mod) for mod, _ in owners}

    def holds_resident(m: nn.Module) -> bool:
        return any(id(x) in holders for x in m.modules())

    def make(m: nn.Module):
        orig = m._apply

        def _apply(fn, recurse=True):
            for mod, attr in owners:
                p = mod._parameters.get(attr)
                if p is None or not (mod is m or (recurse and any(mod is x for x in m.modules()))):
                    continue
                out = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                if isinstance(out, torch.Tensor) and (out.dtype != p.dtype or out.device != p.device):
                    what = "dtype" if out.dtype != p.dtype else "device"
                    call = f"casting to {out.dtype}" if what == "dtype" else f"moving to {out.device}"
                    raise TypeError(_CAST_MSG.format(call=call, what=what, dtype=p.dtype, device=p.device))
            return orig(fn, recurse)
        return _apply

    for m in model.modules():
        if holds_resident(m):
            object.__setattr__(m, "_apply", make(m))


_MERGE_MSG = ("megatrain: PEFT's {name}() cannot run on a model wrapped by megatrain.wrap (it would merge or remove the "
              "adapter on the streamed layers' meta placeholders and return a wrong model); use "
              "megatrain.export_pretrained(model, dir, merge_adapter=True) for the merged model, or "
              "export_pretrained(model, dir) for the adapter")


def _install_peft_merge_guard(model: nn.Module) -> None:
    """PEFT's merge_and_unload / merge_adapter / unmerge_adapter / unload on a wrapped model raise at once."""
    try:
        from peft.tuners.tuners_utils import BaseTuner
    except Exception:  # peft not installed: nothing to guard
        return

    def refuse(name):
        def f(*args, **kwargs):
            raise RuntimeError(_MERGE_MSG.format(name=name))
        return f

    targets = [m for m in model.modules() if isinstance(m, BaseTuner)]
    if targets and hasattr(model, "peft_config"):
        targets.append(model)
    for t in targets:
        for name in ("merge_and_unload", "merge_adapter", "unmerge_adapter", "unload"):
            if hasattr(t, name):
                object.__setattr__(t, name, refuse(name))


_RESIZE_MSG = ("megatrain: {name}() cannot change a model wrapped by megatrain.wrap (the new embedding would not be in "
               "the host store: not trained, not saved); resize first, then wrap: "
               "model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32); model.{name}(...); "
               "model = megatrain.wrap(model)")


def _install_resize_guard(model: nn.Module) -> None:
    """transformers' resize_token_embeddings / set_input_embeddings / set_output_embeddings raise at once."""
    def refuse(name):
        def f(*args, **kwargs):
            raise RuntimeError(_RESIZE_MSG.format(name=name))
        return f

    for m in model.modules():
        for name in ("resize_token_embeddings", "set_input_embeddings", "set_output_embeddings"):
            if callable(getattr(type(m), name, None)):
                object.__setattr__(m, name, refuse(name))


def _make_sd_hook(eng, masters, items):
    def hook(module, state_dict, prefix, local_metadata):
        eng.sync_host()
        for attr, u, i in items:
            key = prefix + attr
            if key in state_dict:
                state_dict[key] = masters.get(u, i)
    return hook


def _expected(module) -> dict:
    """key -> shape of what ``module.state_dict()`` holds (parameters: the masters' shapes)."""
    return {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}


def _make_load_check_hook(eng, loading):
    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        if prefix != "":
            return
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("megatrain: load_state_dict(assign=True) cannot replace the parameters of a model wrapped by "
                             "megatrain.wrap (its weights live in the host store); use assign=False: the values are "
                             "copied into the fp32 master weights")
        eng.sync_host()
        strict_now = getattr(loading, "strict", None)
        want = _expected(module)
        msgs = []
        if strict_now:
            miss = [k for k in want if k not in state_dict]
            unexp = [k for k in state_dict if k not in want]
            if miss:
                msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in miss)))
            if unexp:
                msgs.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexp)))
        for k, shape in want.items():
            if k not in state_dict:
                continue
            v = state_dict[k]
            if not torch.overrides.is_tensor_like(v):
                msgs.append(f'While copying the parameter named "{k}", expected torch.Tensor or Tensor-like object '
                            f"from checkpoint but received {type(v)}")
                continue
            vs = tuple(v.shape)
            if vs != shape and not (len(shape) == 0 and len(vs) == 1):
                msgs.append(f"size mismatch for {k}: copying a param with shape {v.shape} from checkpoint, the shape "
                            f"in current model is {torch.Size(shape)}.")
        if msgs:
            raise RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(
                module.__class__.__name__, "\n\t".join(msgs)))
    return hook


def _make_load_pre_hook(masters, items):
    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, error_msgs):
        # torch's own _load_from_state_dict then copies each value straight into its master.
        for attr, u, i in items:
            module._parameters[attr] = masters.get(u, i)
    return hook


def _make_load_post_hook(eng, items):
    def hook(module, incompatible):
        _restore_placeholders(eng, [(module, attr, u, i) for attr, u, i in items])
    return hook


def _restore_placeholders(eng, where) -> None:
    """Put the placeholders back where a load swapped in the masters; rebuild those entries' compute copy."""
    units = {}
    for mod, attr, u, i in where:
        e = u.entries[i]
        if mod._parameters.get(attr) is not e.param:
            mod._parameters[attr] = e.param
            units.setdefault(u.index, (u, set()))[1].add(i)
    with torch.no_grad():
        for u, idx in units.values():
            for i in sorted(idx):
                if not u.direct[i]:  # a direct gradient held there: the update rebuilds it from the master
                    eng.entry_view(u, i, "compute").copy_(eng.entry_view(u, i, "master"))
            eng.invalidate([u])  # device slots / the resident buffer reload from the new compute copy
    eng.host_written([u for u, _ in units.values()])  # device-state layers take the loaded masters


# ---------------------------------------------------------------------------- save_pretrained
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def stream_safetensors(tensors: dict, filename: str, metadata: Optional[dict] = None) -> None:
    """``safetensors.torch.save_file`` that writes each tensor's bytes straight from its memory.

    Args:
        tensors: ``{name: tensor}``; CPU contiguous tensors are written without a copy, others are
            moved / made contiguous one at a time.
        filename: destination file (overwritten).
        metadata: string-to-string ``__metadata__``.

    Raises:
        ValueError: a dtype safetensors has no code for here (the caller falls back to safetensors).
    """
    import ctypes
    import struct

    header = {}
    off = 0
    for k, t in tensors.items():
        if t.dtype not in _ST_DTYPES:
            raise ValueError(f"unsupported dtype {t.dtype}")
    # safetensors' own order: larger elements first (every tensor stays aligned), then by name
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    for k in names:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(a): str(b) for a, b in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(filename, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for k in names:
            t = tensors[k].detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            n = t.numel() * t.element_size()
            if n:
                f.write(memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B"))


@contextlib.contextmanager
def _streamed_shards():
    """Within: transformers' ``save_pretrained`` writes safetensors shards with :func:`stream_safetensors`."""
    import transformers.modeling_utils as mu

    orig = getattr(mu, "safe_save_file", None)
    if orig is None:
        yield
        return

    def save(tensors, filename, metadata=None):
        try:
            stream_safetensors(tensors, filename, metadata)
        except ValueError:
            orig(tensors, filename, metadata=metadata)

    mu.safe_save_file = save
    try:
        yield
    finally:
        mu.safe_save_file = orig


def _save_pretrained(self, save_directory, *args, **kwargs):
    """transformers' ``save_pretrained`` over the fp32 master weights (see the module docstring)."""
    eng = self.megatrain
    eng.sync_host()
    cfg = getattr(self, "config", None)
    use_cache = getattr(cfg, "use_cache", None)
    if cfg is not None and use_cache is not None:
        cfg.use_cache = True  # wrap() switched it off for training; a saved model generates with a cache
    try:
        with _streamed_shards():
            out = type(self).save_pretrained(self, save_directory, *args, **kwargs)
    finally:
        if cfg is not None and use_cache is not None:
            cfg.use_cache = use_cache
    path = os.path.join(str(save_directory), "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            c = json.load(f)
        for k in ("dtype", "torch_dtype"):
            if k in c:
                c[k] = "float32"  # the masters' dtype (model.dtype is the compute copy's)
        with open(path, "w") as f:
            json.dump(c, f, indent=2, sort_keys=True)
            f.write("\n")
    return out


# ---------------------------------------------------------------------------- clip_grad_norm_
_torch_clip_grad_norm_ = torch.nn.utils.clip_grad_norm_


def _engine_of(params: list):
    refs = [locate(p) for p in params]
    got = [r for r in refs if r is not None]
    if not got:
        return None
    if len(got) != len(refs):
        raise ValueError("megatrain: clip_grad_norm_ got parameters of a model wrapped by megatrain.wrap mixed with "
                         "other tensors; clip them in separate calls (or give max_grad_norm to CPUAdamW)")
    eng = got[0][0]
    if any(r[0] is not eng for r in got):
        raise ValueError("megatrain: clip_grad_norm_ got parameters of two different wrapped models")
    return eng


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: Optional[bool] = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, exact for the parameters of a wrapped model.

    Installed in place of torch's function when megatrain is imported; for anything but a
    wrapped model's parameters it calls torch's own. For those it returns the total L2 norm of
    their gradients (computed from the engine's per-parameter squared norms: a float32 CPU
    scalar tensor, the same value torch would return on the unwrapped model) and records the
    clip coefficient ``min(max_norm / (total + 1e-6), 1)``, which the next ``CPUAdamW.step()``
    applies inside its fused update (then ``max_grad_norm`` clips the clipped gradient again,
    exactly as torch would if both were applied; a ``max_grad_norm`` >= ``max_norm`` changes nothing).

    Args:
        parameters: the wrapped model's parameters (an iterable or a single tensor); every
            parameter holding a gradient must be in it (the coefficient is one per step).
        max_norm: as torch. norm_type: 2 only. error_if_nonfinite, foreach: as torch (foreach: no effect).

    Raises:
        RuntimeError: CPUAdamW was created without ``max_grad_norm`` and a gradient has arrived:
            its updates start during backward, so no clip can apply to them (set
            ``CPUAdamW(max_grad_norm=...)``; ``max_norm=inf``, which clips nothing, returns nan
            with a warning instead); the total norm is not finite and ``error_if_nonfinite``.
        ValueError: ``norm_type`` is not 2; a parameter holding a gradient is missing from ``parameters``.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    eng = _engine_of(params)
    if eng is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite,
                                      foreach=foreach)
    opt = eng.optimizer
    if float(norm_type) != 2.0:
        raise ValueError(f"megatrain: clip_grad_norm_ on a wrapped model supports norm_type=2 only, got {norm_type!r}")
    if opt is None:
        return torch.tensor(0.0)
    if any(u.eager_queued for u in eng.units) or (opt.max_grad_norm is None and _any_grad(eng)):
        if math.isinf(float(max_norm)) and float(max_norm) > 0:
            # Nothing to clip (the Trainer asks this way for a norm to log): the updates stand as they
            # are; the norm itself was never computed.
            if not getattr(eng, "_warned_norm_unknown", False):
                eng._warned_norm_unknown = True
                warnings.warn("megatrain: clip_grad_norm_(max_norm=inf) returns nan on this wrapped model: without "
                              "CPUAdamW(max_grad_norm=...) the updates start during backward and no global norm is "
                              "computed; pass max_grad_norm=float('inf') to CPUAdamW to get it", UserWarning,
                              stacklevel=2)
            return torch.tensor(float("nan"))
        raise RuntimeError(
            "megatrain: clip_grad_norm_ on a wrapped model needs CPUAdamW(..., max_grad_norm=...): without it each "
            "layer's update starts during backward, before this clip. Pass max_grad_norm to CPUAdamW (the same "
            "value clips exactly like clip_grad_norm_; then this call returns the true norm and changes nothing more), "
            "or float('inf') to clip only here")
    eng.wait_grads()
    given = {id(p) for p in params}
    sq = 0.0
    for u in eng.units:
        for i, e in enumerate(u.entries):
            if u.has_grad[i]:
                if id(e.param) not in given:
                    raise ValueError(f"megatrain: clip_grad_norm_ on a wrapped model needs every parameter that holds a "
                                     f"gradient; {e.name} has one and is not in the list (pass model.parameters())")
                sq += u.grad_sq[i]
    total = math.sqrt(sq) * opt.user_clip_scale
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           "norm anyway, set `error_if_nonfinite=False`")
    total_t = torch.tensor(total, dtype=torch.float32)
    coef = float(torch.clamp(float(max_norm) / (total_t + 1e-6), max=1.0))
    opt.user_clip_scale *= coef
    return total_t


def _any_grad(eng) -> bool:
    return any(any(u.has_grad) or any(u.batches) for u in eng.units)


def install_clip_grad_norm() -> None:
    """Route ``torch.nn.utils.clip_grad_norm_`` through :func:`clip_grad_norm_` (idempotent)."""
    import torch.nn.utils.clip_grad as cg

    for mod in (torch.nn.utils, cg):
        if getattr(mod, "clip_grad_norm_", None) is _torch_clip_grad_norm_:
            mod.clip_grad_norm_ = clip_grad_norm_
