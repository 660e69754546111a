"""The results file of ``bench.quality.run``: one JSON object per finished run, keyed by ``run_id``.

Concurrent shards (``--shard I/N``, several processes on one ``--out``) append to the same ``OUT/results.jsonl``:
every append is one ``write`` of one line under an exclusive ``flock`` (readers take a shared one), so lines never
interleave. Readers also accept ``results.*.jsonl`` beside it (e.g. per-machine files copied into one folder), skip
lines that do not parse (a process killed mid-write can leave at most a partial last line) and keep one row per
``run_id`` (the last one read), so duplicates from overlapping calls or merges are harmless.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import Iterable

RESULTS = "results.jsonl"


def result_files(src: str | os.PathLike) -> list[Path]:
    """``src`` itself when it is a file, else its ``results.jsonl`` then ``results.*.jsonl`` (sorted)."""
    p = Path(src)
    if p.is_file():
        return [p]
    if not p.is_dir():
        return []
    main = p / RESULTS
    return ([main] if main.is_file() else []) + sorted(q for q in p.glob("results.*.jsonl") if q.is_file())


def _read_lines(path: Path) -> list[str]:
    with open(path) as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        try:
            return f.read().splitlines()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_rows(sources: Iterable[str | os.PathLike]) -> list[dict]:
    """Rows of every results file under ``sources``, one per run_id (the last read wins), in first-seen order."""
    rows: dict[str, dict] = {}
    for src in sources:
        for path in result_files(src):
            for n, line in enumerate(_read_lines(path), 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    rid = r["run_id"]
                except (ValueError, KeyError, TypeError):
                    print(f"{path}:{n}: skipping a line that is not a result row", file=sys.stderr)
                    continue
                rows[rid] = r
    return list(rows.values())


def append_row(path: str | os.PathLike, row: dict) -> None:
    """Appends one row as one line, atomically with respect to other appenders and readers of ``path``."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
