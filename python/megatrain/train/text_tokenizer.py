"""The tokenizer of a ``megatrain train`` run: UTF-8 bytes, or a local Hugging Face tokenizer directory.

The byte tokenizer (``data.tokenizer: byte``, or none given and the model has none of its own) maps
UTF-8 bytes to ids 0..255 and EOS to 256.
"""

from __future__ import annotations

import json
import os
from typing import List, Optional, Sequence

import numpy as np

from megatrain.train.config import UsageError

EOS_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256 (vocab 257)."""

    kind = "byte"
    source = "byte"  # what the run's summary names
    note: Optional[str] = None  # a warning for the user (see load_tokenizer)
    vocab_size = 257
    eos_token_id = 256

    def encode(self, text: str) -> np.ndarray:
        """Returns the ids of ``text``'s UTF-8 bytes, shape [len(bytes)], int32.

        Surrogate escapes (bytes of a file that is not UTF-8, read with ``errors="surrogateescape"``)
        become those original bytes again: nothing is lost or replaced.
        """
        try:
            raw = text.encode("utf-8", errors="surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate that is no escaped byte (e.g. "\\ud800" in JSON)
            raw = text.encode("utf-8", errors="replace")
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def to_hf(self):
        """The same tokenizer as a ``transformers.PreTrainedTokenizerFast`` (for saving).

        A byte-level BPE with no merges whose vocabulary maps the GPT-2 byte-to-unicode character of
        byte b to id b, so ``AutoTokenizer.from_pretrained(out_dir)`` reproduces :meth:`encode`.
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        byte_to_char = _bytes_to_unicode()
        vocab = {byte_to_char[b]: b for b in range(256)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([EOS_TEXT])  # gets id 256
        # split_special_tokens: a literal "<|endoftext|>" in text stays bytes, as in encode().
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=EOS_TEXT, bos_token=EOS_TEXT, split_special_tokens=True
        )

    def save(self, out_dir: str) -> None:
        """Writes HF tokenizer files (when ``tokenizers`` is installed) and megatrain_tokenizer.json."""
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "megatrain_tokenizer.json"), "w") as f:
            json.dump({"type": "byte", "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}, f)
        try:
            self.to_hf().save_pretrained(out_dir)
        except ImportError:  # pragma: no cover - tokenizers ships with transformers
            pass


def _bytes_to_unicode() -> dict:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class HFTokenizer:
    """A local tokenizer directory loaded with ``transformers.AutoTokenizer`` (no downloads).

    Args:
        path: the directory (``data.tokenizer``, or the model directory's own tokenizer).
        fix: what to do when it cannot be loaded (the end of the one-line error).

    Raises:
        UsageError: not a directory, unreadable tokenizer files, or no ``eos_token``.
    """

    kind = "hf"

    def __init__(self, path: str, fix: str = "give a directory with tokenizer files"):
        if not os.path.isdir(path):
            raise UsageError(f"data.tokenizer {path!r} is not a directory; give a local tokenizer directory or 'byte'")
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure is a user-side problem here
            msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            msg = msg if len(msg) <= 160 else msg[:157] + "..."
            if not has_tokenizer(path):  # transformers' own reason then lists no file names
                msg = f"it holds none of {', '.join(TOKENIZER_FILES)}"
            raise UsageError(f"cannot load tokenizer from {path!r} ({msg}); {fix}") from None
        if self.tok.eos_token_id is None:
            raise UsageError(f"tokenizer in {path!r} has no eos_token; set one in its tokenizer_config.json"
                             + ("" if fix.startswith("give") else f", or {fix}"))
        self.path = self.source = path
        self.eos_token_id = int(self.tok.eos_token_id)
        self.vocab_size = len(self.tok)

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        out = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(ids, dtype=np.int32) for ids in out]

    def encode(self, text: str) -> np.ndarray:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def save(self, out_dir: str) -> None:
        self.tok.save_pretrained(out_dir)


# Files any of which makes a directory hold a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def has_tokenizer(path: str) -> bool:
    """Whether directory ``path`` holds tokenizer files (:data:`TOKENIZER_FILES`)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(spec: Optional[str], model_dir: Optional[str] = None):
    """The tokenizer of a run.

    Args:
        spec: ``data.tokenizer``: ``"byte"`` -> :class:`ByteTokenizer`; a directory ->
            :class:`HFTokenizer`; ``None`` -> ``model_dir``'s own tokenizer when it has one
            (:func:`has_tokenizer`), else :class:`ByteTokenizer`.
        model_dir: ``model.path`` (None: the model is built from ``model.arch``). When it is a model
            directory (has ``config.json``) without tokenizer files and ``spec`` is None, the byte
            tokenizer returned carries ``note``: the one warning line to print once the run's input
            is checked (that it trains on bytes).

    Raises:
        UsageError: the tokenizer directory cannot be loaded or has no EOS token (one line).
    """
    if spec == "byte":
        return ByteTokenizer()
    if spec is not None:
        return HFTokenizer(spec)
    if model_dir is not None and os.path.isdir(model_dir) and has_tokenizer(model_dir):
        return HFTokenizer(model_dir, fix="fix its tokenizer files, or pass --tokenizer DIR or --tokenizer byte")
    tok = ByteTokenizer()
    if model_dir is not None and os.path.isfile(os.path.join(model_dir, "config.json")):
        tok.note = (f"model directory {model_dir!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): "
                    "training on the byte tokenizer (UTF-8 bytes + EOS, 257 ids), saved with the model; pass "
                    "--tokenizer DIR for another, or --tokenizer byte to choose bytes")
    return tok
