"""Hugging Face ``Trainer`` integration: train a ``megatrain.wrap``-ped model with an existing Trainer script.

Two changed lines in a Trainer script::

    model = megatrain.wrap(model)                                   # 1
    trainer = MegatrainTrainer(model=model, args=args, ...)         # 2: was Trainer(...)

``MegatrainTrainer`` is a ``transformers.Trainer`` that

* creates ``megatrain.optim.CPUAdamW`` from the TrainingArguments (learning_rate, adam_beta1/2,
  adam_epsilon, weight_decay with the Trainer's own decay / no-decay split, max_grad_norm), driven
  by the Trainer's LR scheduler;
* clips inside CPUAdamW (exact global-norm clipping, like ``clip_grad_norm_``) and skips the
  Trainer's own clipping, which would only see meta placeholders; logs the pre-clip ``grad_norm``;
* never moves the model or the optimizer state to the device (megatrain streams; the optimizer
  state stays in the host store);
* ``save_model()`` writes a standard Hugging Face model (config + ``model.safetensors``, fp32
  master weights, streamed from host memory);
* Trainer checkpoints (``checkpoint-N/``) contain a megatrain checkpoint in ``checkpoint-N/megatrain``
  (fp32 master weights, Adam moments and steps, param groups, scheduler) instead of ``optimizer.pt``,
  and ``train(resume_from_checkpoint=...)`` restores it exactly;
* adds megatrain's figures (tokens/s, H2D GB/s, host RSS, ...) to every log record (:class:`MegatrainCallback`);
* under torchrun (the model wrapped after the process group exists) trains as megatrain data
  parallel: the Trainer's sharded data loader, no ``DistributedDataParallel`` around the model,
  ``save_model()`` and checkpoints written once while the other ranks wait (docs/hf_trainer.md).

A plain ``Trainer`` also trains, saves and resumes a wrapped model, given
``optimizers=(CPUAdamW(..., max_grad_norm=args.max_grad_norm) or create_optimizer(model, args), scheduler)``,
``callbacks=[MegatrainCallback()]`` and, on CUDA, ``trainer.accelerator.device_placement = False``:
its checkpoints are then the ordinary ones (``model.safetensors`` from the fp32 masters through the
wrapped model's ``save_pretrained``, ``optimizer.pt`` from ``CPUAdamW.state_dict()``); see docs/hf_trainer.md.
"""

from __future__ import annotations

import math
import os
import threading
import time
from typing import Optional

import torch
from transformers import Trainer, TrainerCallback

from ..state.checkpoint import load_checkpoint, save_checkpoint
from ..state.export import save_pretrained_streamed
from ..optim import CPUAdamW
from ..runtime.compat.clip_grad import nan_norm_expected

MEGATRAIN_CKPT_DIR = "megatrain"


def _engine(model):
    if getattr(model, "megatrain", None) is None:
        raise ValueError("megatrain: the Trainer's model is not wrapped; call model = megatrain.wrap(model) first")
    return model.megatrain


def _unwrap_optimizer(opt):
    while opt is not None and not isinstance(opt, CPUAdamW) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return opt


def _device_placed(opt) -> bool:
    """True when an accelerate wrapper in ``opt``'s chain moved the optimizer state to the device."""
    while opt is not None and not isinstance(opt, CPUAdamW):
        if getattr(opt, "device_placement", False):
            return True
        opt = getattr(opt, "optimizer", None)
    return False


_building = threading.local()  # set while MegatrainTrainer.__init__ runs the Trainer's (its callbacks' on_init_end)


def _check_data_parallel(engine, args) -> None:
    """Under torchrun the model must be megatrain data parallel over the Trainer's processes.

    Raises:
        ValueError: the Trainer runs several processes but the model was wrapped outside their
            process group (each rank would train its own copy on its share of the data).
    """
    world = int(getattr(args, "world_size", 1) or 1)
    dp = getattr(engine, "dp", None)
    if world > 1 and (dp is None or dp.world != world):
        raise ValueError(f"megatrain: the Trainer runs {world} processes but the model was wrapped outside their "
                         "process group (each would train its own copy): initialise torch.distributed first "
                         "(TrainingArguments(...).device does, or torch.distributed.init_process_group), then "
                         "megatrain.wrap (docs/data_parallel.md)")


def create_optimizer(model, args, max_grad_norm: Optional[float] = None) -> CPUAdamW:
    """``CPUAdamW`` configured like the Trainer's default AdamW from ``TrainingArguments``.

    Groups: the Trainer's decay parameters (``Trainer.get_decay_parameter_names``: not biases,
    not norm weights) with ``args.weight_decay``, the rest with 0. ``max_grad_norm`` defaults to
    ``args.max_grad_norm`` (0 / None: no clipping).
    """
    _engine(model)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [g for g in ({"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                          {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}) if g["params"]]
    mgn = args.max_grad_norm if max_grad_norm is None else max_grad_norm
    # gradient_accumulation_steps: without clipping, a layer's update starts during the last micro-batch's backward.
    return CPUAdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                    weight_decay=args.weight_decay, max_grad_norm=mgn if mgn and mgn > 0 else None,
                    gradient_accumulation_steps=int(args.gradient_accumulation_steps))


class MegatrainCallback(TrainerCallback):
    """Adds megatrain's figures to the Trainer's log records and checks the set-up at train start.

    ``MegatrainTrainer`` adds it itself. With a plain ``Trainer`` pass it in ``callbacks`` with
    ``optimizers=(create_optimizer(model, args), None)`` (or your own ``CPUAdamW``, with
    ``max_grad_norm`` set when the TrainingArguments' is > 0: the Trainer's clip is then exact); on
    CUDA also set ``trainer.accelerator.device_placement = False`` before ``train()``. It checks
    both at train start.

    Keys added to each log record (window = since the previous log record):
    ``megatrain/tokens_per_s`` (training input tokens / wall second), ``megatrain/h2d_gbps``
    (achieved host-to-device rate while copying; CUDA only), ``megatrain/h2d_gb``, ``megatrain/d2h_gb``,
    ``megatrain/adam_exposed_s`` (CPU Adam time the forward waited for), ``megatrain/host_rss_gib``,
    ``megatrain/host_store_gib``, and ``grad_norm``: CPUAdamW's pre-clip global norm (with clipping),
    replacing any figure the Trainer computed without clipping (dropped where CPUAdamW computes
    none); a plain Trainer's own clipping figure is kept (it is exact).
    """

    def __init__(self):
        self._window = None
        self._tokens = 0
        self._t0 = None
        self._hook = None
        self._engine = None
        self._optimizer = None

    # -- helpers
    def _count_tokens(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            x = kwargs.get("input_ids")
            if x is None and args:
                x = args[0]
            if x is None:
                x = kwargs.get("inputs_embeds")
                if x is not None:
                    self._tokens += x.shape[0] * x.shape[1]
                    return
            if isinstance(x, torch.Tensor):
                self._tokens += x.numel()

    def metrics(self) -> dict:
        """Metrics for the window since the previous call (empty before training starts)."""
        if self._engine is None:
            return {}
        now = time.perf_counter()
        wall = max(now - self._t0, 1e-9)
        out = {"megatrain/tokens_per_s": self._tokens / wall}
        try:
            from ..train.metrics import host_rss_bytes

            w = self._window.step(wall) if self._window is not None else {}
            rss = host_rss_bytes()
        except Exception:  # noqa: BLE001 - metrics never stop training
            w, rss = {}, None
        for src, dst, scale in (("h2d_gbps", "megatrain/h2d_gbps", 1), ("h2d_gbps_wall", "megatrain/h2d_gbps_wall", 1),
                                ("h2d_gb", "megatrain/h2d_gb", 1), ("d2h_gb", "megatrain/d2h_gb", 1),
                                ("adam_exposed_s", "megatrain/adam_exposed_s", 1),
                                ("host_store_bytes", "megatrain/host_store_gib", 1 / 2**30)):
            if w.get(src) is not None:
                out[dst] = w[src] * scale
        if rss is not None:
            out["megatrain/host_rss_gib"] = rss / 2**30
        self._tokens = 0
        self._t0 = now
        return out

    def add_metrics(self, logs: dict) -> None:
        """Add megatrain's keys (and ``grad_norm``) to a training log record in place."""
        if self._engine is None or "loss" not in logs or "megatrain/tokens_per_s" in logs:
            return
        logs.update(self.metrics())
        opt = self._optimizer
        # A Trainer's own grad_norm (recent transformers compute one even with max_grad_norm=0) only
        # saw the meta placeholders of streamed layers: replace it with CPUAdamW's pre-clip global
        # norm, or drop it where CPUAdamW computes none (no clipping: eager per-layer updates).
        if not getattr(self, "_trainer_clips", False):  # else the Trainer's own clip_grad_norm_ figure is exact
            logs.pop("grad_norm", None)
            if opt is not None and opt.last_grad_norm is not None:
                logs["grad_norm"] = float(opt.last_grad_norm)

    # -- TrainerCallback
    def on_init_end(self, args, state, control, **kwargs):
        if int(getattr(args, "world_size", 1) or 1) > 1 and not getattr(_building, "megatrain_trainer", False):
            raise ValueError("megatrain: under torchrun use megatrain.integrations.MegatrainTrainer: a plain Trainer "
                             "wraps the model in DistributedDataParallel, which megatrain's data parallel replaces "
                             "(docs/data_parallel.md)")

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._engine = _engine(model)
        _check_data_parallel(self._engine, args)
        self._optimizer = _unwrap_optimizer(optimizer)
        if not isinstance(self._optimizer, CPUAdamW):
            raise TypeError("megatrain: the Trainer's optimizer is not megatrain.optim.CPUAdamW; use "
                            "megatrain.integrations.MegatrainTrainer, or pass optimizers=(create_optimizer(model, "
                            "args), None) to the Trainer")
        if getattr(args, "bf16", False) or getattr(args, "fp16", False):
            raise ValueError("megatrain: set bf16=False and fp16=False in TrainingArguments: the compute precision is "
                             "megatrain.wrap(model, compute_dtype=...)'s (bf16 on CUDA by default, fp32 master weights "
                             "in host memory); the Trainer's autocast would recast what megatrain already runs in "
                             "compute_dtype")
        plain = not getattr(self, "_clip_handled", False)  # a plain transformers.Trainer, not MegatrainTrainer
        # A plain Trainer clips with torch.nn.utils.clip_grad_norm_, which is exact on a wrapped model
        # once CPUAdamW defers its updates to step() (max_grad_norm set); its grad_norm is then the true one.
        self._trainer_clips = bool(plain and args.max_grad_norm and args.max_grad_norm > 0)
        if not self._trainer_clips:  # the Trainer's clip_grad_norm_(inf) log figure: dropped by add_metrics, no warning
            nan_norm_expected(self._engine)
        if self._trainer_clips and self._optimizer.max_grad_norm is None:
            raise ValueError("megatrain: the Trainer clips (max_grad_norm > 0 in TrainingArguments) but CPUAdamW has no "
                             "max_grad_norm, so its updates start during backward, before the Trainer's clip: create it "
                             "with CPUAdamW(..., max_grad_norm=args.max_grad_norm) (create_optimizer(model, args) does), "
                             "or set max_grad_norm=0 in TrainingArguments")
        want = float(args.max_grad_norm) if args.max_grad_norm and args.max_grad_norm > 0 else None
        have = self._optimizer.max_grad_norm
        # CPUAdamW's clip is what clips: MegatrainTrainer has no clip of its own, and a plain Trainer's
        # clip_grad_norm_ coefficient is applied beside it (only max_grad_norm=inf leaves it alone). With
        # max_grad_norm=0 in TrainingArguments the optimizer's own value (if any) is the user's choice.
        same = want is None or (have is not None and (math.isclose(have, want, rel_tol=1e-12)
                                                      or (plain and math.isinf(have))))
        if not same:
            raise ValueError(f"megatrain: TrainingArguments(max_grad_norm={args.max_grad_norm}) but CPUAdamW has "
                             f"max_grad_norm={have}: CPUAdamW's value is the one that would clip. Create it with "
                             "CPUAdamW(..., max_grad_norm=args.max_grad_norm) (create_optimizer(model, args) does), or "
                             "set the same value in TrainingArguments")
        ga = int(args.gradient_accumulation_steps)
        if self._optimizer.max_grad_norm is None and self._optimizer.gradient_accumulation_steps < ga:
            # Without clipping a layer's update starts during the backward of the optimizer's last
            # micro-batch: with fewer declared than the Trainer runs, the first one would update the weights.
            raise ValueError(f"megatrain: the Trainer accumulates gradient_accumulation_steps={ga} micro-batches but "
                             f"CPUAdamW has gradient_accumulation_steps={self._optimizer.gradient_accumulation_steps} "
                             f"(and no max_grad_norm), so its updates would start before the last micro-batch: create "
                             f"it with CPUAdamW(..., gradient_accumulation_steps=args.gradient_accumulation_steps) "
                             f"(create_optimizer(model, args) does)")
        if getattr(self._engine, "device", torch.device("cpu")).type != "cpu" and _device_placed(optimizer):
            # accelerate's AcceleratedOptimizer(device_placement=True) has copied the optimizer's
            # state_dict (every Adam moment: 8 bytes/parameter of GPU memory) to the GPU and loaded it
            # back, which leaves CPUAdamW's per-parameter step counters as CUDA tensors.
            raise ValueError("megatrain: with a plain Trainer on CUDA set trainer.accelerator.device_placement = False "
                             "before train(): accelerate copies the optimizer state (all Adam moments) to the GPU "
                             "otherwise. MegatrainTrainer does this for you.")
        try:
            from ..train.metrics import StatsWindow

            self._window = StatsWindow(self._engine)
        except Exception:  # noqa: BLE001
            self._window = None
        if self._hook is None:
            self._hook = model.register_forward_pre_hook(self._count_tokens, with_kwargs=True)
        self._tokens = 0
        self._t0 = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        before = dict(logs)
        self.add_metrics(logs)
        if logs != before and state.log_history and state.log_history[-1].get("step") == state.global_step:
            record = state.log_history[-1]  # the Trainer's copy of ``logs``
            for k in before.keys() - logs.keys():
                record.pop(k, None)
            record.update({k: v for k, v in logs.items() if k not in before or before[k] is not v})

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._engine is not None:
            self._engine.flush()


# TrainingArguments.optim values whose update CPUAdamW computes exactly (torch.optim.AdamW's).
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")


class MegatrainTrainer(Trainer):
    """A ``transformers.Trainer`` for models wrapped by ``megatrain.wrap`` (see the module docstring).

    Takes exactly the Trainer's arguments. Pass ``optimizers=(CPUAdamW, scheduler)`` to use your own optimizer;
    otherwise ``CPUAdamW`` is built from the TrainingArguments. The model is wrapped before, so the batch cannot
    reach ``wrap`` from here: pass ``wrap(model, micro_batch_size=args.per_device_train_batch_size, seq_len=...)``
    yourself, ``seq_len`` only when known (docs/hf_trainer.md); without both ``wrap`` reserves 20% of the free GPU.
    """

    def __init__(self, *args, **kwargs):
        _building.megatrain_trainer = True
        try:
            super().__init__(*args, **kwargs)
        finally:
            _building.megatrain_trainer = False
        eng = _engine(self.model)
        _check_data_parallel(eng, self.args)
        self.megatrain_callback = next((cb for cb in self.callback_handler.callbacks
                                        if isinstance(cb, MegatrainCallback)), None)
        if self.megatrain_callback is None:
            self.megatrain_callback = MegatrainCallback()
            self.add_callback(self.megatrain_callback)
        self.megatrain_callback._clip_handled = True
        # Accelerate would copy the optimizer state (views of the host store) and the model to the
        # device; megatrain keeps both in host memory and streams. Inputs are still moved by the
        # Trainer's _prepare_inputs.
        self.accelerator.device_placement = False
        if getattr(eng, "dp", None) is not None:
            # Data parallel: megatrain reduce-scatters the gradients itself; the model is prepared as
            # for evaluation (no DistributedDataParallel around it). The data loaders are still sharded.
            prepare, model = self.accelerator.prepare_model, self.model

            def prepare_model(m, device_placement=None, evaluation_mode=False):
                if m is model:
                    return prepare(m, device_placement=False, evaluation_mode=True)
                return prepare(m, device_placement=device_placement, evaluation_mode=evaluation_mode)

            self.accelerator.prepare_model = prepare_model

    # -- optimizer / clipping
    def create_optimizer(self, model=None):
        if self.optimizer is None:
            optim = getattr(self.args.optim, "value", self.args.optim)
            if optim not in _ADAMW_OPTIMS:
                raise ValueError(f"megatrain: MegatrainTrainer trains with megatrain.optim.CPUAdamW (torch's AdamW update); "
                                 f"TrainingArguments(optim={optim!r}) is not available: leave optim at its default "
                                 f"(or 'adamw_torch'), or pass optimizers=(megatrain.optim.CPUAdamW(...), scheduler)")
            self.optimizer = create_optimizer(self.model if model is None else model, self.args)
        elif not isinstance(_unwrap_optimizer(self.optimizer), CPUAdamW):
            raise TypeError("megatrain: MegatrainTrainer needs a megatrain.optim.CPUAdamW optimizer")
        return self.optimizer

    def _clip_grad_norm(self, model):
        return None  # CPUAdamW clips the global norm exactly, inside its update (max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return None  # known only after CPUAdamW.step(); MegatrainCallback logs it

    def _move_model_to_device(self, model, device):
        return None  # the wrapped model already lives where megatrain put it

    def log(self, logs, *args, **kwargs):
        opt = _unwrap_optimizer(self.optimizer)
        if "loss" in logs and isinstance(opt, CPUAdamW) and opt.last_grad_norm is not None:
            logs["grad_norm"] = float(opt.last_grad_norm)  # the Trainer's own figure saw no gradients
        self.megatrain_callback.add_metrics(logs)
        return super().log(logs, *args, **kwargs)

    # -- saving
    def _save(self, output_dir: Optional[str] = None, state_dict=None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        dp = getattr(_engine(self.model), "dp", None)
        if dp is not None:  # every rank: the writer (should_save) writes while the others wait, errors on all
            with dp.collective("MegatrainTrainer.save_model", os.path.abspath(output_dir)):
                on = dp.on_local0 if self.args.save_on_each_node else dp.on_rank0
                on(lambda: self._write_model(output_dir), "MegatrainTrainer.save_model")
            return
        if self.args.should_save:
            self._write_model(output_dir)

    def _write_model(self, output_dir: str) -> None:
        from ..state.export import _export_peft, _is_peft

        if _is_peft(self.model):  # as a plain Trainer saves a PEFT model: the adapter, in PEFT's format
            os.makedirs(output_dir, exist_ok=True)
            _export_peft(self.model, output_dir, torch.float32, merge_adapter=False)
        else:
            save_pretrained_streamed(self.model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.args.should_save and getattr(_engine(self.model), "dp", None) is None:
            return  # data parallel: save_checkpoint is called on every rank (rank 0 writes)
        save_checkpoint(os.path.join(output_dir, MEGATRAIN_CKPT_DIR), self.model, _unwrap_optimizer(self.optimizer),
                        self.lr_scheduler, extra={"global_step": self.state.global_step})

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        load_checkpoint(os.path.join(best, MEGATRAIN_CKPT_DIR), self.model, None, restore_rng=False)

    # -- resuming
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        path = os.path.join(resume_from_checkpoint, MEGATRAIN_CKPT_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"megatrain: {resume_from_checkpoint} has no {MEGATRAIN_CKPT_DIR}/ checkpoint (was it "
                             "written by MegatrainTrainer?)")
        # Weights, moments, steps and scheduler are restored together in _load_optimizer_and_scheduler,
        # once the optimizer exists (one read of the checkpoint).

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        load_checkpoint(os.path.join(checkpoint, MEGATRAIN_CKPT_DIR), self.model, _unwrap_optimizer(self.optimizer),
                        self.lr_scheduler, restore_rng=False)  # the Trainer restores its own rng_state.pth
