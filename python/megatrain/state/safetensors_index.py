"""Safetensors headers and the checkpoint index of a Hugging Face model directory (read and checked, nothing loaded)."""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError
from .safetensors_file import CODE_DTYPES, FLOAT_CODES


_MAX_HEADER_BYTES = 100 << 20


# ---------------------------------------------------------------------------------------------- reading
def read_safetensors_header(path: str) -> Tuple[dict, int]:
    """Parse a safetensors file's header and check every tensor's byte range against the file size.

    Returns:
        ``({name: {"dtype", "shape", "data_offsets"}}, data_start_byte)`` (``__metadata__`` dropped).

    Raises:
        CheckpointError: missing, truncated or malformed file (names the file, and the tensor).
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"megatrain: checkpoint file {path} does not exist")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"megatrain: {path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"megatrain: {path} is truncated or not a safetensors file (header of {n} bytes, "
                                  f"file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"megatrain: {path} has a malformed safetensors header ({e})") from None
    header.pop("__metadata__", None)
    start = 8 + n
    for name, info in header.items():
        try:
            b, e = info["data_offsets"]
            dtype, shape = info["dtype"], info["shape"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"megatrain: {path}: tensor {name} has a malformed header entry") from None
        if dtype not in CODE_DTYPES:
            raise CheckpointError(f"megatrain: {path}: tensor {name} has unsupported dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if e - b != numel * CODE_DTYPES[dtype].itemsize or b < 0:
            raise CheckpointError(f"megatrain: {path}: tensor {name} ({dtype} {shape}) has a byte range "
                                  f"[{b}, {e}) of the wrong length")
        if start + e > size:
            raise CheckpointError(f"megatrain: {path} is truncated: tensor {name} ends at byte {start + e}, "
                                  f"the file has {size} bytes")
    return header, start


class CheckpointIndex:
    """Where each tensor of a local model directory lives (headers read and checked up front).

    Args:
        path: a directory holding ``model.safetensors`` or ``model.safetensors.index.json`` + shards.

    Raises:
        CheckpointError: no safetensors weights, an index naming a file that is not there, a
            truncated or malformed file, an index entry the shard does not hold.
    """

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        self.tensors: Dict[str, Tuple[str, dict, int]] = {}  # name -> (file, header entry, data start)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"megatrain: {index} is not a safetensors index ({e!r})") from None
            by_file: Dict[str, List[str]] = {}
            for name, fn in weight_map.items():
                by_file.setdefault(fn, []).append(name)
            for fn, names in by_file.items():
                fp = os.path.join(path, fn)
                if not os.path.isfile(fp):
                    raise CheckpointError(f"megatrain: {index} names {fn} (holding {names[0]} and {len(names) - 1} "
                                          f"more tensors), but {fp} does not exist")
                header, start = read_safetensors_header(fp)
                for name in names:
                    if name not in header:
                        raise CheckpointError(f"megatrain: {index} puts tensor {name} in {fp}, which does not hold it")
                    self.tensors[name] = (fp, header[name], start)
        elif os.path.isfile(single):
            header, start = read_safetensors_header(single)
            for name, info in header.items():
                self.tensors[name] = (single, info, start)
        else:
            raise CheckpointError(f"megatrain: {path} has no model.safetensors or model.safetensors.index.json "
                                  "(only safetensors checkpoints are read; convert .bin weights with save_pretrained)")
        self._files: Dict[str, object] = {}

    def lookup(self, names: List[str], prefix: str = "") -> Optional[str]:
        """The first of ``names`` (or, with the model's base prefix added/removed, its variant) present."""
        for n in names:
            for cand in (n, n[len(prefix) + 1:] if prefix and n.startswith(prefix + ".") else None,
                         f"{prefix}.{n}" if prefix else None):
                if cand is not None and cand in self.tensors:
                    return cand
        return None

    def check(self, key: str, shape: tuple, what: str, float_only: bool = True) -> None:
        fp, info, _ = self.tensors[key]
        if float_only and info["dtype"] not in FLOAT_CODES:
            raise CheckpointError(f"megatrain: {fp}: tensor {key} has dtype {info['dtype']}, expected a float "
                                  f"dtype (F32, BF16, F16, F64) for {what}")
        if tuple(info["shape"]) != tuple(shape):
            raise CheckpointError(f"megatrain: {fp}: tensor {key} has shape {tuple(info['shape'])}, the model's "
                                  f"{what} has shape {tuple(shape)}")

    def read_into(self, key: str, dst: torch.Tensor) -> None:
        """Read tensor ``key`` into ``dst`` (CPU, contiguous, same shape; converted to its dtype)."""
        fp, info, start = self.tensors[key]
        dtype = CODE_DTYPES[info["dtype"]]
        f = self._files.get(fp)
        if f is None:
            f = self._files[fp] = open(fp, "rb", buffering=0)
        b, e = info["data_offsets"]
        direct = dst.dtype == dtype and dst.is_contiguous()
        buf = dst if direct else torch.empty(tuple(info["shape"]), dtype=dtype)
        mv = memoryview(buf.view(-1).view(torch.uint8).numpy()) if buf.numel() else memoryview(b"")
        f.seek(start + b)
        got = 0
        while got < e - b:
            n = f.readinto(mv[got:])
            if not n:
                raise CheckpointError(f"megatrain: {fp} is truncated: tensor {key} could not be read")
            got += n
        if not direct:
            dst.copy_(buf)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


# ---------------------------------------------------------------------------------------------- model
