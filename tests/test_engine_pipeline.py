"""LoRAPP: 2 pipeline stages on 2 processes (gloo) give the same per-job losses and adapters as one process."""

from __future__ import annotations

import pytest
import torch

from test_engine_utils import run_dict, write_alpaca


def test_schedule_simulation_bubbles():
    from bdlora.train.engine.packing import MicroBatch
    from bdlora.train.engine.pipeline import PMB, simulate_schedule, stage_bounds, theory_bubble

    assert stage_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    dummy = MicroBatch(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), [])

    def stream(jobs, steps, per_step=1):
        out = []
        for k in range(steps):
            for j in range(jobs):
                for _ in range(per_step):
                    out.append(PMB(len(out), j, k, dummy))
        return out

    for P in (2, 4):
        for L in (1, 2, 4, 8):
            ops, bubble = simulate_schedule(stream(L, 6), P)
            for s in range(P):  # every micro-batch forward then backward once on every stage
                assert sorted(m for k, m in ops[s] if k == "F") == list(range(6 * L))
                assert sorted(m for k, m in ops[s] if k == "B") == list(range(6 * L))
            if L == 1:
                assert bubble > 0.4  # one job: the pipeline mostly waits for its own previous step
        # more jobs never hurt; at L >= P the bubble is only the fill/drain of the run
        b1 = simulate_schedule(stream(1, 6), P)[1]
        bP = simulate_schedule(stream(2 * P, 6), P)[1]
        assert bP < b1 and bP < 0.2
    assert theory_bubble(4, 1) == 0.75 and theory_bubble(4, 8) == 0.0


def test_messages_use_one_group_per_direction():
    """Activations (towards later stages) on the forward group, gradients (towards earlier ones) on the backward
    group: one NCCL stream per direction, so 1F1B's crossing sends cannot wait on each other."""
    from bdlora.train.engine.pipeline import Stage

    calls = []

    class FakeDist:
        def isend(self, t, dst, group=None, tag=0):
            calls.append(("send", dst, group, tag))
            return object()

        def recv(self, buf, src, group=None, tag=0):
            calls.append(("recv", src, group, tag))

    st = object.__new__(Stage)  # only the message methods: no engine
    st.s, st.dist, st.dev, st.sends = 1, FakeDist(), torch.device("cpu"), []
    st.fwd_group, st.bwd_group = "fwd", "bwd"
    x = torch.zeros(2, 3).t()  # not contiguous: the contiguous copy is sent and kept until the send completes
    st._send(x, 2, 0)
    st._send(x, 0, 2)
    st._recv((2,), torch.float32, 0, 4)
    st._recv((2,), torch.float32, 2, 6)
    assert calls == [("send", 2, "fwd", 0), ("send", 0, "bwd", 2), ("recv", 0, "fwd", 4), ("recv", 2, "bwd", 6)]
    assert all(t.is_contiguous() for _, t in st.sends)


def test_init_distributed_binds_the_gpu_with_nccl(monkeypatch):
    import torch.distributed as dist

    from bdlora.train.engine.pipeline import init_distributed

    events = []

    def init_new(backend, device_id=None, **kw):  # a torch whose init_process_group takes device_id
        events.append(("init", backend, device_id, kw))

    def init_old(backend, **kw):  # an older torch without it
        events.append(("init", backend, None, kw))

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group", init_new)
    init_distributed("nccl", 1, rank=1, world_size=2)
    assert events == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1), {"rank": 1, "world_size": 2})]
    events.clear()
    init_distributed("gloo", 1, rank=1, world_size=2)  # CPU: no GPU selected, no device bound
    assert events == [("init", "gloo", None, {"rank": 1, "world_size": 2})]
    events.clear()
    monkeypatch.setattr(dist, "init_process_group", init_old)
    init_distributed("nccl", 0, rank=0, world_size=2)
    assert events == [("set_device", 0), ("init", "nccl", None, {"rank": 0, "world_size": 2})]


def test_p2p_groups_created_once_per_process_group(tmp_path):
    import torch.distributed as dist

    from bdlora.train.engine.pipeline import init_distributed, p2p_groups

    assert not dist.is_initialized()
    pairs = []
    for i in range(2):
        init_distributed("gloo", 0, init_method=f"file://{tmp_path / f'store{i}'}", rank=0, world_size=1)
        try:
            fwd, bwd = p2p_groups()
            assert fwd is not bwd and fwd is not dist.group.WORLD and bwd is not dist.group.WORLD
            assert p2p_groups() == (fwd, bwd)  # later pipeline runs reuse them
            pairs.append((fwd, bwd))
        finally:
            dist.destroy_process_group()
    assert pairs[1][0] is not pairs[0][0]  # a new default group: new message groups


@pytest.mark.slow
@pytest.mark.parametrize("eval_every", [10, 2])
def test_two_stage_pipeline_equals_single_process(tiny_llama_dir, tmp_path, eval_every):
    """eval_every=10 >= every job's steps: one segment (the whole run streamed, as before segments); eval_every=2:
    two segments with a drain and an evaluation between them, the same per-job results."""
    from bdlora import load_adapter
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine
    from bdlora.train.engine.launch import run_pipeline_spawn

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    jobs = [{"name": "a", "r": 4, "nblocks": 1, "seed": 1, "max_grad_norm": 0.05},
            {"name": "b", "r": 8, "nblocks": 2, "seed": 2, "scheduler": "cosine", "batch_size": 2, "grad_accum": 2},
            {"name": "c", "r": 8, "nblocks": 4, "seed": 3, "max_steps": 2}]
    kw = dict(token_budget=96, eval_every=eval_every,
              defaults={"max_steps": 3, "batch_size": 4, "lr": 1e-3, "max_length": 64})
    eng = Engine(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "single", jobs, **kw)))
    single = eng.run()
    res = run_pipeline_spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "pipe", jobs, pipeline_stages=2,
                                                **kw)))
    st = res["pipeline"]
    assert st["stages"] == 2 and st["microbatches"] > 8
    assert st["segments"] == (1 if eval_every == 10 else 2)
    assert 0.0 <= st["bubble_measured"] < 1.0 and st["bubble_theory_max_D_minus_L_over_D"] == 0.0
    peaks = st["peak_mem_gib_per_stage"]  # measured per stage on GPUs (NCCL), none on CPU (gloo)
    assert all(p > 0 for p in peaks) if torch.cuda.is_available() else peaks == [None, None]
    # each stage gives its memory model one measured peak per segment (GPU; CPU measures none)
    assert st["memory_points_per_stage"] == [st["segments"] if torch.cuda.is_available() else 0] * 2
    for job, row_s, row_p in zip(eng.jobs, single, res["jobs"]):
        # per-job, per-step train losses of the pipeline equal the single-process engine's
        assert res["train_losses"][job.name] == pytest.approx([l for _, l in job.history["train"]], rel=1e-5)
        assert row_p["steps"] == row_s["steps"]
        assert row_p["final_eval_loss"] == pytest.approx(row_s["final_eval_loss"], rel=1e-5)
        a, b = load_adapter(row_s["adapter"]), load_adapter(row_p["adapter"])
        assert set(a.modules) == set(b.modules)
        for p in a.modules:
            # Adam divides by sqrt(v): a near-zero gradient entry amplifies float-summation-order noise
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=1e-4, atol=2e-5)


@pytest.mark.slow
def test_data_parallel_two_processes_equal_one(tiny_llama_dir, tmp_path):
    """accelerate/torchrun-style data parallel: micro-batches split over 2 ranks, per-job grads all-reduced."""
    import json

    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import spawn
    from bdlora.train.engine.engine import Engine

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    jobs = [{"name": "a", "r": 4, "nblocks": 2, "seed": 1}, {"name": "b", "r": 8, "nblocks": 4, "seed": 2}]
    kw = dict(token_budget=96, defaults={"max_steps": 3, "batch_size": 4, "lr": 1e-3, "max_length": 64})
    one = Engine(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "one", jobs, **kw))).run()
    spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "two", jobs, **kw)), 2)
    two = json.loads((tmp_path / "two" / "results.json").read_text())["jobs"]
    for a, b in zip(one, two):
        assert b["steps"] == a["steps"] and b["tokens"] == a["tokens"]
        assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=1e-5)
        assert b["final_eval_loss"] == pytest.approx(a["final_eval_loss"], rel=1e-5)


# a job whose factors overflow: warm-up makes its first update a no-op (lr x 0), its second (lr 1e30) sends its
# activations to inf, so its loss is non-finite from step 2 and it exits there. Overflow does not depend on float
# noise; a merely huge lr (3, then 5) made the exit step depend on the torch thread count and the CPU (a
# fresh-clone CI run, 2026-11-26, saw it complete in one process and diverge in two). Two slots: "late" queues.
DIVERGE_EE = {"enabled": True, "warmup_select": False, "tau_gap": 1e9, "patience": 1}
DIVERGE_EXIT_STEP = 2
DIVERGE_JOBS = [{"name": "good", "seed": 1, "scheduler": "cosine"},
                {"name": "bad", "seed": 2, "lr": 1e30, "scheduler": "constant_with_warmup", "warmup_steps": 1},
                {"name": "late", "seed": 3, "r": 4, "nblocks": 2}]
DIVERGE_KW = dict(early_exit=DIVERGE_EE, eval_every=1, max_active_jobs=2, token_budget=96,
                  defaults={"max_steps": 6, "batch_size": 2, "lr": 1e-3, "max_length": 64})


def _pipeline(tiny_llama_dir, data, out, jobs=DIVERGE_JOBS, **kw):
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import run_pipeline_spawn

    return run_pipeline_spawn(parse_run(run_dict(tiny_llama_dir, data, out, jobs, pipeline_stages=2,
                                                 **{**DIVERGE_KW, **kw})))


@pytest.mark.slow
def test_pipeline_early_exit_and_backfill_match_single_process(tiny_llama_dir, tmp_path):
    import os

    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    eng = Engine(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "single", DIVERGE_JOBS, **DIVERGE_KW)))
    single = eng.run()
    res = _pipeline(tiny_llama_dir, data, tmp_path / "pipe")
    pipe = res["jobs"]
    assert [r["stop_reason"] for r in single] == ["completed", "diverging", "completed"]
    assert single[1]["steps"] == DIVERGE_EXIT_STEP
    for rs, rp in zip(single, pipe):  # same decisions: stop reason and step
        assert (rp["job"], rp["status"], rp["stop_reason"]) == (rs["job"], "done", rs["stop_reason"])
        assert rp["steps"] == rs["steps"] and rp["tokens"] == rs["tokens"] and os.path.isdir(rp["adapter"])
    for job in (0, 2):  # the well-behaved jobs: same losses, untouched by the inf/NaN rows beside theirs
        name = single[job]["job"]
        assert res["train_losses"][name] == pytest.approx([l for _, l in eng.jobs[job].history["train"]], rel=1e-5)
        assert pipe[job]["final_eval_loss"] == pytest.approx(single[job]["final_eval_loss"], rel=1e-5)
    # one step per segment (eval_every=1); "late" waits for a slot and enters in the segment after "bad" exits
    segs = [r["jobs"] for r in res["rounds"]]
    exit_step = pipe[1]["steps"]
    assert all(len(j) <= 2 for j in segs) and res["pipeline"]["segments"] == len(segs)
    assert segs[:exit_step] == [["good", "bad"]] * exit_step
    assert segs[exit_step] == ["good", "late"]
    assert len(segs) == exit_step + 6  # "late" runs its 6 steps after "bad" left
    # GPU: >= 5 segments of measured per-stage peaks refit each stage's memory model (admission learns from them)
    st = res["pipeline"]
    if torch.cuda.is_available():
        assert st["memory_points_per_stage"] == [len(segs)] * 2 and st["memory_fitted_per_stage"] == [True, True]
    else:
        assert st["memory_points_per_stage"] == [0, 0] and st["memory_fitted_per_stage"] == [False, False]


@pytest.mark.slow
def test_pipeline_resume_equals_uninterrupted(tiny_llama_dir, tmp_path):
    from bdlora import load_adapter

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    # early exit across the resume point ("bad" exits at step 2), a queued job, a cosine schedule, LoRA dropout
    jobs = DIVERGE_JOBS[:2] + [{**DIVERGE_JOBS[2], "lora_dropout": 0.1}]
    full = _pipeline(tiny_llama_dir, data, tmp_path / "full", jobs)
    assert [r["stop_reason"] for r in full["jobs"]] == ["completed", "diverging", "completed"]
    kw = dict(jobs=jobs, resume="auto", save_every=1)
    before = DIVERGE_EXIT_STEP - 1
    part = _pipeline(tiny_llama_dir, data, tmp_path / "part", max_rounds=before, **kw)  # stops a segment before the exit
    assert [r["status"] for r in part["jobs"]] == ["active", "active", "queued"]
    assert [r["steps"] for r in part["jobs"]] == [before, before, 0]
    state = tmp_path / "part" / "pipeline_state"
    assert sorted(p.name for p in state.iterdir()) == ["run_state.pt"] + [f"stage{i}.seg{before}.pt" for i in (0, 1)]
    rest = _pipeline(tiny_llama_dir, data, tmp_path / "part", **kw)
    seg = lambda r: (r["round"], r["segment"], r["jobs"], r["tokens"], r["microbatches"], r["evals"])  # noqa: E731
    assert [seg(r) for r in rest["rounds"]] == [seg(r) for r in full["rounds"]]  # the same segments
    for r, f in zip(rest["jobs"], full["jobs"]):
        assert (r["stop_reason"], r["steps"], r["tokens"]) == (f["stop_reason"], f["steps"], f["tokens"])
        # nan_ok: on a GPU the diverging job's loss can reach NaN (2x H200, NCCL, 2026-11-22): then in both runs
        assert r["final_eval_loss"] == pytest.approx(f["final_eval_loss"], rel=1e-6, nan_ok=True)
        assert rest["train_losses"][r["job"]] == pytest.approx(full["train_losses"][f["job"]], rel=1e-6, nan_ok=True)
        a, b = load_adapter(r["adapter"]), load_adapter(f["adapter"])
        assert set(a.modules) == set(b.modules)
        for p in a.modules:
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=0, atol=1e-7)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_auto_token_budget_is_one_value_on_every_rank(tiny_llama_dir, tmp_path):
    """`token_budget: auto` under data parallel and under pipeline stages: the ranks agree on one budget at start
    (the smallest of their choices, one collective), pack the same micro-batches and record it in results.json."""
    import json

    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import run_pipeline_spawn, spawn

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    jobs = [{"name": "a", "r": 4, "seed": 1}, {"name": "b", "r": 8, "nblocks": 2, "seed": 2}]
    kw = dict(token_budget="auto", memory_budget_gb=1000.0,  # a limit: the ladder, as on a GPU
              defaults={"max_steps": 2, "batch_size": 4, "lr": 1e-3, "max_length": 64})
    step_tokens = 2 * 4 * 64  # one step of both jobs: the smallest size holding it
    spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "dp", jobs, **kw)), 2)
    dp = json.loads((tmp_path / "dp" / "results.json").read_text())
    assert dp["token_budget"] == step_tokens and all(r["steps"] == 2 for r in dp["jobs"])
    res = run_pipeline_spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "pipe", jobs, pipeline_stages=2,
                                                **kw)))
    assert res["token_budget"] == step_tokens and all(r["steps"] == 2 for r in res["jobs"])


@pytest.mark.slow
def test_pipeline_with_gradient_checkpointing_trains_what_it_trains_without(tiny_llama_dir, tmp_path):
    """Each stage recomputes its decoder layers in the backward of a micro-batch, after other micro-batches' forwards
    ran on it: the stage sets that micro-batch's rows again, and the checkpoint replays its LoRA-dropout masks, so
    the losses and adapters equal those of the same pipeline without checkpointing."""
    from bdlora import load_adapter
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import run_pipeline_spawn

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    jobs = [{"name": "a", "r": 4, "nblocks": 1, "seed": 1, "lora_dropout": 0.1},
            {"name": "b", "r": 8, "nblocks": 2, "seed": 2}]
    kw = dict(token_budget=96, pipeline_stages=2,
              defaults={"max_steps": 3, "batch_size": 4, "lr": 1e-3, "max_length": 64})
    plain = run_pipeline_spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "plain", jobs, **kw)))
    ckpt = run_pipeline_spawn(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "ckpt", jobs,
                                                 gradient_checkpointing=True, **kw)))
    assert ckpt["pipeline"]["microbatches"] == plain["pipeline"]["microbatches"] > 4
    for row_p, row_c in zip(plain["jobs"], ckpt["jobs"]):
        assert ckpt["train_losses"][row_c["job"]] == pytest.approx(plain["train_losses"][row_p["job"]], rel=1e-6)
        a, b = load_adapter(row_p["adapter"]), load_adapter(row_c["adapter"])
        for p in a.modules:
            torch.testing.assert_close(a.modules[p].lora_A, b.modules[p].lora_A, rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(a.modules[p].lora_B, b.modules[p].lora_B, rtol=1e-5, atol=1e-7)
