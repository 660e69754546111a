#!/usr/bin/env python3
"""The training table of one results folder as a bar chart (BENCHMARKS.md, "Training: one job and many").

    python -m bench.train.plot_table bench/results/train/table_2026-12-01 --out docs/img/training_tokps.png

Reads what ``MODE=table bash bench/train/gpu_run.sh`` writes for each column (``table_trainer_<col>.jsonl`` from
bench_trainer.py, ``table_engine_<col>.json`` from bench_engine.py) and draws, per column, tokens/s of the plain PEFT
loop, ``bdlora train`` (padded and, where measured, packed; the best repeat) and the engine at each K. Prints the
figures it drew, one row per run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = {"b8": "batch 8 x 30-250", "b32": "batch 32 x 30-250", "s2048": "4 x 2048",
           "s2048gc": "4 x 2048, checkpointed"}


def table_rows(folder: Path) -> dict[str, dict[str, float]]:
    """{column: {run label: tok/s}} for the columns the folder holds (the best repeat of a trainer row)."""
    out: dict[str, dict[str, float]] = {}
    for col in COLUMNS:
        rows: dict[str, float] = {}
        trainer = folder / f"table_trainer_{col}.jsonl"
        if trainer.is_file():
            for line in trainer.read_text().splitlines():
                rec = json.loads(line)
                side = rec["side"]
                label = ("plain PEFT loop" if side.startswith("plain") else
                         "bdlora train, packing" if "packing" in side else "bdlora train")
                rows[label] = max(rows.get(label, 0.0), float(rec["tok_per_s"]))
        engine = folder / f"table_engine_{col}.json"
        if engine.is_file():
            for r in json.loads(engine.read_text())["throughput"]:
                rows[f"engine, K = {r['k']}"] = float(r["engine_tokens_per_s"])
        if rows:
            out[col] = rows
    return out


def plot(rows: dict[str, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for col in rows.values() for label in col))
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for i, label in enumerate(labels):
        xs = [c + (i - (len(labels) - 1) / 2) * width for c, col in enumerate(rows) if label in rows[col]]
        ys = [rows[col][label] for col in rows if label in rows[col]]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(rows)), [COLUMNS[c] for c in rows])
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, ncol=2)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="a results folder written by MODE=table bash bench/train/gpu_run.sh")
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    ap.add_argument("--title", default="Llama-3.1-8B shape, BD-LoRA N = 4, one H200")
    a = ap.parse_args(argv)
    rows = table_rows(a.folder)
    if not rows:
        ap.error(f"{a.folder} has no table_trainer_<column>.jsonl or table_engine_<column>.json "
                 f"(columns: {', '.join(COLUMNS)})")
    for col, runs in rows.items():
        print(f"{col:8s} " + " | ".join(f"{k} {v:,.0f}" for k, v in runs.items()))
    plot(rows, a.out, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
