"""``megatrain.wrap(model)``: turn a Hugging Face causal LM into a streamed, host-stored model.

Each entry of the model's decoder ``ModuleList`` becomes a *streamed layer*: the same module
object (so per-layer attributes such as ``layer_type``, sliding windows and ``layer_idx`` stay
right), switched to a subclass of its own class whose ``forward`` runs the layer on weights
streamed from host memory through a custom autograd Function. Its parameters are replaced by
meta-device placeholders (shape and ``requires_grad`` kept, no storage); at execution they are
bound as zero-copy views into the device slot that holds the layer. The model's own forward
(masks, rotary embeddings, embedding scaling, logit soft-capping, MoE routing) runs unchanged.

Everything else (embedding, final norm, LM head, ...) is the *resident unit*: real device
parameters whose storage is one device buffer, loaded from the host store once per step and
whose gradients are offloaded by post-accumulate-grad hooks (tied weights are one parameter,
so autograd sums both contributions before the hook fires).
"""

from __future__ import annotations

import gc
import warnings
from typing import Optional, Union

import torch
from torch import nn

from ..activations import long_context
from ..compat.clip_grad import install_accelerate_clip
from .fused_kernels import apply_liger_kernel
from .decoder_layers import UnsupportedModelError, find_decoder_layers, model_units  # noqa: F401 - public here
from .model_config import cache_flags, router_logits_asked, set_cache_flags
from .module_api import ModuleApi
from .module_guards import check_layers_unhooked
from ..activations.policies import AUTO_STORE_FRACTION, check_activation_policy, default_activation_policy  # noqa: F401 - public here
from ..activations.attention_reuse import AttentionReuse
from ..compat.torch_patches import install_torch_patches
from ..placement.streamed_minimum import check_wrap_gpu_memory_limit
from ..wrap_options import WrapOptions
from .wrapped_engine import WrappedEngine


def wrap(model: nn.Module, device: Optional[torch.device | str] = None, compute_dtype: torch.dtype = None,
         activation_policy: Optional[str] = None, num_slots: int = 2, grad_accumulator: Optional[bool] = None,
         chunked_loss="auto", tile_mlp="auto", device_state_layers=None, offload_dir=None,
         host_memory_limit: Optional[Union[int, str]] = None, reuse_attention: bool = True,
         lean_activations: bool = False, gpu_memory_limit=None, liger_kernel: Optional[bool] = None,
         micro_batch_size: Optional[int] = None, seq_len: Optional[int] = None,
         host_compute_copy="auto") -> nn.Module:
    """Move a causal LM's training state into host memory and stream its decoder layers.

    Args:
        model: a Hugging Face causal LM (or any module whose forward loops over one ``nn.ModuleList``
            of decoder layers; hybrid models may mix layer classes), with its weights on the CPU (any
            float dtype; fp32 recommended: the fp32 master weights are initialised from them).
        device: compute device. Default: ``cuda`` when available, else ``cpu``.
        compute_dtype: dtype of the streamed compute copy and of all activations:
            ``torch.bfloat16`` (default on CUDA) or ``torch.float32`` (default on CPU; exact parity).
        activation_policy: ``None`` (default): ``"auto"`` on CUDA (the placement planner: the fastest
            exact schedule it finds in the free GPU memory, docs/placement.md) and ``"recompute"`` on
            the CPU backend. ``"recompute"`` (save each layer input, recompute the layer in backward;
            with ``device_state_layers=0``: the streamed-only schedule, the least GPU memory),
            ``"block:K"`` (save every K-th layer input, recompute the block), ``"store"`` (keep
            every layer's activations on the device, no recomputation: backward re-streams only
            the weights; needs the activation memory of plain training without checkpointing) or
            ``"auto"`` (``store`` when the activations measured on the first layer call, times the
            number of layers, fit in 60% of the free device memory; else as many layers as fit
            keep their activations and the rest recompute; when not even every layer's input fits
            (long context), ``block:K`` with K from the free memory; decided per input shape from
            the first layer call, recorded in ``model.megatrain.auto_decisions``) or ``"offload"``
            (as ``recompute``, but each saved layer input is parked in pinned host memory in
            forward and copied back, prefetched one layer ahead, in backward; see
            ``megatrain.runtime.activations.host_offload``).
        num_slots: device slots per layer shape; prefetch depth is ``num_slots - 1`` (2: forward
            loads layer ``i+1`` while ``i`` runs; 3: ``i+1`` and ``i+2``).
        grad_accumulator: the fp32 gradient accumulator (4 B per trainable parameter). ``None``
            (default): allocated only when needed, i.e. when ``CPUAdamW`` is created with
            ``gradient_accumulation_steps > 1``, or at a second backward before ``step()``; a
            loop with one backward per step costs 14 B/param. ``True``: a section of the host
            store from the start (18 B/param). ``False``: never; a second backward before
            ``step()`` raises. Without it each gradient goes straight into the store's bf16
            compute copy and is read from there by the update.
        chunked_loss: LM head + cross-entropy over row chunks without the full logits when the
            forward gets ``labels`` (``outputs.logits`` is then ``None``): ``"auto"`` (when the fp32
            logits would exceed 1/16 of the free device memory), ``True``, ``False`` or rows per
            chunk. See ``docs/long_context.md``.
        tile_mlp: run each decoder layer's ``mlp`` over row tiles (exact; backward re-runs each
            tile): ``"auto"`` (when its intermediates would exceed 1/16 of the free device memory),
            ``True``, ``False`` or rows per tile.
        device_state_layers: decoder layers ``0 .. K-1`` whose *whole* training state stays on the
            device: compute-dtype weights, fp32 master, ``exp_avg``, ``exp_avg_sq`` and fp32 gradient
            accumulator, i.e. 2 + 12 + 4 = 18 device bytes per parameter in bf16 (20 in fp32). Their
            weights never stream, their gradients never leave the device, and ``optimizer.step()``
            updates them on the device with exactly ``torch.optim.AdamW``'s math (clip coefficient
            of the global norm, per-parameter step counts, the groups' hyperparameters); the next
            forward runs on them while the CPU updates the deeper layers. An int ``K`` (0 .. number
            of layers), or ``"auto"``: first the resident unit (embedding, final norm, LM head: 16
            more device bytes per parameter, its compute copy is on the device already), then as many
            layers as fit in half of the device memory free at wrap time, computed from those exact
            byte counts (an explicit K never moves the resident unit's state), or ``"boundary"``: the
            units at the step boundary, the resident unit then layer 0 (their gradients are the last
            of a backward, their weights the first need of the next forward), while together they
            fit in 1/8 of the device memory free at wrap time (~5 GB for a 3.37B Llama). Default
            ``None``: on CUDA ``"auto"`` with ``activation_policy="auto"`` (the placement planner:
            first the training state of as many layers as fit, then the activations of as many
            layers as fit in what is left) and ``"boundary"`` under the other policies; on the CPU
            backend 0 (every layer's state in the host store). ``model.megatrain.placement()`` says
            what was chosen; ``0`` keeps every unit's state in the host store (least GPU memory). The host store keeps these layers' sections too: checkpoints,
            ``state_dict()``, export and ``optimizer.state`` read and write them there (see
            ``megatrain.runtime.placement.device_state`` and docs/placement.md), unless the host
            store of every unit does not fit the host budget: then the whole state of the fewest of
            these layers that make it fit is held on the device only, with no host section
            ("exclusive"; when these would not do, the deepest layers are master-streamed first, then
            more leading layers made exclusive, then disk: docs/placement.md;
            ``placement()["exclusive_layers"]``), read through copies streamed one layer at a time.
        offload_dir: a directory on a local disk (NVMe) for the fp32 state (master, ``exp_avg``,
            ``exp_avg_sq`` and, with accumulation, the gradient accumulator) of the decoder layers
            that do not fit in host memory: the deepest layers, as few as make the rest fit
            ``host_memory_limit`` and the host budget (the tier's RAM buffers, 2 x the largest
            layer's fp32 state, included). Their bf16 compute copy stays in host memory; their
            updates read the state ahead and write it behind (docs/disk_tier.md). The files are a
            working area (created here, removed when the model is freed): the checkpoint stays the
            only durable state. The directory (or its parent) must exist and be writable, and its
            filesystem must have room: checked before anything is written. None (default): no disk.
        host_memory_limit: bytes of host memory megatrain may use for the store, the gradient
            staging and the disk tier's buffers: an int, or a string with a unit as ``megatrain.estimate``'s
            ``host_memory`` takes it (``"100GiB"``, ``"1.5TB"``; KiB..TiB powers of 1024, KB..TB of 1000);
            ``float("inf")`` / ``"inf"``: no limit beyond the machine's. None: the host budget check's limits
            (MemAvailable, cgroup, RLIMIT_MEMLOCK). Without ``offload_dir`` a model over the limit,
            even with the exclusive layers the device budget holds, raises ``HostMemoryError`` (it names
            the ``device_state_layers`` that would fit for an explicit K, else ``gpu_memory_limit``).
        gpu_memory_limit: the GPU memory megatrain may plan for, for a user who needs the rest for
            other work: an int (bytes, >= 1 MiB) or a float in (0, 1] (a fraction of the device's
            total memory). Every placement decision (device-state layers, kept graphs, the planner's
            second decision, chunked loss and MLP tiling) then counts as free at most this cap less
            what the process's tensors on the device already hold (``torch.cuda.memory_allocated``).
            It bounds what megatrain places, not the allocator: transient memory (a step's logits,
            workspaces) is left for inside it, as in the uncapped planner; for a hard cap of the
            process use ``torch.cuda.set_per_process_memory_fraction``. A cap below what even the
            streamed schedule keeps on the device (``num_slots`` slots of the largest layer's compute
            copy and the resident embedding / final norm / LM head with its gradients: ``estimate``'s
            "layer slots" + "resident unit + grads") raises ``ValueError`` in one line before anything
            is allocated. None (default): the whole device. Ignored on the CPU backend.
        liger_kernel: Liger-Kernel's fused Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear
            cross-entropy; ``pip install liger-kernel``) on the architectures it supports:
            ``None`` (default): when liger-kernel is installed and the device is CUDA; ``True``:
            required; ``False``: off. Applied to the model before the engine is built; see
            ``megatrain.runtime.model.fused_kernels`` (where its loss and ``chunked_loss`` meet).
        host_compute_copy: whether a decoder layer's bf16 compute copy is kept in host memory beside its
            fp32 master, exp_avg and exp_avg_sq (14 B/param at one backward per step). ``False``: no layer
            keeps it (*master-streamed*, 12 B/param): its slot is filled from the fp32 master, cast on the
            device (the same bits), and its gradients wait on the device for its update; ``True``: every
            host-stored layer keeps it; ``"auto"`` (default): kept unless the host store does not fit, then
            (after the layers on the device anyway, made exclusive) the fewest, deepest layers are
            master-streamed before more layers' state goes to the device only or to disk. Layers with a frozen
            parameter, disk-tier layers and data parallel runs keep the compute copy; a device-exclusive layer
            has none in host memory, whatever this says (``megatrain.runtime.placement.master_streamed``).
        reuse_attention: under ``block:K``, keep the attention output and log-sum-exp that the
            backward's re-run of a block computes, so that each layer's own re-run with grad takes
            them instead of running its attention forward again (SDPA's cuDNN / flash kernels;
            exact: the same kernel's backward; see ``megatrain.runtime.activations.attention_reuse``).
        lean_activations: ``True``: the decoder layers' RMSNorms keep only their input for backward
            and a Llama-style gated MLP keeps ``gate`` and ``up`` but not ``act(gate)``; backward
            recomputes the rest. 30% less activation memory per kept layer graph (``store`` /
            ``auto``) and per layer re-run, bit-identical gradients, for ~2 ms more GPU time per layer
            and step at 4 x 4096 tokens on a 6.74B Llama (H200): worth it where memory decides how
            many layers keep their graphs, a loss where every graph fits anyway (see
            ``megatrain.runtime.activations.lean_ops``). Default ``False``: the plain autograd graphs.
        micro_batch_size, seq_len: the batch you will train on (sequences per micro-batch, tokens per sequence;
            ints >= 1; both or neither: one alone is refused), as ``megatrain.estimate`` takes them. Used only when the host store does not fit and more
            leading layers must keep their fp32 state on the device only than the ``"auto"`` share holds: their
            *capacity share* (the free device memory less the streamed schedule's minimum) then keeps exactly the
            activation + logits bytes ``megatrain.estimate`` counts for this batch, so ``wrap`` plans the exclusive
            layers ``estimate(model, micro_batch_size=, seq_len=)`` reports. None (default; both are needed): the
            batch is not known and 20% of the free device memory is kept instead (docs/placement.md).
            ``model.megatrain.placement()["activation_reserve"]`` says which (``"batch 4 x 4096"`` or
            ``"20% of free memory"``) and ``["activation_reserve_bytes"]`` how much was kept.

    Parameters with ``requires_grad=False`` when the model is wrapped (a PEFT/LoRA base, a frozen
    embedding) are *frozen*: the store holds only their compute copy (2 B/param in bf16), no
    master weights, Adam moments or accumulator; unfreezing one later raises ``RuntimeError``.

    Returns:
        The same ``model`` object, with ``model.megatrain`` holding the engine. Create the
        optimizer (``megatrain.optim.CPUAdamW(model.parameters(), ...)``) afterwards.
        ``state_dict()`` / ``load_state_dict()`` / ``save_pretrained()`` read and write the fp32
        master weights (see ``megatrain.runtime.model.module_api`` and docs/drop_in.md), and
        transformers' gradient checkpointing (``gradient_checkpointing_enable()``) is ignored with a
        warning: ``activation_policy`` decides what is recomputed.

    Raises:
        UnsupportedModelError: no decoder layer list that the model's forward loops over (see
            ``find_decoder_layers``), weights shared between a layer and another module or between two
            layers, or layers that run their own backward (reversible layers, e.g. Reformer).
        ValueError: bad ``device`` (not CUDA or CPU, or CUDA unavailable), ``activation_policy`` /
            ``compute_dtype`` / ``num_slots`` / ``gpu_memory_limit`` / ``liger_kernel`` / ``micro_batch_size`` /
            ``seq_len`` (``gpu_memory_limit`` below
            the streamed schedule's minimum: ``GpuMemoryLimitError``, a ``ValueError``), ``liger_kernel=True``
            without liger-kernel installed or off CUDA, the model is already wrapped, a decoder layer's parameter
            has a gradient hook (``register_hook`` / ``register_post_accumulate_grad_hook``) or a decoder
            layer's module is parametrized (``torch.nn.utils.parametrize``).
        HostMemoryError: the host store does not fit in host memory (nothing is allocated), even
            with the layers' fp32 state on disk when ``offload_dir`` is given.
        DiskSpaceError: ``offload_dir``'s filesystem has less free space than the disk tier's files
            need (an ``OSError``, ``errno.ENOSPC``; nothing is written).
    """
    return _wrap(model, WrapOptions(
        device=device, compute_dtype=compute_dtype, activation_policy=activation_policy, num_slots=num_slots,
        grad_accumulator=grad_accumulator, chunked_loss=chunked_loss, tile_mlp=tile_mlp,
        device_state_layers=device_state_layers, offload_dir=offload_dir, host_memory_limit=host_memory_limit,
        reuse_attention=reuse_attention, lean_activations=lean_activations, gpu_memory_limit=gpu_memory_limit,
        liger_kernel=liger_kernel, micro_batch_size=micro_batch_size, seq_len=seq_len,
        host_compute_copy=host_compute_copy, where="megatrain.wrap"))


def _wrap(model: nn.Module, options: WrapOptions, source=None):
    """``wrap`` with its options checked once in ``options``; with ``source``, the model's parameters are on
    the meta device and ``source.fill(engine)`` writes every fp32 master (``megatrain.from_pretrained`` /
    ``megatrain.from_config``)."""
    install_accelerate_clip()  # accelerate's own clip_grad_norm_ no longer reaches torch's (see there)
    if not isinstance(model, nn.Module):
        raise TypeError(f"megatrain.wrap: model must be a torch.nn.Module (e.g. a transformers causal LM), got "
                        f"{type(model).__name__}; to load a checkpoint by name use megatrain.from_pretrained(path)")
    if getattr(model, "megatrain", None) is not None:
        raise ValueError("megatrain.wrap: this model is already wrapped; use it as it is (its options: "
                         "model.megatrain.placement()), or build the model again to wrap it with other options")
    opts = options.resolve()  # every option checked (one line each), the machine's defaults filled in
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise ValueError("megatrain.wrap: the model has gradient checkpointing on; call "
                         "model.gradient_checkpointing_disable() before wrap (megatrain recomputes layers itself: "
                         "choose with activation_policy='recompute' | 'store' | 'auto' | 'block:K')")
    layers_name, layers, units = _check_model(model, source, opts.device_state_layers)
    cfg = getattr(model, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None)
    if opts.seq_len and isinstance(limit, int) and opts.seq_len > limit:  # (megatrain train refuses it)
        warnings.warn(f"megatrain.wrap: seq_len={opts.seq_len} is above the model's max_position_embeddings ({limit}): "
                      "the activation reserve is planned for it; check the sequence length you train with",
                      stacklevel=2)
    long_context.check(model, layers, opts.chunked_loss, opts.tile_mlp)
    check_wrap_gpu_memory_limit(units, opts, options.gpu_memory_limit)  # a cap below the streamed schedule's need
    del units  # their entries hold the parameters: the engine's fill frees each layer's weights as it copies them
    # Liger's kernels bound on the modules before the engine swaps their classes (megatrain.runtime.model.fused_kernels)
    liger = apply_liger_kernel(model, layers, required=options.liger_kernel is True) if opts.liger_kernel else None
    # A KV cache updated inside a recomputed layer would be updated twice. A multimodal wrapper's text
    # model reads its own text_config.use_cache: every nested config's flag goes off; the user's values
    # are what save_pretrained / export_pretrained write.
    user_cache_flags = cache_flags(cfg)
    set_cache_flags(cfg, False)
    # A wrapped model that was dropped (a notebook cell run again) sits in reference cycles until the
    # cyclic collector runs: collect it now so that its host store is freed before this one is allocated.
    gc.collect()
    install_torch_patches()  # the first wrap: torch's clip_grad_norm_, autograd.grad, ... rerouted (see there)
    engine = WrappedEngine(model, layers_name, layers, opts.device, opts.compute_dtype, opts.activation_policy,
                           opts.num_slots, grad_accumulator=opts.grad_accumulator, source=source,
                           device_state_layers=opts.device_state_layers, offload_dir=opts.offload_dir,
                           host_memory_limit=opts.host_memory_limit, gpu_memory_limit=opts.gpu_memory_limit,
                           batch=opts, host_compute_copy=opts.host_compute_copy)
    engine.liger_kernel = liger
    if opts.host_compute_copy is False and not any(u.master_streamed for u in engine.units):
        warnings.warn("megatrain.wrap: host_compute_copy=False streams no layer from its master: every decoder layer "
                      "has a frozen parameter (e.g. a LoRA base), or data parallel is on; the compute copies stay in "
                      "host memory", stacklevel=3)
    object.__setattr__(model, "megatrain", engine)
    engine.user_cache_flags = user_cache_flags
    engine.long_context = long_context.install(model, engine, opts.chunked_loss, opts.tile_mlp, opts.lean_activations)
    engine.policy.attention_reuse = AttentionReuse(engine) if opts.reuse_attention else None
    engine.module_api = ModuleApi(engine, model)  # state_dict / load_state_dict / save_pretrained over the fp32 masters
    return model


def _check_model(model: nn.Module, source, device_state_layers):
    """``wrap``'s checks of the model itself, before anything is changed: real weights (unless ``source``
    fills them), a decoder layer list without weights shared with other modules and without hooks,
    ``device_state_layers`` within its length, no MoE router logits asked. Returns ``(layers_name, layers, units)``
    (``units``: :func:`model_units`, for planning only: the engine builds its own).

    Raises:
        ValueError: a parameter on the meta device, a hooked or parametrized layer, too many ``device_state_layers``.
        UnsupportedModelError: no decoder layer list, weights shared with a layer, ``output_router_logits=True``.
    """
    for name, p in model.named_parameters():
        if p.device.type == "meta" and source is None:
            raise ValueError(f"megatrain.wrap: parameter {name} is on the meta device; load real weights first")
    layers_name, layers = find_decoder_layers(model)
    units = model_units(model, layers_name, layers)  # refuses weights shared with a layer before anything is changed
    check_layers_unhooked(layers_name, layers)
    if isinstance(device_state_layers, int) and device_state_layers > len(layers):
        raise ValueError(f"megatrain.wrap: device_state_layers={device_state_layers}, but the model has {len(layers)} "
                         f"decoder layers; use at most {len(layers)} (or 'auto')")
    if router_logits_asked(getattr(model, "config", None)):
        # The router logits would be captured from the streamed layers' graph-free forward, so
        # the auxiliary load-balancing loss would silently get no gradient.
        raise UnsupportedModelError(
            f"megatrain.wrap: {type(model).__name__} has config.output_router_logits=True; the MoE auxiliary "
            "loss is not supported through streamed layers yet. Set model.config.output_router_logits = False")
    return layers_name, layers, units
