"""Text data for causal-LM training: read, tokenize, split, pack.

Pipeline (all deterministic given the seed):

1. Documents: each ``.jsonl`` line's ``text_field`` is one document; any other file is one document.
   A directory is searched recursively, files in sorted path order.
2. Split: documents are shuffled with ``numpy.random.default_rng(seed)``; the last
   ``eval_fraction`` of them (at least one) are held out. With a single document the tail
   ``eval_fraction`` of its tokens is held out instead.
3. Tokenize each document and append the end-of-text token (EOS) after it.
4. Pack: each split's token stream is cut into rows of exactly ``seq_len`` tokens (the remainder is
   dropped): no padding, so every token of a batch is a training token. ``labels = input_ids``
   (the model shifts them).
5. Training order: an endless sequence of epochs, epoch ``e`` visiting the training rows in the
   order ``default_rng([seed, e]).permutation``; micro batches are consecutive runs of that order.

Tokenizers: :mod:`megatrain.train.text_tokenizer`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import numpy as np

from megatrain.train.config import DataConfig, UsageError
from megatrain.train.messages import warn
from megatrain.train.run_files import RUN_MARKERS
from megatrain.train.text_tokenizer import load_tokenizer

STDLIB = "stdlib"


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]



def _names(paths: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(p) for p in paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def is_run_dir(path: str) -> bool:
    """Whether directory ``path`` is a ``megatrain train`` output directory (it holds ``run_files.RUN_MARKERS``)."""
    return all(os.path.isfile(os.path.join(path, name)) for name in RUN_MARKERS)


def find_files(path: str, include: Sequence[str]) -> List[str]:
    """Regular files of ``path`` (a file, a directory searched recursively, or ``stdlib``), sorted.

    FIFOs, sockets, devices and broken symlinks in a directory are skipped with a warning naming
    them (reading a FIFO would block the run), and so are the output directories of megatrain runs
    under it (:func:`is_run_dir`: ``--data .`` with the default ``--out runs/...``).

    Raises:
        UsageError: the path does not exist, is not a regular file or directory, is a run's output
            directory, or holds no matching file.
    """
    if path == STDLIB:
        root, patterns, skip = stdlib_dir(), ["*.py"], {"site-packages", "dist-packages", "__pycache__"}
    else:
        root, patterns, skip = path, list(include), {"__pycache__", ".git"}
        if not os.path.lexists(path):
            raise UsageError(f"data path {path!r} does not exist; pass a text/JSONL file or a directory with --data")
        if not os.path.exists(path):
            raise UsageError(f"data path {path!r} is a broken symlink; pass a text/JSONL file or a directory with --data")
        if os.path.isfile(path):
            return [path]
        if not os.path.isdir(path):
            raise UsageError(f"data path {path!r} is not a regular file or a directory (a FIFO, socket or device); "
                             "pass a text/JSONL file or a directory with --data")
        if is_run_dir(path):
            raise UsageError(f"data path {path!r} is the output directory of a megatrain run ({', '.join(RUN_MARKERS)}); "
                             "pass the directory of your texts with --data")
    files, special, runs = [], [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        if path != STDLIB:  # a run's output under the data directory (e.g. runs/ of --data .) is not data
            here = [d for d in dirnames if is_run_dir(os.path.join(dirpath, d))]
            runs += [os.path.join(dirpath, d) for d in here]
            dirnames[:] = [d for d in dirnames if d not in here]
        for name in filenames:
            if any(fnmatch.fnmatch(name, p) for p in patterns):
                full = os.path.join(dirpath, name)
                (files if os.path.isfile(full) else special).append(full)
    files.sort()
    if runs:
        warn(f"skipping {len(runs)} megatrain run output director{'y' if len(runs) == 1 else 'ies'} under the data path "
             f"(holding {', '.join(RUN_MARKERS)}): {_names(runs)}")
    if special:
        warn(f"skipping {len(special)} data path(s) that are not regular files (FIFO, socket, device or broken "
             f"symlink): {_names(sorted(special))}")
    if not files:
        raise UsageError(
            f"data path {path!r} has no files matching {', '.join(patterns)}; add text files or set data.include"
        )
    return files


def _is_binary(head: bytes) -> bool:
    """A NUL byte in the first 8 KiB: not text (the test git and grep use)."""
    return b"\0" in head[:8192]


def _decode(raw: bytes, path: str, keep_bytes: bool, lossy: list) -> str:
    """UTF-8 text of ``raw``. Bytes that are not UTF-8 are kept exactly (``keep_bytes``: as surrogate
    escapes, which the byte tokenizer turns back into the same bytes) or replaced by U+FFFD, and
    ``path`` is added to ``lossy``."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        if keep_bytes:
            return raw.decode("utf-8", errors="surrogateescape")
        lossy.append(path)
        return raw.decode("utf-8", errors="replace")


def read_documents(files: Sequence[str], text_field: str = "text", keep_bytes: bool = False,
                   explicit: bool = False) -> List[str]:
    """Reads documents (non-empty strings) from ``files``.

    Binary files (a NUL byte in the first 8 KiB: executables, archives, images, whatever their
    name) are skipped with a warning naming them. Text that is not UTF-8 (e.g. Latin-1) keeps its
    bytes exactly with ``keep_bytes`` (the byte tokenizer); otherwise the undecodable bytes become
    U+FFFD and a warning names the files.

    Args:
        explicit: ``files`` is the one file the user named: a binary one is an error, not skipped.

    Raises:
        UsageError: a JSONL line is not JSON or lacks ``text_field``; a file cannot be read; the one
            named file is binary.
    """
    docs: List[str] = []
    binary, lossy = [], []
    for path in files:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise UsageError(f"cannot read data file {path!r} ({exc.strerror}); check its permissions") from None
        if _is_binary(raw):
            if explicit:
                raise UsageError(f"data file {path!r} is binary, not text (it holds NUL bytes); pass text or JSONL")
            binary.append(path)
            continue
        text = _decode(raw, path, keep_bytes, lossy)
        if path.endswith(".jsonl"):
            for lineno, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise UsageError(f"{path}:{lineno} is not valid JSON; each JSONL line must be an object") from None
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise UsageError(f"{path}:{lineno} has no string field {text_field!r}; set data.text_field")
                if record[text_field]:
                    docs.append(record[text_field])
        elif text:
            docs.append(text)
    if binary:
        warn(f"skipping {len(binary)} binary data file(s) (NUL bytes: not text): {_names(binary)}")
    if lossy:
        warn(f"{len(lossy)} data file(s) are not valid UTF-8; their undecodable bytes were replaced by U+FFFD for "
             f"the tokenizer: {_names(lossy)} (convert them to UTF-8, e.g. iconv -f latin1 -t utf-8)")
    return docs


def pack(token_docs: Sequence[np.ndarray], eos_token_id: int, seq_len: int) -> np.ndarray:
    """Concatenates documents, each followed by EOS, into rows of ``seq_len`` tokens.

    Args:
        token_docs: per document, token ids, shape [n_i], integer.
        eos_token_id: appended after every document.
        seq_len: row length.

    Returns:
        int32 array [num_rows, seq_len], ``num_rows = total_tokens // seq_len`` (tail dropped).
    """
    if not token_docs:
        return np.zeros((0, seq_len), dtype=np.int32)
    eos = np.asarray([eos_token_id], dtype=np.int32)
    parts = []
    for doc in token_docs:
        parts.append(np.asarray(doc, dtype=np.int32))
        parts.append(eos)
    stream = np.concatenate(parts)
    rows = len(stream) // seq_len
    return stream[: rows * seq_len].reshape(rows, seq_len)


@dataclass
class TextData:
    """Packed training and held-out rows plus the tokenizer that made them."""

    train: np.ndarray  # [num_train_rows, seq_len] int32
    eval: np.ndarray  # [num_eval_rows, seq_len] int32
    tokenizer: object
    num_files: int
    num_documents: int
    num_eval_documents: int

    @property
    def seq_len(self) -> int:
        return int(self.train.shape[1])

    def max_token_id(self) -> int:
        return int(max(self.train.max(initial=0), self.eval.max(initial=0)))

    def train_batches(self, batch_size: int, seed: int, start: int = 0, start_row: Optional[int] = None) -> Iterator:
        """Endless micro batches of training rows, as int64 torch tensors [batch_size, seq_len].

        Args:
            start: number of micro batches to skip (to resume).
            start_row: rows to skip instead (to resume after a change of batch size); wins over ``start``.
        """
        import torch

        n = len(self.train)
        position = start * batch_size if start_row is None else start_row
        epoch, offset = divmod(position, n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        while True:
            rows = []
            while len(rows) < batch_size:
                if offset == n:
                    epoch, offset = epoch + 1, 0
                    order = np.random.default_rng([seed, epoch]).permutation(n)
                take = min(batch_size - len(rows), n - offset)
                rows.extend(order[offset : offset + take].tolist())
                offset += take
            yield torch.from_numpy(self.train[rows]).long()

    def fingerprint(self) -> str:
        """sha256 of the packed training and held-out rows: equal iff a resumed run sees the same data."""
        import hashlib

        h = hashlib.sha256()
        for rows in (self.train, self.eval):
            h.update(repr(rows.shape).encode())
            h.update(memoryview(np.ascontiguousarray(rows)).cast("B"))
        return h.hexdigest()

    def eval_batches(self, batch_size: int, num_batches: int) -> List:
        """The fixed held-out batches: the first ``num_batches * batch_size`` eval rows in order.

        The last batch may be smaller; weight batch losses by their token counts.
        """
        import torch

        rows = self.eval[: batch_size * num_batches]
        return [torch.from_numpy(rows[i : i + batch_size]).long() for i in range(0, len(rows), batch_size)]


def load_text_data(cfg: DataConfig, seed: int, tokenizer=None) -> TextData:
    """Reads, splits, tokenizes and packs ``cfg.path`` (see the module docstring).

    Raises:
        UsageError: missing/empty path, unreadable files, or too little text for one training row
            and one held-out row of ``cfg.seq_len`` tokens.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer)
    files = find_files(cfg.path, cfg.include)
    docs = read_documents(files, cfg.text_field, keep_bytes=getattr(tokenizer, "kind", None) == "byte",
                          explicit=cfg.path != STDLIB and os.path.isfile(cfg.path))
    if not docs:
        raise UsageError(f"data path {cfg.path!r} holds no text (its files are empty or binary); point --data at text")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(docs))
    if cfg.max_documents is not None:
        order = order[: cfg.max_documents]
    docs = [docs[i] for i in order]
    if len(docs) >= 2:
        num_eval = min(len(docs) - 1, max(1, int(round(cfg.eval_fraction * len(docs)))))
        train_tokens = tokenizer.encode_batch(docs[: len(docs) - num_eval])
        eval_tokens = tokenizer.encode_batch(docs[len(docs) - num_eval :])
    else:
        num_eval = 0
        tokens = tokenizer.encode(docs[0])
        cut = len(tokens) - int(round(cfg.eval_fraction * len(tokens)))
        train_tokens, eval_tokens = [tokens[:cut]], [tokens[cut:]]
    train = pack(train_tokens, tokenizer.eos_token_id, cfg.seq_len)
    held_out = pack(eval_tokens, tokenizer.eos_token_id, cfg.seq_len)
    if len(train) == 0 or len(held_out) == 0:
        total = sum(len(t) + 1 for t in train_tokens) + sum(len(t) + 1 for t in eval_tokens)
        raise UsageError(
            f"data path {cfg.path!r} has {total} tokens, too few for one training and one held-out row of "
            f"data.seq_len={cfg.seq_len} (held out: data.eval_fraction={cfg.eval_fraction}); add text or lower data.seq_len"
        )
    return TextData(
        train=train,
        eval=held_out,
        tokenizer=tokenizer,
        num_files=len(files),
        num_documents=len(docs),
        num_eval_documents=num_eval,
    )
