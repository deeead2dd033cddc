"""bench_train system ``slideformer``: SlideFormer (github.com/RegiaYoung/SlideFormer, DAC 2026).

Driven through its own API, as its benchmark ``scripts/main_bench.py`` does: ``SlideFormerOffloader(
model, device, dtype=bfloat16, optimizer_kwargs=...)``, then one call ``model(input_ids=...,
attention_mask=..., labels=...)`` per step, which runs forward, ``loss.backward()`` and every layer's
optimizer update and drains them (``wait_for_completion``) before it returns
(offload_transformer.py, ``SlideFormerOffloader.forward``, ``auto_backward_in_forward=True``).

No git snapshot of SlideFormer could be taken for this work; it was read from a public code index
(offload_transformer.py, transformer_layer.py and utils/model_compat.py at commit 69350a4,
optimizer/layer_adam/layer_adam.py at eeab7d0, scripts/main_bench.py at 062322f). Citations quote
the code, by file and function, instead of line numbers.

What it keeps, read from its code:

* precision: **fp32 master weights** -- each streamed unit copies its parameters into
  ``_cpu_params_flat = torch.empty(total_size, dtype=torch.float32)`` (transformer_layer.py,
  ``OffloadLayerWrapper.__init__``) and converts them to bf16 per H2D chunk (``to_device_async``);
  gradients come back in bf16 (``cpu_grad_tensor``, ``dtype=self.dtype``, offload_transformer.py
  ``SlideFormerOffloader.__init__``); Adam state fp32 (``"fp32_optimizer_state": True``,
  scripts/main_bench.py; ``LayerAdam.add_layer_params``). Its README: "BF16 compute, FP32 master
  parameters, and FP32 optimizer states".
* clipping: **none** -- each layer is updated by ``LayerAdam.step_chunk`` as soon as its gradient has
  landed, inside backward (``get_post_backward`` hook -> ``update_params`` -> ``_do_chunked_update``), so no
  global gradient norm exists before the first update; LayerAdam has no clipping or ``max_grad_norm``.
  A row with ``max_grad_norm`` set runs unclipped and says so (``clips: false``).
* gradient accumulation: none (the update happens inside backward): a spec with ``grad_accum > 1`` is
  skipped.

Settings as main_bench.py's defaults except where bench_train fixes them for every system: lr, betas,
eps, weight decay (LayerAdam takes ``betas``; main_bench leaves its default (0.9, 0.999)); SDPA
attention (main_bench offers ``flash_attention_2`` or ``sdpa``; flash-attn is not installed on the GPU
machine); no NVMe offload. Liger kernels (main_bench's default ``--use_liger``) are applied to the
model instance when ``liger_kernel`` is importable, as main_bench falls back without them; the row says
which. The model is bench_train's seeded fp32 Llama (SlideFormer copies it into its fp32 master store);
``attention_mask`` is None (all-ones: no padding, causal SDPA). Its CPU Adam extension is JIT-built with
g++ on first use (optimizer/layer_adam/builder.py, ``CPUAdamLoader.load``, cached under
``~/.cache/oom_optimizer``).
"""
from __future__ import annotations

import os
import sys
import tempfile

NAME = "slideformer"


def unsupported(spec: dict) -> str | None:
    """Why ``spec`` cannot run on this peer, or None."""
    if spec.get("grad_accum", 1) > 1:
        return (f"{NAME} updates each layer inside backward and has no gradient accumulation "
                f"(grad_accum={spec['grad_accum']})")
    if not str(spec.get("device", "cuda")).startswith("cuda"):
        return f"{NAME} needs CUDA (it creates CUDA streams when imported)"
    return None


def _apply_liger(model) -> str:
    """Liger's kernels on ``model`` in place when liger_kernel is importable; returns what was done."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except Exception as e:  # noqa: BLE001 - main_bench.py falls back to plain HF when liger is missing
        return f"off ({type(e).__name__})"
    try:
        _apply_liger_kernel_to_instance(model=model)
        return "on (_apply_liger_kernel_to_instance)"
    except Exception as e:  # noqa: BLE001 - a liger / transformers mismatch must not lose the row
        return f"off (apply failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def _liger_version() -> str | None:
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
        return version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed: the row says so
        return None


def mask_shim() -> str:
    """Let SlideFormer's mask call run on a transformers whose ``create_causal_mask`` has no
    ``cache_position`` (removed in transformers 5.x; utils/model_compat.py, ``build_decoder_attention_mask``,
    passes it, as None or as the positions of a step without a KV cache). Installs, on
    ``transformers.masking_utils`` of this process only, a wrapper that drops ``cache_position`` and
    passes ``past_key_values`` as the ``cache`` argument where that is required; the mask it builds is
    transformers' own. Returns what was done (recorded in the row's settings)."""
    import inspect

    from transformers import masking_utils
    orig = masking_utils.create_causal_mask
    params = inspect.signature(orig).parameters
    if "cache_position" in params or getattr(orig, "_peer_shim", False):
        return "none needed"

    def create_causal_mask(*args, cache_position=None, **kwargs):  # noqa: ARG001 - the dropped argument
        if "cache" in params and "cache" not in kwargs and len(args) < list(params).index("cache") + 1:
            kwargs["cache"] = kwargs.pop("past_key_values", None)
        return orig(*args, **kwargs)

    create_causal_mask._peer_shim = True
    masking_utils.create_causal_mask = create_causal_mask
    return "create_causal_mask called without cache_position (transformers has none)"


def run(spec: dict, bench, src: str) -> dict:
    """One bench_train child: build, train ``warmup + steps`` steps, return the partial row."""
    import torch
    # SlideFormer's fused linear cross-entropy calls liger-kernel's kernel with the 0.6-0.7 arguments
    # (utils/legacy_fused_linear_cross_entropy.py; 0.8 added required ones): SLIDEFORMER_SITE, a folder
    # holding such a liger-kernel (run_h200.sh installs one there), comes first on this child's path
    site = os.environ.get("SLIDEFORMER_SITE")
    if site and os.path.isdir(site) and site not in sys.path:
        sys.path.insert(0, site)
    if src not in sys.path:
        sys.path.insert(0, src)
    from offload_transformer import SlideFormerOffloader
    shim = mask_shim()

    opt_cfg = bench.OPT
    model = bench.build_model(spec["model"], spec["seq"], spec["device"])
    n_params = sum(p.numel() for p in model.parameters())
    liger = _apply_liger(model) if os.environ.get("SLIDEFORMER_LIGER", "auto") != "0" else "off (SLIDEFORMER_LIGER=0)"
    offload_dir = tempfile.mkdtemp(prefix="slideformer_")
    optimizer_kwargs = dict(lr=opt_cfg["lr"], betas=tuple(opt_cfg["betas"]), bias_correction=True,
                            weight_decay=opt_cfg["weight_decay"], eps=opt_cfg["eps"], adamw_mode=True,
                            fp32_optimizer_state=True, num_layer=len(model.get_decoder().layers) + 2,
                            nvme_offload_fraction=0.0, offload_dir=offload_dir, prefetch=True)
    device = torch.device("cuda", torch.cuda.current_device())
    sf = SlideFormerOffloader(model=model, device=device, dtype=torch.bfloat16, ac_offload_nvme=False,
                              offload_dir=offload_dir, enable_timing=False, enable_memory_stats=False,
                              optimizer_kwargs=optimizer_kwargs)
    sf.train()
    batches = bench.make_batches(spec, device)

    def step(xs):
        (x,) = xs  # grad_accum 1 (unsupported() skips the rest)
        out = sf(input_ids=x, attention_mask=None, labels=x)  # forward + backward + every layer's update
        return out.loss.detach()

    r = bench.timed_loop(step, batches, spec, torch.cuda.synchronize, drain=sf.wait_for_completion)
    clip, ga = bench.clip_and_accum(spec)
    r.update(
        n_params=n_params, precision="fp32", clips=False,
        clip_support="no: layers are updated inside backward (offload_transformer.py get_post_backward -> "
                     "transformer_layer.py _do_chunked_update); LayerAdam has no max_grad_norm",
        settings=dict(peer=NAME, api="offload_transformer.SlideFormerOffloader(...)(input_ids, labels): forward, "
                                     "backward and per-layer LayerAdam updates in one call (scripts/main_bench.py)",
                      master_weights="fp32 on CPU (transformer_layer.py OffloadLayerWrapper._cpu_params_flat)",
                      gradients="bf16 (offload_transformer.py cpu_grad_tensor)", adam_state="fp32",
                      optimizer="LayerAdam (SlideFormer's CPU Adam, adamw_mode=True)", **opt_cfg,
                      max_grad_norm=clip, clipping="not supported: runs unclipped" if clip else "off",
                      grad_accum=ga, liger=liger, liger_version=_liger_version(), attention="sdpa, attention_mask=None (no padding)",
                      activations="SlidingCheckpoint: layer inputs offloaded to pinned CPU memory",
                      nvme_offload="off", mask_shim=shim, model="bench_train seeded fp32 Llama (SlideFormer copies it into fp32 master)"))
    return r
