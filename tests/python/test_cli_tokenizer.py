"""`megatrain train --model DIR`: the tokenizer of the run. The model directory's own tokenizer is used
and saved with the model; bytes only when asked for (`--tokenizer byte`) or when the directory has none
(then one warning line); a tokenizer with more tokens than the model's embedding is refused in one line
before anything is written."""

import json
import os
import sys

import pytest
import torch

_PY = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
if _PY not in sys.path:
    sys.path.insert(0, _PY)

megatrain = pytest.importorskip("megatrain", reason="megatrain (with its compiled extension) is not importable")
from parity import run_cli  # noqa: E402
from megatrain.train import run_plan  # noqa: E402
from megatrain.train.config_build import build_config  # noqa: E402

TEXT = ["the cat sat on the mat", "a dog ran in the park", "the bird sang a song", "def f(x): return x + 1"]
FAST = ["--steps", "1", "--seq-len", "16", "--micro-batch-size", "2", "--eval-every", "1", "--log-every", "1",
        "--set", "eval.batches=1", "--set", "train.warmup_steps=1", "--device", "cpu", "--compute-dtype", "fp32",
        "--no-progress"]  # fmt: skip


def make_tokenizer(path, vocab_size: int):
    """A word-level tokenizer of ``vocab_size`` tokens (``[UNK]``, ``</s>`` = EOS, words, then fillers),
    saved with ``save_pretrained`` into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for line in TEXT for w in line.split()})
    vocab = {"[UNK]": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab.update({f"filler{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]")
    assert len(fast) == vocab_size
    fast.save_pretrained(str(path))
    return fast


def make_model_dir(path, vocab_size: int = 320, tokenizer_vocab=None):
    """A saved 2-layer Llama (embedding of ``vocab_size`` rows), with a tokenizer of ``tokenizer_vocab``
    tokens in the same directory when given."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=64, vocab_size=vocab_size, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    if tokenizer_vocab is not None:
        make_tokenizer(path, tokenizer_vocab)
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        (d / f"doc{i}.txt").write_text("\n".join(TEXT * 4))
    return d


@pytest.fixture(scope="module")
def dir_with_tokenizer(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("with_tok"), vocab_size=320, tokenizer_vocab=40)


@pytest.fixture(scope="module")
def dir_without_tokenizer(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("without_tok"), vocab_size=320)


def _warnings(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("megatrain: warning:")]


def _ids(tok_dir, text: str) -> list:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))(text, add_special_tokens=False)["input_ids"]


def test_model_dir_tokenizer_is_used_and_saved(tmp_path, corpus, dir_with_tokenizer, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--model", str(dir_with_tokenizer), "--data", str(corpus), "--out", str(out),
                            *FAST], capsys)
    assert code == 0, err
    assert not any("tokenizer" in w for w in _warnings(err)), err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokenizer"] == str(dir_with_tokenizer)
    text = "the cat sat on the mat"
    assert _ids(out / "model", text) == _ids(dir_with_tokenizer, text) == [2 + sorted(
        {w for line in TEXT for w in line.split()}).index(w) for w in text.split()]
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(out / "model"))
    assert len(saved) == 40 and saved.eos_token == "</s>"
    assert json.loads((out / "model" / "megatrain_train.json").read_text())["eos_token_id"] == 1


def test_model_dir_without_tokenizer_trains_bytes_and_says_so(tmp_path, corpus, dir_without_tokenizer, capsys):
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--model", str(dir_without_tokenizer), "--data", str(corpus), "--out", str(out),
                            *FAST], capsys)
    assert code == 0, err
    lines = [w for w in _warnings(err) if "tokenizer" in w]
    assert len(lines) == 1, err
    assert "has no tokenizer files" in lines[0] and "byte tokenizer" in lines[0] and "--tokenizer" in lines[0]
    assert json.loads((out / "summary.json").read_text())["tokenizer"] == "byte"
    assert _ids(out / "model", "ab") == [97, 98]  # the byte tokenizer went with the model


def _prepare(argv):
    from megatrain.cli import _build_parser, _overrides

    args = _build_parser().parse_args(["train", *argv])
    return run_plan.prepare(build_config(None, overrides=_overrides(args)), dry_run=True)


def test_explicit_byte_tokenizer_wins_over_the_model_dirs(tmp_path, corpus, dir_with_tokenizer, capsys):
    plan = _prepare(["--model", str(dir_with_tokenizer), "--tokenizer", "byte", "--data", str(corpus),
                     "--out", str(tmp_path / "out"), *FAST])
    assert plan.data.tokenizer.kind == "byte"
    assert plan.data.max_token_id() >= 97  # bytes, not the 40 word ids
    assert _warnings(capsys.readouterr().err) == []


def test_explicit_tokenizer_dir_wins_over_the_model_dirs(tmp_path, corpus, dir_with_tokenizer, capsys):
    other = tmp_path / "other_tok"
    make_tokenizer(other, 60)
    plan = _prepare(["--model", str(dir_with_tokenizer), "--tokenizer", str(other), "--data", str(corpus),
                     "--out", str(tmp_path / "out"), *FAST])
    assert plan.data.tokenizer.source == str(other) and plan.data.tokenizer.vocab_size == 60
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("explicit", [False, True], ids=["model_dirs_own", "explicit_dir"])
def test_tokenizer_larger_than_the_embedding_is_refused_before_writing(tmp_path, corpus, capsys, explicit):
    model = make_model_dir(tmp_path / "model", vocab_size=32, tokenizer_vocab=None if explicit else 48)
    tok = ["--tokenizer", str(make_tokenizer(tmp_path / "tok", 48) and tmp_path / "tok")] if explicit else []
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--model", str(model), *tok, "--data", str(corpus), "--out", str(out), *FAST],
                           capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    assert "has 48 tokens but the model's embedding has 32 rows" in lines[0], lines[0]
    assert "--tokenizer" in lines[0]
    assert not out.exists(), "nothing may be written when the tokenizer is refused"


def test_model_without_data_says_it_trains_on_the_built_in_corpus(tmp_path, dir_with_tokenizer, capsys):
    """--model DIR without --data fine-tunes on the built-in corpus: said in one warning line, which names
    --data (a forgotten flag would otherwise train the user's model on Python sources unnoticed)."""
    capsys.readouterr()
    plan = _prepare(["--model", str(dir_with_tokenizer), "--out", str(tmp_path / "o"), "--seq-len", "32",
                     "--micro-batch-size", "2", "--set", "data.max_documents=20"])
    err = capsys.readouterr().err
    lines = [ln for ln in _warnings(err) if "no --data given" in ln]
    assert len(lines) == 1 and "pass --data PATH" in lines[0] and str(dir_with_tokenizer) in lines[0], err
    assert plan.cfg.data.path == "stdlib"


def test_a_tokenizer_dir_without_tokenizer_files_names_the_files_it_looked_for(tmp_path, corpus, capsys):
    """``--tokenizer DIR`` where DIR holds no tokenizer file: one line naming the files looked for (transformers'
    own reason lists an empty set of them), and nothing written."""
    empty = tmp_path / "not_a_tokenizer"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    out = tmp_path / "out"
    code, _, err = run_cli(["train", "--tokenizer", str(empty), "--data", str(corpus), "--out", str(out), *FAST],
                           capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"cannot load tokenizer from {str(empty)!r} (it holds none of tokenizer.json, tokenizer_config.json" in lines[0]
    assert "from one of" not in lines[0] and not out.exists()
