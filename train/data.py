"""Instruction data: read alpaca or chat records, render them with the tokenizer's chat template, mask the prompt.

Record formats (JSON list, JSON ``{"data": [...]}``, or JSONL, one record a line):

* alpaca: ``{"instruction": str, "input": str (optional), "output": str, "system": str (optional)}`` becomes
  ``[system?], user = instruction (+ "\\n\\n" + input), assistant = output``;
* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``; at least one assistant
  message.

Labels are the input ids on the assistant responses (each assistant turn's content and the template's end-of-turn
marker after it, so the model learns to stop) and -100 everywhere else. The response spans are found as character
ranges of the rendered text (the template renders the conversation up to a turn as a prefix of the whole) and
mapped to tokens with the fast tokenizer's offsets.

Data order is a deterministic stream: epoch ``e`` is a permutation of the training set drawn from ``seed + e``,
epochs are concatenated, and optimizer step ``s`` consumes stream positions ``[s*G, (s+1)*G)`` with
``G = batch_size * grad_accum * num_processes``; micro-batch ``j`` of process ``p`` takes the ``batch_size``
positions starting at ``s*G + (j*num_processes + p)*batch_size``. The data position of a checkpoint is thus its
step, and resuming is exact.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch

from .config import ConfigError

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


class DataError(ConfigError):
    """A data file or record that cannot be used; the message names the file and record."""


# ---------------------------------------------------------------------------------------------------- reading
def read_records(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or (stripped and stripped[0] == "{" and path.suffix != ".json"):
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}})")
        records = data
    if not records:
        raise DataError(f"{path}: no records")
    return records


def to_messages(record: dict, fmt: str = "auto", where: str = "record") -> list[dict]:
    """One record as chat messages ``[{role, content}]``."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = fmt
    if kind == "auto":
        if "messages" in record:
            kind = "chat"
        elif "instruction" in record and "output" in record:
            kind = "alpaca"
        else:
            raise DataError(f"{where}: neither a chat record (`messages`) nor an alpaca record "
                            f"(`instruction` + `output`); keys are {sorted(record)}")
    if kind == "alpaca":
        for key in ("instruction", "output"):
            if not isinstance(record.get(key), str):
                raise DataError(f"{where}: alpaca record needs a string {key!r}")
        user = record["instruction"]
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise DataError(f"{where}: alpaca 'input' must be a string")
        if extra.strip():
            user = f"{user}\n\n{extra}"
        msgs = []
        if record.get("system"):
            msgs.append({"role": "system", "content": str(record["system"])})
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]
        return msgs
    msgs = record.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: chat record needs a non-empty list 'messages'")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{j}] must be {{'role': str, 'content': str}}")
        if m["role"] not in ("system", "user", "assistant"):
            raise DataError(f"{where}: messages[{j}] has role {m['role']!r}; use system/user/assistant")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "assistant" for m in out):
        raise DataError(f"{where}: no assistant message, so nothing to learn")
    return out


# ---------------------------------------------------------------------------------------------------- encoding
@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    index: int  # position in the source file (after the train/eval split: the original record index)

    @property
    def num_target_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def response_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant responses (with end-of-turn)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; use an instruct/chat model or set one")
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[:i + 1])
        if not full.startswith(through) or not through.startswith(before):
            raise DataError("the chat template does not render conversations prefix-consistently; cannot locate "
                            "the assistant responses for response-only loss")
        # The span ends after the end-of-turn marker; trailing whitespace the template adds is not target.
        end = len(through.rstrip())
        spans.append((len(before), end))
    return full, spans


def encode(tokenizer, messages: list[dict], max_length: int, index: int = 0) -> Optional[Example]:
    """Tokens and response-only labels of one conversation; None when truncation leaves no response token."""
    text, spans = response_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        if e <= s:
            continue
        for a, b in spans:
            if s >= a and e <= b:
                labels[t] = ids[t]
                break
    ids, labels = ids[:max_length], labels[:max_length]
    if all(x == IGNORE_INDEX for x in labels):
        return None
    return Example(ids, labels, index)


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The generation prompt for the conversation without its last assistant message (evaluation)."""
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return _render(tokenizer, messages, add_generation_prompt=True)


def encode_records(tokenizer, records: Iterable[tuple[int, dict]], fmt: str, max_length: int, source: str
                   ) -> list[Example]:
    out, dropped = [], 0
    for idx, rec in records:
        ex = encode(tokenizer, to_messages(rec, fmt, where=f"{source} record {idx}"), max_length, index=idx)
        if ex is None:
            dropped += 1
        else:
            out.append(ex)
    if dropped:
        log.warning("%s: dropped %d example(s) whose response lies beyond max_length=%d tokens",
                    source, dropped, max_length)
    if not out:
        raise DataError(f"{source}: no usable examples (max_length={max_length} may be too small)")
    return out


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, eval) split of ``range(n)``; eval gets round(fraction*n), at least 1 when fraction > 0."""
    if fraction <= 0:
        return list(range(n)), []
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise DataError(f"eval_fraction={fraction} leaves no training example out of {n}")
    return sorted(perm[k:]), sorted(perm[:k])


def load_datasets(cfg, tokenizer) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples for a :class:`~bdlora.train.config.TrainConfig`."""
    records = read_records(cfg.train_file)
    if cfg.eval_file:
        tr_idx, ev_idx = list(range(len(records))), []
        ev_records = read_records(cfg.eval_file)
        ev = encode_records(tokenizer, enumerate(ev_records), cfg.data_format, cfg.max_length, cfg.eval_file)
    else:
        tr_idx, ev_idx = split_indices(len(records), cfg.eval_fraction, cfg.seed)
        ev = (encode_records(tokenizer, ((i, records[i]) for i in ev_idx), cfg.data_format, cfg.max_length,
                             cfg.train_file) if ev_idx else [])
    tr = encode_records(tokenizer, ((i, records[i]) for i in tr_idx), cfg.data_format, cfg.max_length,
                        cfg.train_file)
    return tr, ev


# ---------------------------------------------------------------------------------------------------- batching
def collate(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (-100 on padding)."""
    n = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    for i, e in enumerate(examples):
        L = len(e.input_ids)
        ids[i, :L] = torch.tensor(e.input_ids)
        labels[i, :L] = torch.tensor(e.labels)
        mask[i, :L] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class DataStream:
    """The deterministic example order of a run (module docstring): position -> training-set index."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def _perm_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self._perm

    def at(self, position: int) -> int:
        return self._perm_of(position // self.n)[position % self.n]

    def micro_batch(self, step: int, micro: int, batch_size: int, grad_accum: int, world: int, rank: int
                    ) -> list[int]:
        g = batch_size * grad_accum * world
        start = step * g + (micro * world + rank) * batch_size
        return [self.at(p) for p in range(start, start + batch_size)]


__all__ = ["DataError", "DataStream", "Example", "IGNORE_INDEX", "collate", "encode", "encode_records",
           "load_datasets", "prompt_text", "read_records", "response_spans", "split_indices", "to_messages"]
