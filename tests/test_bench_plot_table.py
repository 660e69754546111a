"""bench/train/plot_table.py: the training table of a recorded results folder, read and drawn."""
import json
from pathlib import Path

import pytest

from bench.train import plot_table

FOLDER = Path(__file__).resolve().parents[1] / "bench" / "results" / "train" / "table_2026-12-01"


def test_reads_every_column_and_the_best_repeat():
    rows = plot_table.table_rows(FOLDER)
    assert list(rows) == ["b8", "b32", "s2048", "s2048gc"]
    b32 = rows["b32"]
    # two repeats of each trainer row at batch 32: the faster one is drawn
    packed = [json.loads(l)["tok_per_s"] for l in (FOLDER / "table_trainer_b32.jsonl").read_text().splitlines()
              if "packing" in json.loads(l)["side"]]
    assert len(packed) == 2 and b32["bdlora train, packing"] == max(packed)
    assert [k for k in b32 if k.startswith("engine")] == ["engine, K = 1", "engine, K = 4", "engine, K = 8"]
    assert "bdlora train, packing" not in rows["s2048"]


def test_writes_the_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "t.png"
    assert plot_table.main([str(FOLDER), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "engine, K = 8 16,978" in capsys.readouterr().out


def test_a_folder_without_tables_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        plot_table.main([str(tmp_path), "--out", str(tmp_path / "t.png")])
    assert e.value.code == 2 and "has no table_trainer_" in capsys.readouterr().err
