"""The safetensors file format as megatrain writes it: the dtype codes, one streaming writer, a header reader.

Every safetensors file megatrain writes (checkpoint units, ``export_pretrained``'s
``model.safetensors``, the shards of ``model.save_pretrained``) goes through :func:`write_safetensors`:
the header first, then each tensor's bytes straight from its memory, one tensor at a time. The
``safetensors`` library's writers (``save_file``, ``serialize_file``) take every tensor's bytes at
once, a whole unit or shard gathered in memory; this writer holds at most one converted tensor.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from typing import Callable, Optional, Sequence, Tuple

import torch

from ..errors import CheckpointError

# safetensors dtype codes (https://github.com/huggingface/safetensors, format spec)
DTYPE_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
FLOAT_CODES = {DTYPE_CODES[d] for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}
_CHUNK = 16 << 20


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Writable zero-copy memoryview of a contiguous CPU tensor's bytes (``readinto`` / ``write``).

    Raises:
        ValueError: ``t`` is not a contiguous CPU tensor.
    """
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("megatrain checkpoint: expected a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class DeferredTensor:
    """A tensor viewed (``get()``) only when its bytes are written: a disk unit's fp32 section is a
    view of the tier's buffer, valid inside the engine's state window for one unit at a time."""

    def __init__(self, shape, dtype: torch.dtype, get: Callable[[], torch.Tensor]):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.get = get

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class HashingWriter:
    """Writes a file while hashing it; ``close()`` fsyncs it unless ``sync=False`` (the caller's
    :func:`~megatrain.state.atomic.atomic_directory` fsyncs every file before its swap: one fsync per
    file, each a device cache flush). ``hashing=False``: only the size is counted."""

    def __init__(self, path: str, sync: bool = True, hashing: bool = True):
        self.path = path
        self.sync = sync
        self.f = open(path, "wb")
        self.h = hashlib.sha256() if hashing else None
        self.n = 0

    def write(self, data) -> None:
        if self.h is not None:
            self.h.update(data)
        self.f.write(data)
        self.n += len(data)

    def close(self) -> dict:
        """Flush (and fsync) the file; returns ``{"sha256": hex, "bytes": n}`` (no sha256 without hashing)."""
        self.f.flush()
        if self.sync:
            os.fsync(self.f.fileno())
        self.f.close()
        out = {"bytes": self.n}
        if self.h is not None:
            out = {"sha256": self.h.hexdigest(), "bytes": self.n}
        return out


def write_safetensors(path: str, tensors: Sequence[Tuple[str, object]], metadata: Optional[dict] = None,
                      dtype: Optional[torch.dtype] = None, sync: bool = True, hashing: bool = True) -> dict:
    """Write ``[(name, tensor or DeferredTensor)]`` as a safetensors file, in the order given.

    Each tensor's bytes are written straight from its memory when it is a contiguous CPU tensor
    already of the file's dtype; otherwise one tensor at a time is converted / moved (extra memory:
    the largest such tensor). A :class:`DeferredTensor` is viewed only when its bytes are written.

    Args:
        path: destination file (overwritten).
        tensors: ``(name, tensor)`` pairs; the header and the data follow this order.
        metadata: ``__metadata__``, keys and values written as strings.
        dtype: every tensor written as this dtype (converted one at a time); None: each its own.
        sync: fsync the file before returning (``False`` inside an ``atomic_directory``, which does).
        hashing: compute the file's sha256 while writing.

    Returns:
        ``{"sha256": hex, "bytes": n}`` of the file (``{"bytes": n}`` without hashing).

    Raises:
        ValueError: a dtype safetensors has no code for (before the file is opened).
    """
    header = {}
    off = 0
    for name, t in tensors:
        code = DTYPE_CODES.get(dtype if dtype is not None else t.dtype)
        if code is None:
            raise ValueError(f"unsupported dtype {dtype if dtype is not None else t.dtype}")
        n = t.numel() * (torch.empty((), dtype=dtype).element_size() if dtype is not None else t.element_size())
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    w = HashingWriter(path, sync, hashing)
    try:
        w.write(struct.pack("<Q", len(hb)))
        w.write(hb)
        for _, t in tensors:
            t = t.get() if isinstance(t, DeferredTensor) else t.detach()
            if dtype is not None and t.dtype != dtype:
                t = t.to(dtype)
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()  # held while its bytes are written
            w.write(tensor_bytes(t))
        return w.close()
    except BaseException:
        w.f.close()
        raise


def read_header(f, path: str) -> tuple:
    """``(header, data_start)`` of the safetensors file open as ``f`` (at its start).

    Raises:
        CheckpointError: the file is truncated or its header is not JSON (names ``path``).
    """
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointError(f"megatrain.load_checkpoint: {path} is truncated (no safetensors header)")
    (n,) = struct.unpack("<Q", raw)
    try:
        header = json.loads(f.read(n))
    except ValueError as e:
        raise CheckpointError(f"megatrain.load_checkpoint: {path} has a malformed safetensors header: {e}") from None
    return header, 8 + n


def file_digest(path: str) -> dict:
    """``{"sha256": hex, "bytes": n}`` of a file, read in 16 MiB chunks."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while True:
            b = f.read(_CHUNK)
            if not b:
                break
            h.update(b)
            n += len(b)
    return {"sha256": h.hexdigest(), "bytes": n}


def write_fp32_safetensors(path: str, tensors: Sequence[Tuple[str, object]], metadata: Optional[dict] = None,
                           dtype: torch.dtype = torch.float32, sync: bool = True, hashing: bool = True) -> dict:
    """:func:`write_safetensors` of fp32 state (masters, Adam moments) saved as fp32 or bf16.

    fp32 is written without copying the data; bf16 converts one tensor at a time (extra memory:
    the largest tensor).

    Raises:
        ValueError: ``dtype`` is neither ``torch.float32`` nor ``torch.bfloat16``, or a tensor is not
            fp32 (before the file is opened).
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"megatrain: safetensors dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    _require_fp32(tensors)
    return write_safetensors(path, tensors, metadata, dtype=dtype, sync=sync, hashing=hashing)


def write_state_safetensors(path: str, tensors: Sequence[Tuple[str, object]], frozen: Sequence[Tuple[str, object]] = (),
                            metadata: Optional[dict] = None, sync: bool = True) -> dict:
    """One checkpoint unit file: ``tensors`` (fp32 state, written as fp32) then ``frozen`` (frozen entries'
    compute copies, each in its own dtype: fp32 or the bf16 / fp16 compute dtype), in that order.

    Raises:
        ValueError: a state tensor is not fp32 (before the file is opened).
    """
    _require_fp32(tensors)
    return write_safetensors(path, list(tensors) + list(frozen), metadata, sync=sync)


def _require_fp32(tensors: Sequence[Tuple[str, object]]) -> None:
    """Raise ``ValueError`` naming the first tensor that is not fp32 (before any file is opened)."""
    for key, t in tensors:
        if t.dtype != torch.float32:
            raise ValueError(f"megatrain checkpoint: {key} is {t.dtype}, expected float32")
