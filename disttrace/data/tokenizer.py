"""Tokenizers: a byte-level BPE trained deterministically on the embedded corpus, or plain bytes.

    python -m disttrace.data.tokenizer --corpus manifests/data/corpus.jsonl --vocab-size 512 \\
        --out manifests/data/tokenizer.json

trains on the train split only (eval_percent=10, salt="disttrace-v1") and writes the same bytes
every time. A tokenizer's identity is ``sha256``: of the serialised JSON bytes for "bpe", of a
fixed descriptor for "byte".
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from disttrace.data.corpus import load_documents, split_documents
from disttrace.errors import BadInput

EOS = "<|eos|>"
BYTE_DESCRIPTOR = b"disttrace-byte-tokenizer-v1"
DEFAULT_EVAL_PERCENT = 10
DEFAULT_SALT = "disttrace-v1"


def train_bpe(texts: list[str], vocab_size: int) -> str:
    """Byte-level BPE with EOS at id 0 and all 256 byte symbols at ids 1..256; returns the JSON string."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOS}), got {vocab_size}")
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str(pretty=True)


class Tokenizer:
    """``Tokenizer(serialised_json)`` for BPE, ``Tokenizer()`` for the 257-symbol byte tokenizer."""

    def __init__(self, serialised: str | None = None):
        if serialised is None:
            self.kind, self._tok = "byte", None
            self.vocab_size, self.eos_id = 257, 256
            self.sha256 = hashlib.sha256(BYTE_DESCRIPTOR).hexdigest()
            return
        self.kind = "bpe"
        self._tok = _HFTokenizer.from_str(serialised)  # ValueError/Exception on bad JSON
        eos = self._tok.token_to_id(EOS)
        if eos is None:
            raise ValueError(f"no {EOS} token")
        self.vocab_size, self.eos_id = self._tok.get_vocab_size(with_added_tokens=True), eos
        self.sha256 = hashlib.sha256(serialised.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        """Token ids, without EOS (append ``eos_id`` yourself)."""
        if self._tok is None:
            return list(text.encode("utf-8"))
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; EOS is dropped."""
        if self._tok is None:
            return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]}...)"


def load_tokenizer(kind: str, path: str | Path | None) -> Tokenizer:
    if kind == "byte":
        return Tokenizer()
    if kind != "bpe":
        raise BadInput(
            path or "tokenizer",
            f"unknown tokenizer kind {kind!r} (expected 'bpe' or 'byte')",
            field="kind",
        )
    if path is None:
        raise BadInput("tokenizer", "kind 'bpe' needs a tokenizer JSON file", field="path")
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(
            p, f"cannot read tokenizer file: {getattr(e, 'strerror', None) or e}"
        ) from None
    try:
        return Tokenizer(text)
    except Exception as e:  # tokenizers raises plain Exception on malformed JSON
        first = (str(e).splitlines() or ["malformed"])[0]
        raise BadInput(p, f"not a valid tokenizers JSON file: {first}") from None


def train_from_corpus(
    corpus: str | Path,
    vocab_size: int,
    eval_percent: int = DEFAULT_EVAL_PERCENT,
    salt: str = DEFAULT_SALT,
) -> tuple[str, dict]:
    """Train on the train split of ``corpus`` only; returns (serialised JSON, split report)."""
    train, _, report = split_documents(load_documents(corpus), eval_percent, salt)
    return train_bpe([d["text"] for d in train], vocab_size), report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m disttrace.data.tokenizer", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-percent", type=int, default=DEFAULT_EVAL_PERCENT)
    ap.add_argument("--salt", default=DEFAULT_SALT)
    args = ap.parse_args(argv)
    try:
        serialised, report = train_from_corpus(
            args.corpus, args.vocab_size, args.eval_percent, args.salt
        )
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    data = serialised.encode("utf-8")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_bytes(data)
    print(
        f"trained on {report['n_train']} train docs; wrote {args.out}: {len(data)} bytes, "
        f"sha256 {hashlib.sha256(data).hexdigest()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
