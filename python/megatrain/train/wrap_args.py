"""The ``runtime`` section of a ``megatrain train`` config as ``megatrain.wrap``'s options.

:func:`wrap_options` is the one place the CLI maps its config keys to
:class:`~megatrain.runtime.wrap_options.WrapOptions`: the model builder passes them to
``wrap`` / ``from_pretrained`` / ``from_config`` and the memory check to ``megatrain.estimate``.
"""

from __future__ import annotations

import dataclasses

from megatrain.runtime.wrap_options import ESTIMATE_OPTIONS, WrapOptions
from megatrain.train.config import Config, wrap_auto_switch, wrap_device_state_layers, wrap_rows_mode


def wrap_options(cfg: Config, device, compute_dtype) -> WrapOptions:
    """The options ``megatrain train`` wraps its model with: ``cfg.runtime`` (already checked by the config)
    converted to ``wrap``'s types, on ``device`` (a ``torch.device``) in ``compute_dtype``, with the run's batch
    (``micro_batch_size=train.micro_batch_size``: each process's rows per micro-batch, ``seq_len=data.seq_len``):
    the capacity share of exclusive device-state layers then keeps the activation estimate ``--dry-run`` counts for
    it. With the disk tier and gradient accumulation the accumulator is planned at wrap
    (``grad_accumulator=True``): the disk layers leave room for it."""
    r = cfg.runtime
    opts = WrapOptions(device=device, compute_dtype=compute_dtype, activation_policy=r.activation_policy,
                       chunked_loss=wrap_rows_mode(r.chunked_loss), tile_mlp=wrap_rows_mode(r.tile_mlp),
                       offload_dir=r.offload_dir, host_memory_limit=r.host_memory_limit,
                       device_state_layers=wrap_device_state_layers(r.device_state_layers),
                       gpu_memory_limit=r.gpu_memory_limit, liger_kernel=wrap_auto_switch(r.liger_kernel),
                       micro_batch_size=cfg.train.micro_batch_size, seq_len=cfg.data.seq_len,
                       host_compute_copy={"auto": "auto", "true": True, "false": False}[r.host_compute_copy],
                       where="runtime")  # the config checked each value: a message here names its section
    if r.offload_dir is not None and cfg.train.gradient_accumulation_steps > 1:
        opts = dataclasses.replace(opts, grad_accumulator=True)
    return opts


def estimate_kwargs(opts: WrapOptions) -> dict:
    """The options ``megatrain.estimate`` takes, as its keywords; ``grad_accumulator`` left at its default
    (the estimate counts the accumulator from ``gradient_accumulation_steps``)."""
    kw = opts.as_kwargs(ESTIMATE_OPTIONS)
    kw.pop("grad_accumulator")
    return kw
