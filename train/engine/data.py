"""Datasets of the engine, tokenized with a response-token mask, and a per-job epoch sampler that uses every sample
exactly once per epoch.

Reading and tokenization are the single-job trainer's (``bdlora.train.data``): every source (JSON/JSONL, parquet,
CSV, saved datasets, folders, cached hub ids ``ORG/NAME[:SPLIT]``) and format (alpaca, sharegpt, messages/chat,
prompt_completion, text; ``auto`` per record) it reads; chat formats are rendered with the chat template, loss on
the assistant responses only. This module only adapts them to packing and adds the per-job epoch sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch



@dataclass
class Sample:
    """One tokenized example: ``loss_mask[t]`` says token t is a target (predicted from position t-1)."""

    input_ids: list[int]
    loss_mask: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_targets(self) -> int:
        return int(sum(self.loss_mask[1:]))


def read_records(path: str | Path, split: Optional[str] = None) -> list[dict]:
    from bdlora.train.data import read_records as _read

    return _read(path, split)


def tokenize_records(records: list[dict], tok, max_len: int, fmt: str = "auto", source: str = "dataset"
                     ) -> list[Sample]:
    """Tokenized samples via the single-job trainer's encoding (``bdlora.train.data.encode_record``, any format);
    records are numbered from 1 in messages."""
    from bdlora.train.data import IGNORE_INDEX, encode_record

    out = []
    for i, rec in enumerate(records):
        ex = encode_record(tok, rec, fmt, max_len, index=i, where=f"{source} record {i + 1}")
        if ex is None or len(ex.input_ids) < 2:
            continue
        s = Sample(list(ex.input_ids), [l != IGNORE_INDEX for l in ex.labels])
        if s.n_targets > 0:
            out.append(s)
    return out


@dataclass
class DatasetSplit:
    train: list[Sample]
    val: list[Sample]


class EpochSampler:
    """Batches of sample indices: a fresh seeded permutation per epoch, each index exactly once per epoch.

    The last batch of an epoch may be smaller (never mixes two epochs). State is two ints, so runs resume exactly.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0
        self._perm: Optional[list[int]] = None

    def _permutation(self) -> list[int]:
        if self._perm is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self.n, generator=g).tolist()
            else:
                self._perm = list(range(self.n))
        return self._perm

    def next_batch(self) -> list[int]:
        perm = self._permutation()
        batch = perm[self.pos: self.pos + self.batch_size]
        self.pos += len(batch)
        if self.pos >= self.n:
            self.epoch, self.pos, self._perm = self.epoch + 1, 0, None
        return batch

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.pos, self._perm = int(s["epoch"]), int(s["pos"]), None


__all__ = ["DatasetSplit", "EpochSampler", "Sample", "read_records", "tokenize_records"]
