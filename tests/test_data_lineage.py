"""The embedded data set and tokenizer are what manifests/data/LINEAGE.md says they are."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

from disttrace.data import corpus, tokenizer
from disttrace.errors import BadInput

DATA = Path(__file__).resolve().parent.parent / "manifests" / "data"
CORPUS, TOKENIZER, CARD = DATA / "corpus.jsonl", DATA / "tokenizer.json", DATA / "LINEAGE.md"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def split():
    return corpus.split_documents(corpus.load_documents(CORPUS), 10, "disttrace-v1")


def test_regenerating_corpus_gives_committed_bytes(tmp_path):
    out = tmp_path / "corpus.jsonl"
    assert corpus.main(["--out", str(out)]) == 0
    assert sha256(out) == sha256(CORPUS)


def test_card_digests_match_files():
    card = CARD.read_text()
    for path in (CORPUS, TOKENIZER):
        m = re.search(rf"`manifests/data/{path.name}` \| (\d+) \| `([0-9a-f]{{64}})`", card)
        assert m, f"no digest row for {path.name} in the card"
        assert (int(m.group(1)), m.group(2)) == (path.stat().st_size, sha256(path))


def test_card_counts_match_split(split):
    card = CARD.read_text()
    for key, value in split[2].items():
        assert f"| `{key}` | `{value}` |" in card, key


def test_split_has_no_leak_and_dedups(split):
    train, evl, report = split
    assert report["eval_in_train"] == 0
    assert report["n_duplicates_removed"] > 0
    assert report["n_train"] + report["n_eval"] == report["n_unique"] == len(train) + len(evl)
    assert 0 < report["n_eval"] < report["n_train"]


def test_split_is_stable_under_reordering_and_appending(split):
    docs = corpus.load_documents(CORPUS)
    extra = [{"id": "new", "text": "An extra document appended later."}]
    _, evl2, _ = corpus.split_documents(list(reversed(docs)) + extra, 10, "disttrace-v1")
    assert {d["text"].strip() for d in split[1]} <= {d["text"].strip() for d in evl2}
    assert len({d["text"].strip() for d in evl2} - {d["text"].strip() for d in split[1]}) <= 1


def test_dedup_strips_whitespace_and_keeps_first():
    docs = [
        {"id": "a", "text": "same"},
        {"id": "b", "text": " same \n"},
        {"id": "c", "text": "other"},
    ]
    train, evl, report = corpus.split_documents(docs, 0, "s")
    assert [d["id"] for d in train] == ["a", "c"] and evl == []
    assert report["n_duplicates_removed"] == 1 and report["eval_in_train"] == 0


def test_tokenizer_training_is_deterministic_and_matches_committed(tmp_path, split):
    # Trains in well under a second on the 2244 train documents.
    texts = [d["text"] for d in split[0]]
    first, second = tokenizer.train_bpe(texts, 512), tokenizer.train_bpe(texts, 512)
    assert first == second
    out = tmp_path / "tokenizer.json"
    assert tokenizer.main(["--corpus", str(CORPUS), "--vocab-size", "512", "--out", str(out)]) == 0
    assert out.read_bytes() == first.encode() == TOKENIZER.read_bytes()


def test_committed_tokenizer_roundtrips():
    tok = tokenizer.load_tokenizer("bpe", TOKENIZER)
    assert (tok.vocab_size, tok.eos_id, tok.sha256) == (512, 0, sha256(TOKENIZER))
    text = "The all-reduce sums the gradient across 4 ranks. Ünïcode too.\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) and all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_id]) == text


def test_byte_tokenizer():
    tok = tokenizer.load_tokenizer("byte", None)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.sha256 == hashlib.sha256(b"disttrace-byte-tokenizer-v1").hexdigest()
    assert tok.encode("hé") == list("hé".encode()) and tok.decode(tok.encode("hé") + [256]) == "hé"


@pytest.mark.parametrize(
    "kind,name,content",
    [
        ("bpe", "missing.json", None),
        ("bpe", "bad.json", "{not json"),
        ("bpe", "noeos.json", None),  # a valid tokenizer without <|eos|>
        ("nope", "x.json", None),
    ],
)
def test_load_tokenizer_bad_input(tmp_path, kind, name, content):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    if name == "noeos.json":
        from tokenizers import Tokenizer, models

        path.write_text(Tokenizer(models.BPE()).to_str())
    with pytest.raises(BadInput) as e:
        tokenizer.load_tokenizer(kind, path)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_malformed_jsonl_line_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": "broken"\n')
    with pytest.raises(BadInput) as e:
        corpus.load_documents(path)
    assert "line 3" in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)

    path.write_text('{"text": "fine"}\n{"id": "x"}\n')
    with pytest.raises(BadInput, match="line 2"):
        corpus.load_documents(path)


def test_jsonl_default_ids(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n{"id": "mine", "text": "three"}\n{"text": "four"}\n')
    assert [d["id"] for d in corpus.load_documents(path)] == ["line-1", "mine", "line-4"]


def test_txt_loading(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("First paragraph,\nsecond line.\n\n  \nSecond one.\n\n\n\nThird.\n")
    docs = corpus.load_documents(path)
    assert docs == [
        {"id": "para-1", "text": "First paragraph,\nsecond line."},
        {"id": "para-2", "text": "Second one."},
        {"id": "para-3", "text": "Third."},
    ]


def test_unsupported_or_empty_input(tmp_path):
    for name, content in (("d.csv", "a,b\n"), ("e.txt", "\n\n  \n")):
        (tmp_path / name).write_text(content)
        with pytest.raises(BadInput, match=name):
            corpus.load_documents(tmp_path / name)
