"""``WrapOptions``: ``megatrain.wrap``'s placement and memory options in one frozen value, checked once.

``wrap(model, **kwargs)``, ``from_pretrained`` / ``from_config``, ``estimate`` and ``megatrain train``
all take these options by keyword; each builds one :class:`WrapOptions` from its keywords and
hands it on, so the names, the defaults and the checks live here alone. :meth:`WrapOptions.check`
refuses a bad value with the one-line message ``wrap`` gives; :meth:`WrapOptions.resolve` fills
the defaults that depend on the machine (device, compute dtype, activation policy, device-state
layers, GPU memory cap, Liger-Kernel) as ``wrap`` does before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Any, Iterable, Optional, Tuple, Union

import torch

from .activations.activation_policy import ActivationPolicy
from .activations.long_context_ops import _check_mode
from .model.fused_kernels import check_liger_kernel, resolve_liger_kernel
from .placement.device_state_plan import check_device_state_layers, check_gpu_memory_limit, \
    resolve_device_state_layers, resolve_gpu_memory_limit
from .placement.disk_plan import check_host_memory_limit, check_offload_args, check_offload_dir_value
from .placement.master_streamed import check_host_compute_copy

# The options ``megatrain.estimate`` takes (the others change no byte it counts).
ESTIMATE_OPTIONS = ("device", "compute_dtype", "activation_policy", "num_slots", "grad_accumulator", "chunked_loss",
                    "tile_mlp", "device_state_layers", "offload_dir", "host_memory_limit", "gpu_memory_limit",
                    "host_compute_copy")
# The batch (wrap's micro_batch_size / seq_len): megatrain.estimate takes them too, as the batch it estimates for.
BATCH_OPTIONS = ("micro_batch_size", "seq_len")


@dataclass(frozen=True)
class WrapOptions:
    """Where ``megatrain.wrap`` puts a model's state and how it runs it; the defaults are ``wrap``'s.

    Each field is the ``wrap`` keyword of the same name; see :func:`megatrain.wrap` for what it does.
    Construction checks each value (type and range: the one-line messages ``wrap`` gives, starting with
    ``where``); :meth:`check` adds the filesystem check of ``offload_dir`` (``wrap`` and the others call it).
    The values left for :meth:`resolve` (``None``, ``"auto"``) are valid here.

    Attributes:
        device: ``None`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        compute_dtype: ``None`` (bf16 on CUDA, fp32 on CPU), ``torch.bfloat16`` or ``torch.float32``.
        activation_policy: ``None`` (``"auto"`` on CUDA, ``"recompute"`` on CPU), ``"recompute"``, ``"store"``,
            ``"auto"``, ``"offload"``, ``"block:K"`` or an :class:`ActivationPolicy`.
        num_slots: device slots per layer shape (int >= 1).
        grad_accumulator: ``None`` (allocated at the first accumulation), ``True`` or ``False``.
        chunked_loss, tile_mlp: ``"auto"``, ``True``, ``False`` or rows per chunk / tile.
        device_state_layers: ``None`` (the planner's default), an int >= 0, ``"auto"`` or ``"boundary"``.
        offload_dir: a directory on a local disk for the fp32 state that does not fit in host memory, or None.
        host_memory_limit: bytes of host memory megatrain may use: an int > 0 or a string such as ``"100GiB"`` /
            ``"1.5TB"`` (:func:`~megatrain.byte_units.parse_bytes`; held as the int), or None.
        reuse_attention: ``block:K`` keeps the attention outputs of the block re-run (bool).
        lean_activations: the lean RMSNorm / gated-MLP graphs (bool).
        gpu_memory_limit: None, bytes (int >= 1 MiB, or a string such as ``"40GiB"``) or a fraction of the
            device's memory (float in (0, 1]).
        liger_kernel: ``None`` (when installed and on CUDA), ``True`` (required) or ``False``.
        micro_batch_size, seq_len: the batch trained on (sequences per micro-batch, tokens per sequence; ints >= 1,
            or None): with both, the capacity share of exclusive device-state layers keeps this batch's activation
            estimate (``megatrain.estimate``'s) instead of a share of the free device memory. Both or neither: one
            alone is refused (it would not count).
        host_compute_copy: ``"auto"``, ``True`` or ``False`` (:mod:`~.placement.master_streamed`).

    Args:
        where: starts each error message of the construction (not a field): ``"megatrain.WrapOptions"``;
            ``wrap`` passes ``"megatrain.wrap"``, ``estimate`` ``"megatrain.estimate"``.

    Raises:
        ValueError: a bad value, one line naming the option, the rule and the value (as :meth:`check`);
            ``micro_batch_size`` without ``seq_len`` or the reverse.
    """

    device: Optional[Union[torch.device, str]] = None
    compute_dtype: Optional[torch.dtype] = None
    activation_policy: Optional[Union[str, ActivationPolicy]] = None
    num_slots: int = 2
    grad_accumulator: Optional[bool] = None
    chunked_loss: Any = "auto"
    tile_mlp: Any = "auto"
    device_state_layers: Optional[Union[int, str]] = None
    offload_dir: Optional[str] = None
    host_memory_limit: Optional[Union[int, str]] = None
    reuse_attention: bool = True
    lean_activations: bool = False
    gpu_memory_limit: Optional[Union[int, float, str]] = None
    liger_kernel: Optional[bool] = None
    micro_batch_size: Optional[int] = None
    seq_len: Optional[int] = None
    host_compute_copy: Any = "auto"
    where: InitVar[str] = "megatrain.WrapOptions"

    def __post_init__(self, where: str):
        self._check_values(where)

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The option names, in ``wrap``'s keyword order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def split(cls, kwargs: dict, where: str = "megatrain.WrapOptions") -> Tuple["WrapOptions", dict]:
        """``(options, rest)``: the keywords of ``kwargs`` that are options (their values checked, messages
        starting with ``where``), and the others (``from_pretrained`` / ``from_config`` pass those to
        ``AutoModelForCausalLM.from_config``)."""
        names = set(cls.names())
        return (cls(**{k: v for k, v in kwargs.items() if k in names}, where=where),
                {k: v for k, v in kwargs.items() if k not in names})

    def as_kwargs(self, names: Optional[Iterable[str]] = None) -> dict:
        """The options as keywords of ``megatrain.wrap`` (``names``: only those, e.g. :data:`ESTIMATE_OPTIONS`)."""
        return {n: getattr(self, n) for n in (self.names() if names is None else names)}

    def check(self, where: str = "megatrain.wrap") -> None:
        """Refuse a bad value, before anything is built (``where`` starts each message).

        ``offload_dir`` is checked on the filesystem too (it may be missing, but its parent must
        exist and be writable; see :func:`~.placement.disk_plan.check_offload_args`). Whether a CUDA
        device is there, and the model-dependent rules, are :meth:`resolve`'s and ``wrap``'s.

        Raises:
            ValueError: one line naming the option, the rule and the value.
        """
        self._check(where)

    def _check(self, where: str) -> tuple:
        """:meth:`check`; returns ``offload_dir`` as an absolute path (None: no disk tier) and ``chunked_loss``
        / ``tile_mlp`` normalised (None: False; an int: rows)."""
        self._check_values(where)
        offload_dir = check_offload_args(self.offload_dir, self.host_memory_limit, where)
        return offload_dir, _check_mode(self.chunked_loss, "chunked_loss", where), _check_mode(self.tile_mlp, "tile_mlp",
                                                                                          where)

    def _check_values(self, where: str) -> None:
        """Each value's type and range (no filesystem access): the construction's check, and :meth:`check`'s first."""
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"{where}: num_slots must be an int >= 1 (device slots per layer shape; 2 prefetches "
                             f"the next layer), got {self.num_slots!r}")
        if not isinstance(self.reuse_attention, bool):
            raise ValueError(f"{where}: reuse_attention must be True or False, got {self.reuse_attention!r}")
        if not isinstance(self.lean_activations, bool):
            raise ValueError(f"{where}: lean_activations must be True or False, got {self.lean_activations!r}")
        if not isinstance(self.grad_accumulator, (bool, type(None))):
            raise ValueError(f"{where}: grad_accumulator must be None (allocated at the first accumulation), True "
                             f"or False, got {self.grad_accumulator!r}")
        if self.device is not None:
            _device_kind(self.device, where)
        if self.compute_dtype is not None and self.compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{where}: compute_dtype must be torch.bfloat16 or torch.float32, got {self.compute_dtype}")
        if self.activation_policy is not None:
            ActivationPolicy.parse(self.activation_policy, f"{where}: activation_policy")
        check_device_state_layers(self.device_state_layers, f"{where}: device_state_layers")
        check_liger_kernel(self.liger_kernel, f"{where}: liger_kernel")
        object.__setattr__(self, "gpu_memory_limit",
                           check_gpu_memory_limit(self.gpu_memory_limit, f"{where}: gpu_memory_limit"))
        check_offload_dir_value(self.offload_dir, where)
        object.__setattr__(self, "host_memory_limit", check_host_memory_limit(self.host_memory_limit, where))
        _check_mode(self.chunked_loss, "chunked_loss", where)
        _check_mode(self.tile_mlp, "tile_mlp", where)
        for name, what in (("micro_batch_size", "sequences per micro-batch"), ("seq_len", "tokens per sequence")):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{where}: {name} must be an int >= 1 ({what}) or None, got {v!r}")
        given = [n for n in BATCH_OPTIONS if getattr(self, n) is not None]
        if len(given) == 1:  # the batch would silently not count: the reserve would be 20% of free memory
            other = next(n for n in BATCH_OPTIONS if n not in given)
            raise ValueError(f"{where}: {given[0]}={getattr(self, given[0])} was given without {other}; pass both "
                             "(the batch the capacity share reserves activations for) or neither")
        check_host_compute_copy(self.host_compute_copy, where)

    @property
    def batch_tokens(self) -> int:
        """Tokens per micro-batch, ``micro_batch_size x seq_len`` (0 unless both are given)."""
        return self.micro_batch_size * self.seq_len if self.micro_batch_size and self.seq_len else 0

    def with_defaults(self, where: str = "megatrain.wrap", need_device: bool = True) -> "WrapOptions":
        """These options with ``device`` a ``torch.device``, ``compute_dtype`` a dtype, ``activation_policy``
        an :class:`ActivationPolicy`, ``offload_dir`` an absolute path and ``chunked_loss`` / ``tile_mlp``
        normalised (``None``: False), checked by :meth:`check` first.

        Args:
            where: starts each error message.
            need_device: a CUDA device must be there (``wrap``); False: any CUDA device is planned for
                (``estimate`` on a machine without one).

        Raises:
            ValueError: as :meth:`check`; with ``need_device``, CUDA asked for but not available, or no such device.
        """
        offload_dir, chunked_loss, tile_mlp = self._check(where)
        device = self.device
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        device = _device_kind(device, where)
        if need_device:
            device = _available(device, where)
        compute_dtype = self.compute_dtype
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        policy = (ActivationPolicy.default(device) if self.activation_policy is None
                  else ActivationPolicy.parse(self.activation_policy))
        return dataclasses.replace(self, where=where, device=device, compute_dtype=compute_dtype, activation_policy=policy,
                                   offload_dir=offload_dir, chunked_loss=chunked_loss, tile_mlp=tile_mlp)

    def resolve(self, where: str = "megatrain.wrap") -> "WrapOptions":
        """What ``wrap`` runs with: :meth:`with_defaults`, then ``device_state_layers`` given its default,
        ``gpu_memory_limit`` in bytes (None off CUDA) and ``liger_kernel`` True / False (applied or not).

        Raises:
            ValueError: as :meth:`with_defaults`; ``liger_kernel=True`` without liger-kernel or off CUDA.
        """
        opts = self.with_defaults(where)
        return dataclasses.replace(
            opts, where=where, gpu_memory_limit=resolve_gpu_memory_limit(opts.gpu_memory_limit, opts.device),
            liger_kernel=resolve_liger_kernel(opts.liger_kernel, opts.device, f"{where}: liger_kernel"),
            device_state_layers=resolve_device_state_layers(opts.device_state_layers, opts.activation_policy,
                                                            opts.device))


def _device_kind(device, where: str) -> torch.device:
    """``device`` as a ``torch.device`` of type CUDA or CPU (not checked to be there)."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{where}: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{where}: device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{where}: device must be a CUDA device or 'cpu', got {str(device)!r}")
    return device


def _available(device: torch.device, where: str) -> torch.device:
    """``device`` with its index, refused when CUDA is not available or the index is not a visible device."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{where}: device {str(device)!r} requested, but CUDA is not available (torch "
                         f"{torch.__version__}, built with CUDA {torch.version.cuda}): use device='cpu', or install "
                         "a CUDA build of torch on a machine with a GPU")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda" and device.index >= torch.cuda.device_count():
        raise ValueError(f"{where}: device {str(device)!r} requested, but only {torch.cuda.device_count()} "
                         "CUDA device(s) are visible")
    return device
