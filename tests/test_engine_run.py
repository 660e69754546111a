"""Engine runs on the tiny model: early exit wiring and backfill, warm-up top-k, resume, admission, CLI."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from test_engine_utils import run_dict, write_alpaca

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_alpaca(tmp_path_factory.mktemp("data") / "rev.jsonl", n=30)


def _engine(tiny_llama_dir, data_file, out, jobs, **kw):
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    return Engine(parse_run(run_dict(tiny_llama_dir, data_file, out, jobs, **kw)))


def _assert_same_finished_adapters(rows, ref, steps: int) -> None:
    """Each job of ``rows`` finished its ``steps`` and saved the factors its ``ref`` row saved (to 1e-7)."""
    from bdlora import load_adapter

    for r, f in zip(rows, ref, strict=True):
        assert r["status"] == f["status"] == "done" and r["steps"] == f["steps"] == steps
        a, b = load_adapter(r["adapter"]), load_adapter(f["adapter"])
        for p in a.modules:
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=0, atol=1e-7)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=0, atol=1e-7)


def _val_loss_of_folder(tiny_llama_dir, folder, samples) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    m = PeftModel.from_pretrained(base, folder).eval()
    tot, n = 0.0, 0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            logits = m(input_ids=ids).logits[0, :-1]
            mask = torch.tensor(s.loss_mask[1:])
            tot += float(torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"))
            n += int(mask.sum())
    return tot / n


def test_early_exit_frees_slots_for_the_queue(tiny_llama_dir, data_file, tmp_path):
    # tau_slope = -inf-ish: any two evaluations "diverge" -> exit after window + patience - 1 = 3 evaluations
    ee = {"enabled": True, "warmup_select": False, "tau_slope": -1e9, "tau_gap": 1e9}
    jobs = [{"name": f"j{i}", "seed": i} for i in range(4)]
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, early_exit=ee, eval_every=1,
                  max_active_jobs=2, defaults={"max_steps": 6, "batch_size": 2, "max_length": 64, "lr": 1e-3})
    rows = eng.run()
    assert [r["stop_reason"] for r in rows] == ["diverging"] * 4
    assert [r["steps"] for r in rows] == [3] * 4
    # two at a time: the queue was backfilled when the first two exited
    assert [r["active"] for r in eng.round_log] == [2] * 6
    assert all(os.path.isdir(r["adapter"]) for r in rows)


def test_overfitting_exit_keeps_best_checkpoint(tiny_llama_dir, data_file, tmp_path):
    from bdlora.train.engine.early_exit import OVERFITTING

    ee = {"enabled": True, "warmup_select": False, "tau_slope": 1e9, "tau_gap": -1e9, "patience": 3}
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", [{"name": "o", "lr": 5e-2}], early_exit=ee,
                  eval_every=1, defaults={"max_steps": 10, "batch_size": 4, "max_length": 64})
    (row,) = eng.run()
    assert row["stop_reason"] == OVERFITTING and row["steps"] == 3
    vals = [v for _, v in eng.jobs[0].history["val"]]
    assert row["best_eval_loss"] == min(vals)
    got = _val_loss_of_folder(tiny_llama_dir, row["adapter"], eng.jobs[0].data.val)
    assert got == pytest.approx(min(vals), rel=1e-4)
    assert vals.index(min(vals)) != len(vals) - 1 or True  # best may be last; the folder equals the best anyway


def test_diverging_exit_keeps_best_checkpoint(tiny_llama_dir, data_file, tmp_path):
    """A diverged job's folder holds its best-validation factors, not its latest (on a GPU they were NaN)."""
    from bdlora.train.engine.early_exit import DIVERGING

    ee = {"enabled": True, "warmup_select": False, "tau_slope": -1e9, "tau_gap": 1e9}
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", [{"name": "d", "lr": 1.0}], early_exit=ee,
                  eval_every=1, defaults={"max_steps": 10, "batch_size": 4, "max_length": 64})
    (row,) = eng.run()
    assert row["stop_reason"] == DIVERGING and row["steps"] == 3
    vals = [v for _, v in eng.jobs[0].history["val"]]
    assert min(vals) != vals[-1]  # the latest state is not the best one: the restore is observable
    assert _val_loss_of_folder(tiny_llama_dir, row["adapter"], eng.jobs[0].data.val) == pytest.approx(min(vals),
                                                                                                      rel=1e-4)


def test_non_finite_factors_are_never_written(tiny_llama_dir, data_file, tmp_path, capsys):
    """A job that ends with inf/NaN factors and no best checkpoint gets no folder (adapter None in its row) and a
    message; the check itself is exact."""
    from bdlora.adapter import Adapter, AdapterConfig
    from bdlora.layout import LoraFactors
    from bdlora.train.engine.early_exit import DIVERGING
    from bdlora.train.engine.jobs import adapter_is_finite

    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", [{"name": "n"}], eval_every=100, max_rounds=1,
                  defaults={"max_steps": 4, "batch_size": 2, "max_length": 64})
    eng.run()
    job = eng.jobs[0]
    assert job.status == "active" and job.best_state is None
    with torch.no_grad():
        next(iter(job.adapter.parameters())).view(-1)[3] = float("nan")
    eng.finish(job, DIVERGING)
    assert job.result["adapter"] is None and not (tmp_path / "run" / "adapters" / "n").exists()
    assert "not finite" in capsys.readouterr().out
    cfg = AdapterConfig(r=2, peft_lora_alpha=2.0, use_rslora=True, target_modules=["q_proj"])
    ok = {"m": LoraFactors(torch.ones(2, 4), torch.ones(4, 2), "column")}
    assert adapter_is_finite(Adapter(cfg, ok), "x", print)
    bad = {"m": LoraFactors(torch.ones(2, 4), torch.full((4, 2), float("inf")), "column")}
    assert not adapter_is_finite(Adapter(cfg, bad), "x", lambda msg: None)


def test_warmup_selection_keeps_top_quarter(tiny_llama_dir, data_file, tmp_path):
    ee = {"enabled": True, "warmup_ratio": 0.25, "keep_ratio": 0.25, "tau_slope": 1e9, "tau_gap": 1e9}
    search = [{"name": "g", "type": "grid", "space": {"lr": [1e-4, 3e-3, 1e-2, 3e-5]}}]
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", [], search=search, early_exit=ee, eval_every=4,
                  max_active_jobs=2, defaults={"max_steps": 8, "batch_size": 2, "max_length": 64})
    rows = eng.run()
    reasons = [r["stop_reason"] for r in rows]
    assert sorted(reasons) == ["completed"] + ["underperforming"] * 3
    warm = {j.name: j.warm_val for j in eng.jobs}
    best = min(warm, key=warm.get)
    assert rows[[r["job"] for r in rows].index(best)]["stop_reason"] == "completed"
    assert all(r["steps"] == 2 for r in rows if r["stop_reason"] == "underperforming")
    assert [r["steps"] for r in rows if r["stop_reason"] == "completed"] == [8]


def test_resume_equals_uninterrupted(tiny_llama_dir, data_file, tmp_path):
    from bdlora import load_adapter

    jobs = [{"name": "a", "r": 4, "nblocks": 2, "scheduler": "cosine"}, {"name": "b", "r": 8, "nblocks": 4,
                                                                          "max_steps": 5}]
    full = _engine(tiny_llama_dir, data_file, tmp_path / "full", jobs).run()
    kw = dict(resume="auto", save_every=1)
    part = _engine(tiny_llama_dir, data_file, tmp_path / "part", jobs, max_rounds=2, **kw).run()
    assert all(r["status"] == "active" for r in part)
    rows = _engine(tiny_llama_dir, data_file, tmp_path / "part", jobs, **kw).run()
    for r, f in zip(rows, full):
        assert r["steps"] == f["steps"] and r["final_eval_loss"] == pytest.approx(f["final_eval_loss"], rel=1e-6)
        a, b = load_adapter(r["adapter"]), load_adapter(f["adapter"])
        for p in a.modules:
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=0, atol=1e-7)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=0, atol=1e-7)


def test_admission_refuses_what_cannot_fit(tiny_llama_dir, data_file, tmp_path):
    jobs = [{"name": "small1", "r": 4}, {"name": "huge", "r": 256}, {"name": "small2", "r": 4}]
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, defaults={"max_steps": 2, "batch_size": 2,
                                                                              "max_length": 64})
    fp = {j.name: j.footprint(eng.targets) for j in eng.jobs}
    one = eng.memory.predict(eng.run_cfg.token_budget, [fp["small1"]])
    two = eng.memory.predict(eng.run_cfg.token_budget, [fp["small1"], fp["small2"]])
    huge = eng.memory.predict(eng.run_cfg.token_budget, [fp["huge"]])
    assert one < two < huge
    eng.mem_budget = (one + two) / 2  # one small job at a time; the huge one never
    rows = eng.run()
    assert rows[1]["stop_reason"].startswith("refused: needs")
    assert rows[0]["stop_reason"] == rows[2]["stop_reason"] == "completed"
    assert max(r["active"] for r in eng.round_log) == 1


def test_observe_memory_feeds_and_refits_the_model(tiny_llama_dir, data_file, tmp_path, monkeypatch):
    """Engine.observe_memory (the engine after each step, each pipeline stage after each segment): on a GPU it adds
    (token budget, the jobs' footprints, measured peak) to the memory model and refits it every 5 points, so
    admission learns from measured peaks; on CPU it measures nothing. The GPU peak is faked here."""
    jobs = [{"name": "a", "r": 4}, {"name": "b", "r": 8, "nblocks": 2}]
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, memory_model="auto")
    assert eng.observe_memory(eng.jobs) is None and eng.memory.points == []  # CPU
    fp = [j.footprint(eng.targets) for j in eng.jobs]
    analytic = eng.memory.predict(eng.run_cfg.token_budget, fp)
    sets = [eng.jobs[: 1 + k % 2] for k in range(5)]
    want = [int(5e8 + 40 * sum(j.footprint(eng.targets).params for j in js)) for js in sets]  # 40 B per parameter
    peaks = iter(want)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    eng.device = torch.device("cuda", 0)  # only observe_memory runs with it
    fitted = []
    for js, peak in zip(sets, want):
        assert eng.observe_memory(js) == peak
        fitted.append(eng.memory.fitted)
    assert len(eng.memory.points) == 5 and fitted[-1] and not any(fitted[:-1])
    assert eng.memory.predict(eng.run_cfg.token_budget, fp) != analytic  # admission now uses the refitted model
    assert eng.observe_memory([]) is None and len(eng.memory.points) == 5


def test_cli_yaml_run_and_resume(tiny_llama_dir, data_file, tmp_path):
    from bdlora import load_adapter

    cfg = run_dict(tiny_llama_dir, data_file, tmp_path / "out", [{"name": "x", "r": 4, "nblocks": 2}],
                   save_every=1, resume="auto", save_plots=True, log_every=1, report_to=["tensorboard"],
                   progress=True)
    cfg_path = tmp_path / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "bdlora.train.engine", "--config", str(cfg_path)]
    p = subprocess.run(cmd + ["--max-rounds", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "round 1" in p.stdout and "max_rounds" in p.stdout
    # progress: a line for the round and one per active job with its step, losses and tokens/s
    assert re.search(r"round 1: 1 active, \d+ micro-batches, \d+ tokens, [\d,]+ tok/s", p.stdout), p.stdout
    assert re.search(r"\n  x +1/3 +train +\d+\.\d+ val +\S+ +[\d,]+ tok/s active", p.stdout), p.stdout
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed" in p.stdout and "completed" in p.stdout
    with open(tmp_path / "out" / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["steps"] == "3" and row["stop_reason"] == "completed"
    # report_to and progress are honoured: tensorboard events per job, a bar over the run's steps
    assert list((tmp_path / "out" / "runs" / "x").glob("events.out.tfevents.*"))
    assert "bdlora sweep" in p.stderr and "3/3" in p.stderr
    ad = load_adapter(row["adapter"])
    assert ad.config.nblocks == 2 and ad.config.r == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**cfg, "jobs": [{"name": "x", "rnk": 3}]}))
    p = subprocess.run([sys.executable, "-m", "bdlora.train.engine", "--config", str(bad)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and "bdlora sweep: error:" in p.stderr and "jobs[0] (x): unknown key(s) 'rnk'" in p.stderr
    assert "Traceback" not in p.stderr


def test_pad_multiple_auto_resolves_by_device(tiny_llama_dir, data_file, tmp_path):
    """pad_multiple left out: 1 on CPU (64 on a GPU); an explicit value is used as given, in every micro-batch."""
    from bdlora.train.engine.engine import GPU_PAD_MULTIPLE

    eng = _engine(tiny_llama_dir, data_file, tmp_path / "auto", [{"name": "a", "max_steps": 1}])
    assert eng.device.type == "cpu" and eng.pad_multiple == 1 and GPU_PAD_MULTIPLE == 64
    eng = _engine(tiny_llama_dir, data_file, tmp_path / "p16", [{"name": "a", "max_steps": 1}], pad_multiple=16)
    assert eng.pad_multiple == 16
    job = eng.jobs[0]
    mbs = eng.microbatches([(job.id, list(range(4)))])
    assert mbs and all(mb.input_ids.shape[1] % 16 == 0 for mb in mbs)


def test_sdpa_runs_without_cudnn_attention_unless_asked(tiny_llama_dir, data_file, tmp_path, sdpa_backend_flags):
    """`cudnn_attention` is a run-level key of the engine as of `bdlora train`: every sdpa call of a run sees cuDNN
    attention off by default and on with `cudnn_attention: true`, restored after the run; refused inside jobs:."""
    from bdlora.train.config import ConfigError
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import run_engine

    steps = {"max_steps": 1, "batch_size": 2, "max_length": 64, "lr": 1e-3}
    for out, kw, flags in (("off", {}, (False, True, True, True)), ("on", {"cudnn_attention": True}, (True,) * 4)):
        sdpa_backend_flags.clear()
        run_engine(parse_run(run_dict(tiny_llama_dir, data_file, tmp_path / out, [{"name": "a"}], defaults=steps,
                                      attn_implementation="sdpa", **kw)))
        assert sdpa_backend_flags and set(sdpa_backend_flags) == {flags}, out
        assert torch.backends.cuda.cudnn_sdp_enabled() is True
    with pytest.raises(ConfigError, match="cudnn_attention: is shared by every job"):
        parse_run(run_dict(tiny_llama_dir, data_file, tmp_path / "bad", [{"name": "a", "cudnn_attention": True}]))


def test_auto_token_budget_follows_the_memory_limit_and_survives_resume(tiny_llama_dir, data_file, tmp_path):
    """`token_budget: auto` (the default): the largest size the memory model admits for the jobs' first round under
    `memory_budget_gb` (here on CPU), recorded in results.json and the checkpoint; a resumed run keeps it even
    when the limit changed, and trains what an uninterrupted run at that explicit budget trains."""
    import json

    jobs = [{"name": "a", "r": 4}, {"name": "b", "r": 8}]
    defaults = {"max_steps": 3, "batch_size": 16, "lr": 1e-3, "max_length": 64}  # a step of both: 2048 tokens
    probe = _engine(tiny_llama_dir, data_file, tmp_path / "probe", jobs, defaults=defaults)
    fps = [j.footprint(probe.targets) for j in probe.jobs]
    gib = {t: probe.memory.predict(t, fps) / 2**30 for t in (1024, 2048)}
    between = (gib[1024] + gib[2048]) / 2
    kw = dict(defaults=defaults, token_budget="auto", resume="auto", save_every=1)
    roomy = _engine(tiny_llama_dir, data_file, tmp_path / "roomy", jobs, memory_budget_gb=gib[2048] * 100, **kw)
    assert roomy.token_budget == 2048  # the smallest size holding a step of both jobs, though 16384 would fit
    tight = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, memory_budget_gb=between, max_rounds=1, **kw)
    assert tight.token_budget == 1024
    tight.run()
    resumed = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, memory_budget_gb=gib[2048] * 100, **kw)
    assert resumed.token_budget == 2048  # before the checkpoint is read
    rows = resumed.run()
    assert resumed.token_budget == 1024
    assert json.loads((tmp_path / "run" / "results.json").read_text())["token_budget"] == 1024
    ref = _engine(tiny_llama_dir, data_file, tmp_path / "ref", jobs, defaults=defaults, token_budget=1024).run()
    _assert_same_finished_adapters(rows, ref, steps=3)


def test_a_round_out_of_gpu_memory_runs_again_at_a_smaller_auto_budget(tiny_llama_dir, data_file, tmp_path,
                                                                      monkeypatch, capsys):
    """A round that runs out of GPU memory in its second micro-batch (raised here after that forward: a CPU cannot
    run out the way a GPU does), the first one's gradients already accumulated, runs again under `token_budget:
    auto` from the same batches at the next smaller budget with those gradients cleared: the adapters equal a run
    at that budget from the start, which the checkpoint and results.json keep. With a fixed budget the run stops
    with what to change."""
    import json

    import bdlora.train.engine.step as step
    from bdlora.train.engine.scheduler import EngineError

    jobs = [{"name": f"j{i}", "r": 4 * (i + 1), "nblocks": 2 if i % 2 else 1, "seed": i} for i in range(4)]
    defaults = {"max_steps": 3, "batch_size": 16, "lr": 1e-3, "max_length": 64}
    probe = _engine(tiny_llama_dir, data_file, tmp_path / "probe", jobs, defaults=defaults)
    fps = [j.footprint(probe.targets) for j in probe.jobs]
    between = (probe.memory.predict(2048, fps) + probe.memory.predict(4096, fps)) / 2 / 2**30
    ref = _engine(tiny_llama_dir, data_file, tmp_path / "ref", jobs, defaults=defaults, token_budget=1024).run()

    def out_of_memory_in_a_second_micro_batch(engine):
        real, calls = step.job_losses, []

        def job_losses(model, mb):
            losses = real(model, mb)  # the forward runs, and its graph goes with the error, as on a GPU
            calls.append(engine.token_budget)
            if engine.token_budget >= 2048 and len(calls) >= 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
            return losses

        monkeypatch.setattr(step, "job_losses", job_losses)
        return calls

    eng = _engine(tiny_llama_dir, data_file, tmp_path / "run", jobs, defaults=defaults, token_budget="auto",
                  memory_budget_gb=between)
    assert eng.token_budget == 2048
    calls = out_of_memory_in_a_second_micro_batch(eng)
    capsys.readouterr()
    rows = eng.run()
    assert calls[:2] == [2048, 2048] and eng.token_budget == 1024
    # the log says why auto chose its budget, and that the round ran again at a smaller one
    log = capsys.readouterr().out
    need = probe.memory.predict(2048, fps) / 2**30
    assert (f"token budget 2048 tokens per micro-batch (auto: ~{need:.1f} GiB predicted for the first 4 jobs, "
            f"limit {between:.1f} GiB)") in log
    assert "out of GPU memory at 2048 tokens per micro-batch: the round runs again at 1024" in log
    assert json.loads((tmp_path / "run" / "results.json").read_text())["token_budget"] == 1024
    _assert_same_finished_adapters(rows, ref, steps=3)
    fixed = _engine(tiny_llama_dir, data_file, tmp_path / "fixed", jobs, defaults=defaults, token_budget=2048)
    out_of_memory_in_a_second_micro_batch(fixed)
    with pytest.raises(EngineError, match=r"out of GPU memory .* token_budget: 2048\): set a smaller token_budget "
                                          r".* resume: auto"):
        fixed.run()


@pytest.mark.parametrize("every_n", [1, 2])
def test_gradient_checkpointing_recomputes_and_trains_the_same_adapters(tiny_llama_dir, data_file, tmp_path, every_n):
    """`gradient_checkpointing` (run level): the base's decoder layers (every n-th) run their forward again in the
    backward pass, with the micro-batch's segments and LoRA-dropout masks of the first pass, so two jobs packed
    together train the adapters they train without it."""
    from bdlora import load_adapter

    jobs = [{"name": "a", "r": 4, "lora_dropout": 0.1, "seed": 1}, {"name": "b", "r": 8, "nblocks": 2, "seed": 2}]
    plain = _engine(tiny_llama_dir, data_file, tmp_path / "plain", jobs)
    ckpt = _engine(tiny_llama_dir, data_file, tmp_path / "ckpt", jobs, gradient_checkpointing=True,
                   gradient_checkpointing_every_n_layers=every_n)
    layers = ckpt.model.model.layers
    assert ckpt.checkpointed_layers == len(layers[::every_n]) and plain.checkpointed_layers == 0
    calls = {"plain": [0] * len(layers), "ckpt": [0] * len(layers)}
    for name, eng in (("plain", plain), ("ckpt", ckpt)):
        for i, layer in enumerate(eng.model.model.layers):
            # a pre-hook: the recompute stops once it has what backward needs, before a forward hook would run; on
            # the layer's attention, which the recompute calls whether transformers checkpoints the layer's
            # __call__ or (>= 5.24) its forward
            layer.self_attn.register_forward_pre_hook(
                lambda *_, n=name, i=i: calls[n].__setitem__(i, calls[n][i] + 1))
    rows_p, rows_c = plain.run(), ckpt.run()
    # every layer runs once per micro-batch (training and evaluation); a checkpointed one again in each backward
    mbs = sum(r["microbatches"] for r in ckpt.round_log)
    assert all(c - p == (mbs if i % every_n == 0 else 0)
               for i, (p, c) in enumerate(zip(calls["plain"], calls["ckpt"]))), (calls, mbs)
    if every_n == 1:  # both layers recompute: the memory model counts one layer's activations per token, not two
        assert ckpt.memory.beta[1] < plain.memory.beta[1]
    for r, f in zip(rows_c, rows_p):
        assert r["status"] == f["status"] == "done" and r["steps"] == f["steps"]
        assert r["final_eval_loss"] == pytest.approx(f["final_eval_loss"], rel=1e-6)
        a, b = load_adapter(r["adapter"]), load_adapter(f["adapter"])
        for p in a.modules:
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=1e-5, atol=1e-7)


def _adapter_tensors(folder):
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["inside-a-checkpoint-write", "after-a-checkpoint"])
def test_kill_9_then_resume_is_bit_identical(tiny_llama_dir, data_file, tmp_path, moment):
    """SIGKILL `bdlora sweep` (while engine_state.pt is being written, or right after one was), then run the same
    command again (resume: auto): every job's adapter equals an uninterrupted run's, tensor for tensor."""
    from killing import sigkill_when

    jobs = [{"name": "a", "r": 32, "nblocks": 2, "lora_dropout": 0.1, "seed": 1, "scheduler": "cosine"},
            {"name": "b", "r": 64, "nblocks": 4, "seed": 2, "max_steps": 6}]

    def cmd(name):
        cfg = run_dict(tiny_llama_dir, data_file, tmp_path / name, jobs, save_every=1, resume="auto",
                       defaults={"max_steps": 10, "batch_size": 4, "lr": 1e-3, "max_length": 64})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return [sys.executable, "-m", "bdlora.train.engine", "--config", str(path)]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd("straight"), env=env, check=True, capture_output=True, timeout=300)
    out = tmp_path / "killed"
    proc = subprocess.Popen(cmd("killed"), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state, tmp = out / "engine_state.pt", out / "engine_state.pt.tmp"
    due = ((lambda: tmp.exists()) if moment == "inside-a-checkpoint-write"
           else (lambda: state.exists() and not tmp.exists()))
    assert sigkill_when(proc, due, timeout_s=240, poll_s=0.0005), "the run ended before the kill moment came"
    had_state = state.exists()  # killed inside the first write: no earlier state to resume from
    assert not (out / "results.csv").exists()  # killed before the end
    resumed = subprocess.run(cmd("killed"), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("resumed from" in resumed.stdout) == had_state
    for name in ("a", "b"):
        want, got = _adapter_tensors(tmp_path / "straight" / "adapters" / name), \
            _adapter_tensors(out / "adapters" / name)
        assert want.keys() == got.keys() and len(want) > 0
        for k in want:
            assert torch.equal(want[k], got[k]), (name, k)
