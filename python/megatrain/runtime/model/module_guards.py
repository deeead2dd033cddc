"""Refusals :class:`~.module_api.ModuleApi` puts on a wrapped model: the calls that would change it behind
the host store's back raise at once, with one line naming what to do instead.

* ``model.half()`` / ``.to(dtype)`` / ``.to(other_device)`` on a module holding resident weights, and a
  dtype cast of a decoder layer (:func:`_install_cast_guard`);
* PEFT's ``merge_and_unload`` / ``merge_adapter`` / ``unmerge_adapter`` / ``unload``
  (:func:`_install_peft_merge_guard`);
* transformers' ``resize_token_embeddings`` / ``set_input_embeddings`` / ``set_output_embeddings``
  (:func:`_install_resize_guard`);
* ``register_hook`` / ``register_post_accumulate_grad_hook`` on a decoder layer's parameter
  (:func:`_install_grad_hook_guard`).

:func:`check_layers_unhooked` refuses, at ``wrap``, the same hooks registered before it and
parametrized decoder layers.
"""

from __future__ import annotations

import torch
from torch import nn


_CAST_MSG = ("megatrain: {call} would change the {what} of a model wrapped by megatrain.wrap (its resident weights "
             "are views of megatrain's {dtype} buffer on {device}; the streamed layers live in the host store): "
             "choose them at wrap: megatrain.wrap(model, compute_dtype=..., device=...)")


_LAYER_CAST_MSG = ("megatrain: casting a decoder layer to {dtype} would change nothing (its parameters are meta "
                   "placeholders; its weights are fp32 masters in the host store, computed in the compute_dtype chosen "
                   "at wrap): choose it there: megatrain.wrap(model, compute_dtype=...)")


def _install_cast_guard(eng, model: nn.Module) -> None:
    """``model.half()`` / ``.to(torch.bfloat16)`` / ``.to(other_device)`` on the model or a module holding
    resident weights raise before any tensor is converted (torch would cast only the resident part and
    detach it from the engine's buffer); a dtype cast of a module holding a decoder layer's placeholders
    (``model.model.layers[0].half()``) raises too: it would return as if done and change nothing. Calls that
    change nothing (``.to(its device)``, ``.float()`` on fp32 placeholders, the Trainer's placement) still run."""
    u = getattr(eng, "resident", None)
    # (module, attribute, resident?): a placeholder's device is meta whatever the engine's device, so only its
    # dtype is checked
    owners = [(mod, attr, True) for e in (u.entries if u is not None else []) for mod, attr in e.owners]
    owners += [(mod, attr, False) for layer in eng.layers for e in layer.entries for mod, attr in e.owners]
    if not owners:
        return
    holders = {id(mod) for mod, _, _ in owners}

    def make(m: nn.Module):
        orig = m._apply

        def _apply(fn, recurse=True):
            inside = {id(x) for x in m.modules()} if recurse else {id(m)}
            for mod, attr, resident in owners:
                p = mod._parameters.get(attr)
                if p is None or id(mod) not in inside:
                    continue
                if not resident:  # probed on an empty CPU tensor: a meta one cannot be moved to a device
                    try:
                        out = fn(torch.empty(0, dtype=p.dtype))
                    except Exception:  # a move this machine cannot make (e.g. no CUDA): not a cast
                        continue
                    if isinstance(out, torch.Tensor) and out.dtype != p.dtype:
                        raise TypeError(_LAYER_CAST_MSG.format(dtype=out.dtype))
                    continue
                out = fn(torch.empty(0, dtype=p.dtype, device=p.device))
                if not isinstance(out, torch.Tensor):
                    continue
                if out.dtype != p.dtype or out.device != p.device:
                    what = "dtype" if out.dtype != p.dtype else "device"
                    call = f"casting to {out.dtype}" if what == "dtype" else f"moving to {out.device}"
                    raise TypeError(_CAST_MSG.format(call=call, what=what, dtype=p.dtype, device=p.device))
            return orig(fn, recurse)
        return _apply

    for m in model.modules():
        if any(id(x) in holders for x in m.modules()):
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


_HOOK_MSG = ("megatrain: {call}() on {name}: per-parameter gradient hooks are not supported on the streamed decoder "
             "layers of a model wrapped by megatrain.wrap (the parameter is a meta placeholder; the layer's gradients "
             "are computed inside megatrain's backward and go to host memory, never to the parameter), so the hook "
             "would never fire; take the gradient norm from torch.nn.utils.clip_grad_norm_(model.parameters(), "
             "max_norm) or CPUAdamW(max_grad_norm=...).last_grad_norm, or register hooks on the unwrapped model")


def _install_grad_hook_guard(eng) -> None:
    """``register_hook`` / ``register_post_accumulate_grad_hook`` on a decoder layer's placeholder raise at once
    (the resident parameters are real tensors in the graph: their hooks are torch's)."""
    def refuse(call, name):
        def f(*args, **kwargs):
            raise RuntimeError(_HOOK_MSG.format(call=call, name=name))
        return f

    for u in eng.layers:
        for e in u.entries:
            for call in ("register_hook", "register_post_accumulate_grad_hook"):
                setattr(e.param, call, refuse(call, e.name))


_PRE_HOOK_MSG = ("megatrain.wrap: {name} has a {call}() hook registered before wrap: the decoder layers' parameters "
                 "become meta placeholders whose gradients go to host memory, so it would never fire; remove it "
                 "(handle.remove()) before wrap, and take the gradient norm from "
                 "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or CPUAdamW(max_grad_norm=...).last_grad_norm")
_PARAMETRIZED_MSG = ("megatrain.wrap: {name} is parametrized (torch.nn.utils.parametrize: {tensors}): a streamed decoder "
                     "layer runs on weights bound at each call and runs again in backward, so a parametrization's cache "
                     "(parametrize.cached()) or state (spectral_norm's power iteration) would be silently wrong; remove "
                     "it before wrap (torch.nn.utils.parametrize.remove_parametrizations(module, name)); parametrizations "
                     "of the embedding, final norm and LM head are supported")


def check_layers_unhooked(layers_name: str, layers: nn.Module) -> None:
    """Refuse decoder layers whose parameters carry gradient hooks, or whose modules are parametrized.

    Raises:
        ValueError: a decoder layer's parameter has a ``register_hook`` / ``register_post_accumulate_grad_hook``
            hook, or one of its modules is parametrized (``torch.nn.utils.parametrize``).
    """
    for mod_name, mod in layers.named_modules(prefix=layers_name):
        if torch.nn.utils.parametrize.is_parametrized(mod):
            raise ValueError(_PARAMETRIZED_MSG.format(name=mod_name, tensors=", ".join(mod.parametrizations)))
        for attr, p in mod._parameters.items():
            for hooks, call in (("_backward_hooks", "register_hook"),
                                ("_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook")):
                if getattr(p, hooks, None):
                    raise ValueError(_PRE_HOOK_MSG.format(name=f"{mod_name}.{attr}", call=call))
