"""BatchLoRA: every job trained together equals the same job trained alone (PEFT), outputs load in PEFT."""

from __future__ import annotations

import csv

import pytest
import torch

from test_engine_utils import peft_train_alone, run_dict, write_alpaca

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_alpaca(tmp_path_factory.mktemp("data") / "rev.jsonl", n=30)


JOBS = [
    {"name": "r4-n1", "r": 4, "nblocks": 1, "lr": 2e-3, "scheduler": "cosine", "seed": 1},
    {"name": "r8-n2", "r": 8, "nblocks": 2, "lr": 1e-3, "batch_size": 2, "grad_accum": 2, "seed": 2,
     "max_grad_norm": 0.05, "a_init": "peft"},
    {"name": "r8-n4", "r": 8, "nblocks": 4, "lr": 3e-3, "scheduler": "linear", "warmup_steps": 1, "seed": 3,
     "target_modules": ["q_proj", "v_proj", "down_proj"]},
]


@pytest.mark.parametrize("backend", ["auto", "engine", "cublas", "auto/rows-of-one-sample", "auto/one-row"])
def test_batchlora_equals_training_alone(tiny_llama_dir, data_file, tmp_path, backend, monkeypatch):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from bdlora import load_adapter, save_adapter
    from bdlora.train.engine import packing, parse_run
    from bdlora.train.engine.data import EpochSampler
    from bdlora.train.engine.engine import Engine
    from bdlora.train.engine.multilora import JobAdapter

    backend, _, layout = backend.partition("/")
    if layout == "rows-of-one-sample":  # rows no longer than the longest sample: a job's samples span several rows
        monkeypatch.setattr(packing, "MIN_ROW_TOKENS", 1)
    elif layout == "one-row":  # attention example by example (its reference route here): every job in one row
        monkeypatch.setattr("bdlora.train.engine.engine.packed_attention_supported", lambda device: True)
        monkeypatch.setattr("bdlora.train.engine.engine.packed_attention_fits", lambda model: True)
    if layout:
        built = []
        build = packing.build_microbatch
        monkeypatch.setattr("bdlora.train.engine.engine.build_microbatch",
                            lambda *a, **k: built.append(build(*a, **k)) or built[-1])

    # in one row (no padding to the longest row) two jobs' steps share a micro-batch under a larger budget
    run = parse_run(run_dict(tiny_llama_dir, data_file, tmp_path / "run", JOBS, lora_backend=backend,
                             token_budget=320 if layout == "one-row" else 160, save_plots=True))
    eng = Engine(run)
    rows = eng.run()
    assert [r["stop_reason"] for r in rows] == ["completed"] * 3
    # several micro-batches per round, mixing jobs: the packing really splits steps
    assert any(r["microbatches"] > 1 for r in eng.round_log)
    if layout == "rows-of-one-sample":
        assert any(mb.input_ids.shape[0] > len(mb.segments) for mb in built)
    elif layout == "one-row":
        assert all(mb.input_ids.shape[0] == 1 for mb in built) and any(len(mb.segments) > 1 for mb in built)
    for job in eng.jobs:
        cfg = job.cfg
        spec = cfg.spec("llama")
        targets = {n: t for n, t in eng.targets.items() if n.rsplit(".", 1)[-1] in spec.target_modules}
        init = JobAdapter(spec, targets, seed=cfg.seed, a_init=cfg.a_init)
        init_dir = tmp_path / f"init-{cfg.name}"
        save_adapter(init.to_adapter(str(tiny_llama_dir)), init_dir)
        sampler = EpochSampler(len(job.data.train), cfg.step_samples, seed=cfg.seed)
        model, losses = peft_train_alone(tiny_llama_dir, init_dir, cfg, job.data.train, job.total_steps, sampler)
        # per-step train losses equal
        got = [l for _, l in job.history["train"]]
        assert got == pytest.approx(losses, rel=1e-5, abs=1e-6)
        # parameters equal (the saved folder is the engine's final state)
        ref = get_peft_model_state_dict(model)
        saved = load_adapter(rows[job.id]["adapter"])
        assert set(ref) == {p + s for p in saved.modules for s in (".lora_A.weight", ".lora_B.weight")}
        for p, f in saved.modules.items():
            # fp32: summation order differs (packed vs padded batches); Adam divides by sqrt(v), so an entry whose
            # gradient is ~0 can move by a few % of lr from that noise. Everything else matches to ~1e-7.
            torch.testing.assert_close(f.lora_A, ref[p + ".lora_A.weight"], rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(f.lora_B, ref[p + ".lora_B.weight"], rtol=1e-4, atol=2e-5)
            close = torch.isclose(f.lora_B, ref[p + ".lora_B.weight"], rtol=1e-5, atol=1e-6)
            assert close.float().mean() > 0.999
            assert f.lora_B.abs().max() > 0  # it trained
        # the engine's folder loads in PEFT and reproduces the alone-trained model's outputs
        if backend == "auto":
            base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
            peft_loaded = PeftModel.from_pretrained(base, rows[job.id]["adapter"]).eval()
            ids = torch.tensor([job.data.val[0].input_ids])
            with torch.no_grad():
                torch.testing.assert_close(peft_loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                                           rtol=1e-4, atol=1e-5)
    # outputs: results table and plots
    with open(tmp_path / "run" / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["job"] for r in table] == [j["name"] for j in JOBS]
    assert all(int(r["tokens"]) > 0 and r["best_eval_loss"] for r in table)
    try:
        import matplotlib  # noqa: F401

        assert all((tmp_path / "run" / "plots" / f"{j['name']}.png").is_file() for j in JOBS)
    except ImportError:
        pass


def test_a_diverging_job_cannot_contaminate_the_others(tiny_llama_dir, data_file, tmp_path):
    """inf activations of one job (huge factors) leave every other job of the same micro-batches untouched."""
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    jobs = [{"name": "bad", "r": 4, "seed": 1, "lr": 1e-3}, {"name": "good", "r": 8, "nblocks": 2, "seed": 2}]
    eng = Engine(parse_run(run_dict(tiny_llama_dir, data_file, tmp_path / "a", jobs, eval_every=1)))
    eng.admit()
    with torch.no_grad():
        for p in eng.jobs[0].adapter.b.values():
            p.fill_(1e38)
    info = eng.train_round()
    assert not torch.isfinite(torch.tensor(info["jobs"]["bad"]["loss"]))
    eng.after_step()
    assert eng.jobs[0].reason == "diverging"
    alone = Engine(parse_run(run_dict(tiny_llama_dir, data_file, tmp_path / "b", jobs[1:], eval_every=1)))
    alone.admit()
    ref = alone.train_round()
    assert info["jobs"]["good"]["loss"] == pytest.approx(ref["jobs"]["good"]["loss"], rel=1e-6)
    for (k, p), (_, q) in zip(eng.jobs[1].adapter.named_parameters(), alone.jobs[0].adapter.named_parameters()):
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)  # Adam-normalized float noise only
