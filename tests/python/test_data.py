"""megatrain.train.data: reading, EOS separation, packing, seeded split and order, tokenizers."""

import json
import os

import numpy as np
import pytest
import torch

import megatrain.train.data as data
import megatrain.train.text_tokenizer as text_tokenizer
from megatrain.train.config import DataConfig, UsageError  # noqa: E402

EOS = text_tokenizer.ByteTokenizer.eos_token_id


def _corpus(tmp_path, n_docs=40, doc_len=50):
    """Documents ``D<i>:`` + filler, each unique, one file per document, in nested directories."""
    root = tmp_path / "corpus"
    for i in range(n_docs):
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"doc{i:03d}.txt").write_text(f"D{i:03d}:" + chr(ord("a") + i % 26) * (doc_len - 5))
    return root


def test_pack_puts_eos_after_every_document_and_drops_the_tail():
    docs = [np.array([1, 2, 3]), np.array([4]), np.array([5, 6])]
    rows = data.pack(docs, eos_token_id=9, seq_len=4)
    # stream: 1 2 3 9 4 9 5 6 9 -> two full rows of 4, the single trailing 9 dropped
    np.testing.assert_array_equal(rows, [[1, 2, 3, 9], [4, 9, 5, 6]])
    assert rows.dtype == np.int32


def test_byte_tokenizer_round_trip_and_hf_equivalent(tmp_path):
    tok = text_tokenizer.ByteTokenizer()
    # A literal "<|endoftext|>" in the text is bytes, not EOS, for both tokenizers.
    text = "héllo\n\tw\u00f6rld \x00 😀 <|endoftext|>"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text
    tok.save(str(tmp_path))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    # The saved HF tokenizer must give the very ids the trainer used (else the model is useless).
    assert hf(text, add_special_tokens=False)["input_ids"] == ids.tolist()
    assert hf.eos_token_id == EOS
    assert json.loads((tmp_path / "megatrain_tokenizer.json").read_text())["eos_token_id"] == EOS


def test_split_is_by_document_seeded_and_disjoint(tmp_path):
    root = _corpus(tmp_path)
    cfg = DataConfig(path=str(root), seq_len=16, eval_fraction=0.1)
    a = data.load_text_data(cfg, seed=1)
    b = data.load_text_data(cfg, seed=1)
    c = data.load_text_data(cfg, seed=2)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.eval, b.eval)
    assert a.num_files == 40 and a.num_documents == 40 and a.num_eval_documents == 4

    def doc_ids(rows):
        text = bytes(int(t) for t in rows.ravel() if t != EOS).decode()
        return {text[i + 1 : i + 4] for i in range(len(text)) if text[i] == "D" and text[i + 4 : i + 5] == ":"}

    train_docs, eval_docs = doc_ids(a.train), doc_ids(a.eval)
    assert len(eval_docs) >= 3 and not (train_docs & eval_docs)
    assert doc_ids(c.eval) != eval_docs  # another seed, another held-out set
    # every row is full length and the EOS count matches the number of document ends
    assert a.train.shape[1] == 16
    assert (a.train == EOS).sum() >= 30


def test_jsonl_documents_and_missing_field(tmp_path):
    good = tmp_path / "d.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"doc {i} " * 20}) for i in range(10)) + "\n\n")
    d = data.load_text_data(DataConfig(path=str(good), seq_len=32), seed=0)
    assert d.num_documents == 10
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(UsageError, match="no string field 'text'"):
        data.load_text_data(DataConfig(path=str(bad), seq_len=32), seed=0)


def test_single_document_holds_out_its_tail(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("".join(chr(ord("a") + i % 26) for i in range(1000)))
    d = data.load_text_data(DataConfig(path=str(f), seq_len=10, eval_fraction=0.1), seed=0)
    assert d.num_eval_documents == 0
    # 900 train bytes -> 90 rows; 100 eval bytes + EOS -> 10 rows, starting at byte 900
    assert d.train.shape == (90, 10) and d.eval.shape == (10, 10)
    assert bytes(d.eval[0].tolist()).decode() == "".join(chr(ord("a") + i % 26) for i in range(900, 910))


def test_train_batches_visit_every_row_once_per_epoch_and_resume():
    n = 53  # not a multiple of the batch size: batches straddle epochs
    train = np.arange(n * 8, dtype=np.int32).reshape(n, 8)  # distinct rows
    d = data.TextData(train=train, eval=train[:2], tokenizer=text_tokenizer.ByteTokenizer(), num_files=1, num_documents=1,
                      num_eval_documents=0)
    it = d.train_batches(batch_size=5, seed=3)
    first_epoch = torch.cat([next(it) for _ in range(n // 5)])
    assert first_epoch.dtype == torch.int64 and first_epoch.shape == (n - n % 5, 8)
    first_rows = (first_epoch[:, 0] // 8).tolist()
    assert len(set(first_rows)) == len(first_rows)  # no row twice within an epoch
    assert first_rows != sorted(first_rows)  # shuffled
    assert set(first_rows) | set((next(it)[:, 0] // 8).tolist()) == set(range(n))  # epoch completes
    again = d.train_batches(batch_size=5, seed=3)
    skipped = d.train_batches(batch_size=5, seed=3, start=7)
    for _ in range(7):
        next(again)
    for _ in range(n // 5 + 3):  # across the epoch boundary
        assert torch.equal(next(again), next(skipped))
    other = d.train_batches(batch_size=5, seed=4)
    assert not torch.equal(next(other), next(d.train_batches(batch_size=5, seed=3)))


def test_eval_batches_are_fixed_and_cover_requested_rows(tmp_path):
    d = data.load_text_data(DataConfig(path=str(_corpus(tmp_path, n_docs=60)), seq_len=8, eval_fraction=0.5), seed=0)
    batches = d.eval_batches(batch_size=4, num_batches=3)
    assert [b.shape[0] for b in batches] == [4, 4, 4]
    assert torch.equal(torch.cat(batches), torch.from_numpy(d.eval[:12]).long())


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: str(p / "missing"), "does not exist"),
        (lambda p: (p / "empty").mkdir() or str(p / "empty"), "has no files matching"),
        (lambda p: (p / "e.txt").write_text("") and None or str(p / "e.txt"), "holds no text"),
        (lambda p: (p / "s.txt").write_text("tiny") and None or str(p / "s.txt"), "too few for one training"),
    ],
)
def test_bad_data_path_is_usage_error(tmp_path, make, message):
    with pytest.raises(UsageError, match=message):
        data.load_text_data(DataConfig(path=make(tmp_path), seq_len=64), seed=0)


def test_stdlib_corpus_excludes_site_packages():
    files = data.find_files("stdlib", [])
    assert len(files) > 100
    assert all(f.endswith(".py") and "site-packages" not in f for f in files)
    assert files == sorted(files)


def test_local_hf_tokenizer_directory_gives_the_same_rows_as_byte_tokenizer(tmp_path):
    # The byte tokenizer saved as HF files is a local tokenizer directory like any other.
    tok_dir = tmp_path / "tok"
    text_tokenizer.ByteTokenizer().save(str(tok_dir))
    root = _corpus(tmp_path)
    via_bytes = data.load_text_data(DataConfig(path=str(root), seq_len=16), seed=0)
    via_hf = data.load_text_data(DataConfig(path=str(root), seq_len=16, tokenizer=str(tok_dir)), seed=0)
    assert isinstance(via_hf.tokenizer, text_tokenizer.HFTokenizer) and via_hf.tokenizer.eos_token_id == EOS
    np.testing.assert_array_equal(via_bytes.train, via_hf.train)
    np.testing.assert_array_equal(via_bytes.eval, via_hf.eval)
    with pytest.raises(UsageError, match="not a directory"):
        text_tokenizer.load_tokenizer(str(tmp_path / "nope"))


def test_run_output_directories_under_the_data_are_skipped_and_a_run_directory_is_refused(tmp_path, capsys):
    # `--data .` with the default --out runs/<time>: a second run must not read the first one's metrics.jsonl
    root = _corpus(tmp_path, n_docs=6)
    before = data.find_files(str(root), ["*.txt", "*.jsonl", "*.md"])
    run = root / "runs" / "20261206-055757"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("train: {}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (root / "notes.jsonl").write_text('{"text": "a document of the user"}\n')  # the user's own JSONL stays data
    capsys.readouterr()
    got = data.find_files(str(root), ["*.txt", "*.jsonl", "*.md"])
    assert got == sorted(before + [str(root / "notes.jsonl")])
    err = capsys.readouterr().err
    assert "skipping 1 megatrain run output directory" in err and "20261206-055757" in err
    # a directory that only holds metrics.jsonl (no config.yaml) is the user's data, read as before
    (run / "config.yaml").unlink()
    assert str(run / "metrics.jsonl") in data.find_files(str(root), ["*.jsonl"])
    (run / "config.yaml").write_text("train: {}\n")
    with pytest.raises(UsageError, match="is the output directory of a megatrain run"):
        data.find_files(str(run), ["*.jsonl"])
