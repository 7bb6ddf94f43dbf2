"""Tokens for training and for the gate's held-out split, and the deterministic order they are read in.

Which sequences a (step, micro-batch, data-parallel rank) reads is a pure function of the manifest, so a
resumed run reads exactly what the reference read, and dp=2 reads the same global batch as dp=1 with
accumulation 2 (see `slot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from disttrace.data.corpus import load_documents, split_documents
from disttrace.data.tokenizer import load_tokenizer


def pack(docs: list[dict], tok, seq_len: int) -> tuple[torch.Tensor, list[tuple[str, int]]]:
    """Concatenate documents (each followed by EOS) and cut windows of seq_len+1 tokens.
    Returns the windows and, for each, the (document id, token offset) it starts at: its lineage."""
    stream: list[int] = []
    starts: list[tuple[int, str]] = []  # (position in stream, doc id)
    for d in docs:
        starts.append((len(stream), d["id"]))
        stream.extend(tok.encode(d["text"]))
        stream.append(tok.eos_id)
    w = seq_len + 1
    n = len(stream) // w
    if n == 0:
        return torch.empty(0, w, dtype=torch.long), []
    windows = torch.tensor(stream[: n * w], dtype=torch.long).view(n, w)
    origins = []
    j = 0
    for i in range(n):
        pos = i * w
        while j + 1 < len(starts) and starts[j + 1][0] <= pos:
            j += 1
        origins.append((starts[j][1], pos - starts[j][0]))
    return windows, origins


class _Read(BaseModel):
    # read from a Manifest's attributes, or from the manifest a store holds (the gate's evaluation)
    model_config = ConfigDict(from_attributes=True, extra="ignore", frozen=True)


class _Data(_Read):
    eval_percent: int
    split_salt: str


class _Tokenizer(_Read):
    kind: str
    sha256: str | None = None


class _Model(_Read):
    max_seq_len: int


class _Parallelism(_Read):
    dp: int


class _Training(_Read):
    micro_batch_size: int
    grad_accum_steps: int


class _Experiment(_Read):
    seed: int


class WindowsLayout(_Read):
    """What the token windows read of a manifest (config/manifest.py's names and types): the split, the
    tokenizer, the sequence length, the batch layout and the seed of the order."""

    data: _Data
    tokenizer: _Tokenizer
    model: _Model
    parallelism: _Parallelism
    training: _Training
    experiment: _Experiment


class TokenData:
    def __init__(self, manifest: Any, data_path: str, tokenizer_path: str | None):
        """`manifest`: the job's `Manifest`, or the manifest a store holds (a mapping)."""
        m = WindowsLayout.model_validate(manifest)
        docs = load_documents(Path(data_path))
        train, held_out, self.split_report = split_documents(
            docs, m.data.eval_percent, m.data.split_salt
        )
        self.tok = load_tokenizer(m.tokenizer.kind, tokenizer_path)
        self.seq_len = m.model.max_seq_len
        self.train, self.train_origin = pack(train, self.tok, self.seq_len)
        self.eval, self.eval_origin = pack(held_out, self.tok, self.seq_len)
        if len(self.train) == 0:
            raise ValueError(
                f"{data_path}: too little text for one training sequence of {self.seq_len + 1} tokens"
            )
        self.dp, self.mbs = m.parallelism.dp, m.training.micro_batch_size
        self.accum = m.training.grad_accum_steps
        self.seed = m.experiment.seed
        self.layout = m
        self._perms: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        return self.dp * self.mbs * self.accum

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(len(self.train), generator=g)
        return self._perms[epoch]

    def sample_ids(self, step: int, micro_batch: int, dp_rank: int) -> list[int]:
        """Global batch of `step` = positions [step*G, (step+1)*G) of an endless shuffled stream;
        slot (micro_batch, dp_rank) takes its own contiguous run of micro_batch_size positions."""
        n = len(self.train)
        start = (step - 1) * self.global_batch + (micro_batch * self.dp + dp_rank) * self.mbs
        return [int(self._perm(p // n)[p % n]) for p in range(start, start + self.mbs)]

    def batch(self, step: int, micro_batch: int, dp_rank: int) -> dict:
        ids = self.sample_ids(step, micro_batch, dp_rank)
        w = self.train[ids]
        return {"inputs": w[:, :-1], "targets": w[:, 1:], "sample_ids": ids}

    def eval_batches(self, batch_size: int, max_batches: int):
        for i in range(0, min(len(self.eval), batch_size * max_batches), batch_size):
            w = self.eval[i : i + batch_size]
            yield w[:, :-1], w[:, 1:]
