"""Engine pieces without a model: packing, epoch sampler, early-exit rules, search expansion, memory model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from bdlora.train.engine import EarlyExit, Item, MemoryModel, JobFootprint, pack_ffd, parse_run, select_after_warmup
from bdlora.train.engine.data import EpochSampler
from bdlora.train.engine.early_exit import DIVERGING, OVERFITTING, linreg_slope
from bdlora.train.engine.packing import bin_cost, long_tensor


# ---------------------------------------------------------------------------------------------- packing
def _items(seed=0, jobs=4, per_job=30, max_len=100):
    rng = random.Random(seed)
    return [Item(j, i, rng.randint(1, max_len)) for j in range(jobs) for i in range(per_job)]


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("pad", [1, 8])
def test_ffd_every_item_once_within_budget(pad, one_row):
    items = _items()
    bins = pack_ffd(items, budget=256, pad_multiple=pad, one_row=one_row)
    flat = [it for b in bins for it in b]
    assert sorted(flat, key=lambda it: (it.job, it.index)) == sorted(items, key=lambda it: (it.job, it.index))
    for b in bins:
        per_job = {}
        for it in b:
            per_job.setdefault(it.job, []).append(it.length)
        assert bin_cost(per_job, pad, one_row) <= 256
        # one contiguous segment per job, jobs in order
        jobs = [it.job for it in b]
        assert jobs == sorted(jobs)
    # close to the token lower bound (rows of 4 jobs padded to the longest cost a little)
    lower = math.ceil(sum(it.length for it in items) / 256)
    assert len(bins) <= math.ceil(1.5 * lower) + 1


def test_ffd_deterministic_and_order_independent_of_python_hash():
    items = _items(seed=3)
    assert pack_ffd(items, 200) == pack_ffd(list(items), 200)
    # rows are per job: two jobs of 5 tokens with pad 8 cost 2 rows of 8, one job of 10 tokens one row of 16
    assert bin_cost({0: [5], 1: [5]}, 8) == 16 and bin_cost({0: [10]}, 8) == 16
    # short samples share a row up to MIN_ROW_TOKENS; long ones get rows of their own
    assert bin_cost({0: [200, 200, 100]}) == 500 and bin_cost({0: [300, 300]}) == 600
    assert bin_cost({0: [2048, 2048]}) == 2 * 2048 and bin_cost({0: [2048, 1000, 1000]}) == 2 * 2048


def test_ffd_keeps_each_job_that_fits_in_one_microbatch():
    """Jobs whose step fits a bin are never split (segments = jobs: each segment costs LoRA launches per layer);
    a job larger than a bin spans about as few bins as its tokens need, and the others fill its last bin."""
    rng = random.Random(1)
    items = [Item(j, i, rng.randint(60, 130)) for j in range(8) for i in range(8)]  # ~760 tokens a job
    bins = pack_ffd(items, budget=4096, pad_multiple=64)
    segments = [(b_i, it.job) for b_i, b in enumerate(bins) for it in b]
    assert len(set(segments)) == 8 and len(bins) == 2
    big = [Item(9, i, 100) for i in range(25)]  # 2500 tokens, budget 1024: 3 bins at best, the last 500 tokens
    small = [Item(5, i, 100) for i in range(4)]  # 400 tokens: fits beside it (2 rows x 500 <= 1024)
    bins = pack_ffd(items[:16] + big + small, budget=1024, pad_multiple=1)
    assert sum(any(it.job == 9 for it in b) for b in bins) == 3
    for j in (0, 1, 5):  # each in one bin
        assert sum(any(it.job == j for it in b) for b in bins) == 1
    assert any({it.job for it in b} == {5, 9} for b in bins)


def _samples(lengths, seed):
    """Fake samples: distinct token ids, every token after the first a target (mask 1)."""
    from types import SimpleNamespace

    rng = random.Random(seed)
    return [SimpleNamespace(input_ids=[rng.randint(1, 999) for _ in range(n)], loss_mask=[0] + [1] * (n - 1))
            for n in lengths]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_microbatch_targets_follow_each_samples_loss_mask(seed):
    """With response-only loss masks, a job's targets are exactly the masked tokens of its samples, each predicted
    from the position before it in its row (a per-token reference built from the rows' position-id restarts)."""
    from bdlora.train.engine.data import Sample
    from bdlora.train.engine.packing import build_microbatch, plan_microbatches

    rng = random.Random(seed)
    samples = {j: [Sample([rng.randrange(1, 30000) for _ in range(n)], [rng.random() < 0.5 for _ in range(n)])
                   for n in (rng.randint(1, 400) for _ in range(9))] for j in range(3)}
    reqs = [(j, list(range(9))) for j in range(3)]
    for b in plan_microbatches(reqs, lambda j: [len(x) for x in samples[j]], budget=3000, pad_multiple=8):
        mb = build_microbatch(b, lambda j: samples[j], pad_id=0, pad_multiple=8)
        rows, L = mb.input_ids.shape
        by_ids = {tuple(x.input_ids): x for xs in samples.values() for x in xs}
        for job, start, end in mb.segments:
            want_pos, want_lab = [], []
            for r in range(start // L, end // L):
                p, ids = mb.position_ids[r].tolist(), mb.input_ids[r].tolist()
                cuts = [i for i in range(L) if p[i] == 0] + [L]
                for a, c in zip(cuts, cuts[1:]):
                    sample = by_ids.get(tuple(ids[a:c]))
                    if sample is None:
                        continue  # the row's padding sequence
                    for t in range(1, c - a):
                        if sample.loss_mask[t]:
                            want_pos.append(r * L + a + t - 1)
                            want_lab.append(ids[a + t])
            pos, lab = mb.targets[job]
            assert pos.dtype == lab.dtype == torch.long
            assert pos.tolist() == want_pos and lab.tolist() == want_lab


@pytest.mark.parametrize("pad", [1, 64])
def test_microbatch_rows_are_what_the_packer_paid_for(pad):
    """The built block is exactly bin_cost's size, rows never mix jobs, each job is one contiguous segment, and every
    target is the token after its position in that job's own sample."""
    from bdlora.train.engine.packing import build_microbatch, plan_microbatches

    rng = random.Random(7)
    lengths = {j: [rng.choice([rng.randint(5, 300), rng.randint(600, 1500)]) for _ in range(12)] for j in range(5)}
    samples = {j: _samples(ls, j) for j, ls in lengths.items()}
    reqs = [(j, list(range(12))) for j in range(5)]
    for b in plan_microbatches(reqs, lambda j: lengths[j], budget=6000, pad_multiple=pad):
        mb = build_microbatch(b, lambda j: samples[j], pad_id=0, pad_multiple=pad)
        per_job = {}
        for it in b:
            per_job.setdefault(it.job, []).append(it.length)
        assert mb.num_tokens == bin_cost(per_job, pad) <= 6000
        rows, L = mb.input_ids.shape
        assert L % pad == 0 and [j for j, _, _ in mb.segments] == sorted(per_job)
        assert mb.segments[0][1] == 0 and all(a[2] == b_[1] for a, b_ in zip(mb.segments, mb.segments[1:]))
        flat = mb.input_ids.flatten()
        for job, start, end in mb.segments:
            assert start % L == 0 and end % L == 0  # whole rows
            pos, lab = mb.targets[job]
            assert ((pos >= start) & (pos < end)).all() and torch.equal(flat[pos + 1], lab)
            assert len(lab) == sum(n - 1 for n in per_job[job])
            ids = flat[start:end].tolist()
            want = sorted(tuple(samples[job][it.index].input_ids) for it in b if it.job == job)
            got = []  # the job's samples, cut out of its rows by the position ids' restarts
            for r in range(start // L, end // L):
                p = mb.position_ids[r].tolist()
                starts = [i for i in range(L) if p[i] == 0] + [L]
                got += [tuple(ids[(r - start // L) * L + a:(r - start // L) * L + c]) for a, c in zip(starts, starts[1:])]
            assert sorted(g for g in got if any(g)) == want  # the padding sequences are all pad_id


@pytest.mark.parametrize("pad", [1, 64])
def test_one_row_microbatch_is_what_the_packer_paid_for(pad):
    """``one_row`` (attention example by example): one row of exactly bin_cost's size; each job one contiguous
    segment, aligned to ``pad``, holding its samples end to end and then padding that is a sequence of its own
    (all pad_id, no targets); the targets are the masked tokens of each sample predicted from the position before;
    the attention boundaries mark every sample and padding piece."""
    from bdlora.train.engine.data import Sample
    from bdlora.train.engine.packing import build_microbatch, plan_microbatches

    rng = random.Random(11)
    samples = {j: [Sample([rng.randrange(1, 30000) for _ in range(n)], [rng.random() < 0.5 for _ in range(n)])
                   for n in (rng.choice([rng.randint(1, 300), rng.randint(600, 1500)]) for _ in range(12))]
               for j in range(5)}
    reqs = [(j, list(range(12))) for j in range(5)]
    bins = plan_microbatches(reqs, lambda j: [len(x) for x in samples[j]], budget=6000, pad_multiple=pad,
                             one_row=True)
    assert sorted((it.job, it.index) for b in bins for it in b) == [(j, i) for j in range(5) for i in range(12)]
    for b in bins:
        mb = build_microbatch(b, lambda j: samples[j], pad_id=0, pad_multiple=pad, one_row=True)
        per_job = {}
        for it in b:
            per_job.setdefault(it.job, []).append(it.length)
        rows, L = mb.input_ids.shape
        assert rows == 1 and mb.num_tokens == bin_cost(per_job, pad, one_row=True) <= 6000
        assert [j for j, _, _ in mb.segments] == sorted(per_job) and mb.segments[0][1] == 0
        assert all(a[2] == b_[1] for a, b_ in zip(mb.segments, mb.segments[1:])) and mb.segments[-1][2] == L
        ids, pos = mb.input_ids[0].tolist(), mb.position_ids[0].tolist()
        cuts = [i for i in range(L) if pos[i] == 0] + [L]
        assert mb.attention_kwargs["cu_seq_lens_q"].tolist() == cuts
        for job, start, end in mb.segments:
            assert start % pad == 0 and end % pad == 0 and end - start < sum(per_job[job]) + pad
            pieces = [(a, c) for a, c in zip(cuts, cuts[1:]) if start <= a < end]
            got = [tuple(ids[a:c]) for a, c in pieces[:len(per_job[job])]]
            want = [tuple(samples[job][it.index].input_ids) for it in b if it.job == job]
            assert got == want  # the job's samples in order, end to end
            assert all(t == 0 for a, c in pieces[len(per_job[job]):] for t in ids[a:c])  # then its padding
            want_pos, want_lab = [], []
            for (a, c), sample_ids in zip(pieces, want):
                mask = samples[job][next(it.index for it in b if it.job == job
                                         and tuple(samples[job][it.index].input_ids) == sample_ids)].loss_mask
                for t in range(1, c - a):
                    if mask[t]:
                        want_pos.append(a + t - 1)
                        want_lab.append(ids[a + t])
            tp, tl = mb.targets[job]
            assert tp.tolist() == want_pos and tl.tolist() == want_lab


def test_long_tensor_is_torch_tensor_of_the_ids():
    """The collators' list -> int64 conversion (through numpy): the same values, shape and dtype as torch.tensor,
    for a row, rows of one length, and nothing; writable and not sharing the list."""
    for values in ([5, 0, 31999, 7], [[1, 2, 3], [4, 5, 6]], []):
        t = long_tensor(values)
        assert t.dtype == torch.long and torch.equal(t, torch.tensor(values, dtype=torch.long))
    t = long_tensor([1, 2])
    t[0] = 9
    assert t.tolist() == [9, 2]


@pytest.mark.parametrize("one_row", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_packer_bins_cost_exactly_bin_cost(seed, one_row):
    """The packer's incremental cost of a trial (one job's rows refilled, a short sample first-fit, every job recounted
    when the cap rises; in one row, each job's tokens rounded up) is bin_cost of the lengths: a budget of exactly
    that cost admits it, one token less refuses."""
    from bdlora.train.engine.packing import _Bin

    rng = random.Random(seed)
    b, lengths = _Bin(one_row), {}
    for step in range(40):
        job = rng.randrange(4)
        if rng.random() < 0.5 and lengths.get(job):  # the item path: a sample no longer than the job's others
            new = [rng.randint(1, min(lengths[job]))]
        else:
            new = [rng.choice([rng.randint(1, 300), rng.randint(300, 1200)]) for _ in range(rng.randint(1, 6))]
        trial = {**lengths, job: lengths.get(job, []) + new}
        cost = bin_cost(trial, 8, one_row)
        assert not b.add(job, [step], new, cost - 1, 8, {})
        assert b.add(job, [step], new, cost, 8, {})
        lengths = trial


def test_long_samples_get_rows_of_their_own():
    """Two 2048-token samples of one job: two rows of plain causal positions (no packed sequence, so attention keeps
    its fused causal kernel and costs half of one 4096-token row); short samples still share rows."""
    from bdlora.train.engine.packing import MIN_ROW_TOKENS, build_microbatch, plan_microbatches

    samples = _samples([2048, 2048], 0)
    (b,) = plan_microbatches([(0, [0, 1])], lambda j: [2048, 2048], budget=4096)
    mb = build_microbatch(b, lambda j: samples, pad_id=0)
    assert mb.input_ids.shape == (2, 2048) and mb.segments == [(0, 0, 4096)]
    assert torch.equal(mb.position_ids, torch.arange(2048).expand(2, -1))
    short = _samples([100] * 10, 1)
    (b,) = plan_microbatches([(0, list(range(10)))], lambda j: [100] * 10, budget=4096)
    mb = build_microbatch(b, lambda j: short, pad_id=0)
    assert MIN_ROW_TOKENS == 512 and mb.input_ids.shape == (2, 500)  # five samples a row


def test_epoch_sampler_uses_every_sample_once_per_epoch():
    s = EpochSampler(23, batch_size=5, seed=7)
    for epoch in range(3):
        seen = []
        for _ in range(s.batches_per_epoch):
            seen += s.next_batch()
        assert sorted(seen) == list(range(23)), epoch
    # resumable: same continuation after a state round-trip
    a = EpochSampler(23, 5, seed=7)
    for _ in range(7):
        a.next_batch()
    b = EpochSampler(23, 5, seed=7)
    b.load_state_dict(a.state_dict())
    assert [a.next_batch() for _ in range(6)] == [b.next_batch() for _ in range(6)]


def test_engine_round_packing_uses_each_train_sample_once_per_epoch(tmp_path):
    """Across the packed micro-batches of several jobs, an epoch covers every training sample exactly once."""
    from bdlora.train.engine.packing import plan_microbatches

    lengths = {0: [random.Random(0).randint(3, 40) for _ in range(17)], 1: [7] * 9, 2: list(range(5, 30))}
    samplers = {j: EpochSampler(len(v), bs, seed=j) for (j, v), bs in zip(lengths.items(), (4, 3, 6))}
    used = {j: [] for j in lengths}
    for _ in range(6):  # 6 rounds: >= 1 epoch of every job
        reqs = [(j, s.next_batch()) for j, s in samplers.items()]
        for b in plan_microbatches(reqs, lambda j: lengths[j], budget=64, pad_multiple=4):
            for it in b:
                used[it.job].append(it.index)
    for j, v in lengths.items():
        n = len(v)
        first_epoch = used[j][:n]
        assert sorted(first_epoch) == list(range(n))


# ---------------------------------------------------------------------------------------------- early exit
def _feed(det, train, val, every=1):
    for step, (t, v) in enumerate(zip(train, val), 1):
        det.report_train(step, t)
        if v is not None:
            det.report(step, v)
        if det.should_stop():
            return step
    return None


def test_linreg_slope():
    assert linreg_slope([1.0, 2.0]) == pytest.approx(1.0)
    assert linreg_slope([3.0, 2.0, 1.0]) == pytest.approx(-1.0)


def test_divergence_rule_needs_both_slopes_for_p_evaluations():
    det = EarlyExit(window=2, patience=2, tau_slope=0.001, ema_alpha=1.0)
    curve = [2.0, 1.8, 1.7, 1.9, 2.3, 2.9, 3.5]
    stop = _feed(det, curve, curve)
    assert det.reason == DIVERGING
    assert stop == 5  # rising at steps 4 and 5 -> two consecutive evaluations
    # only train rising (val falling): no divergence
    det2 = EarlyExit(ema_alpha=1.0, tau_gap=10)
    assert _feed(det2, [1, 2, 3, 4, 5], [5, 4, 3, 2, 1]) is None
    # transient spike resets the counter
    det3 = EarlyExit(ema_alpha=1.0, tau_gap=10)
    assert _feed(det3, [2, 2.5, 2.0, 2.4, 2.0, 2.4], [2, 2.5, 2.0, 2.4, 2.0, 2.4]) is None


def test_overfitting_rule_and_best_checkpoint():
    det = EarlyExit(window=2, patience=2, tau_gap=0.1, ema_alpha=1.0)
    train = [2.0, 1.6, 1.3, 1.1, 0.9, 0.7, 0.5]
    val = [2.0, 1.65, 1.4, 1.45, 1.5, 1.6, 1.7]
    stop = _feed(det, train, val)
    assert det.reason == OVERFITTING
    # gap (val - ema)/ema > 0.1 first at step 3 (1.4 vs 1.3 = 0.077 no), step 4 (0.318), step 5 -> stop at 5
    assert stop == 5
    assert det.best_step == 3 and det.best_value == pytest.approx(1.4)


def test_nan_loss_is_divergence_and_state_roundtrip():
    det = EarlyExit()
    det.report_train(1, float("nan"))
    assert det.should_stop() and det.reason == DIVERGING
    a = EarlyExit(ema_alpha=0.5)
    _feed(a, [3, 2, 1], [3, 2, 1])
    b = EarlyExit()
    b.load_state_dict(a.state_dict())
    assert b.ema == a.ema and b.val_hist == a.val_hist and b.ema_alpha == 0.5


def test_warmup_top_k_selection():
    vals = {f"j{i}": v for i, v in enumerate([3.0, 1.0, 2.0, float("nan"), 1.5, 4.0, 2.5, 0.9])}
    kept, evicted = select_after_warmup(vals, keep_ratio=0.25)
    assert kept == ["j7", "j1"] and len(evicted) == 6 and evicted[-1] == "j3"
    kept, _ = select_after_warmup({"a": 1.0, "b": 2.0, "c": 3.0}, 0.25)
    assert kept == ["a"]  # ceil(0.75) = 1


# ---------------------------------------------------------------------------------------------- config
def test_search_space_grid_and_random(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "x", "output": "y"}\n')
    run = parse_run({
        "model": "m", "output_dir": "out", "train_file": str(data), "max_steps": 5, "max_length": 64,
        "jobs": [{"name": "fixed", "r": 4, "nblocks": 2}],
        "search": [{"name": "g", "type": "grid", "space": {"lr": [1e-4, 1e-3], "r": [4, 8], "nblocks": [1, 2]}},
                   {"name": "rnd", "type": "random", "num_samples": 5, "seed": 1,
                    "space": {"lr": {"low": 1e-5, "high": 1e-3, "log": True}, "r": [8, 16]}}],
    })
    assert len(run.jobs) == 1 + 8 + 5
    assert run.jobs[0].r == 4 and run.jobs[0].nblocks == 2
    grid = [j for j in run.jobs if j.group == "g"]
    assert {(j.lr, j.r, j.nblocks) for j in grid} == {(a, b, c) for a in (1e-4, 1e-3) for b in (4, 8)
                                                    for c in (1, 2)}
    rnd = [j for j in run.jobs if j.group == "rnd"]
    assert all(1e-5 <= j.lr <= 1e-3 and j.r in (8, 16) for j in rnd)
    assert all(j.train_file == str(data) and j.max_steps == 5 for j in run.jobs)


def test_config_errors(tmp_path):
    from bdlora.train.engine import ConfigError

    base = {"model": "m", "output_dir": "o", "train_file": "x.jsonl"}

    def parse(d):
        return parse_run(d, check_paths=False)

    with pytest.raises(ConfigError, match="unknown key.*'rnak'"):
        parse({**base, "jobs": [{"name": "a", "rnak": 3}]})
    with pytest.raises(ConfigError, match="not divisible"):
        parse({**base, "jobs": [{"name": "a", "r": 6, "nblocks": 4}]})
    with pytest.raises(ConfigError, match="token_budget"):
        parse({**base, "token_budget": 100, "jobs": [{"name": "a", "max_length": 512}]})
    with pytest.raises(ConfigError, match="duplicate"):
        parse({**base, "jobs": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ConfigError, match="lora_dropout: must be in"):
        parse({**base, "jobs": [{"name": "a", "lora_dropout": 1.0}]})
    for bad in (0, -64, 1.5, True):
        with pytest.raises(ConfigError, match="pad_multiple: must be"):
            parse({**base, "pad_multiple": bad, "jobs": [{"name": "a"}]})
    assert parse({**base, "jobs": [{"name": "a"}]}).pad_multiple is None  # auto: the engine picks by device
    with pytest.raises(ConfigError, match=r"lora_backend: must be one of \['auto', 'cublas', 'triton', 'torch', "
                                          r"'engine'\] .*, got 'cuda'"):
        parse({**base, "lora_backend": "cuda", "jobs": [{"name": "a"}]})
    with pytest.raises(ConfigError, match=r"`peft`, PEFT's layer, is a `bdlora train` choice.*got 'peft'"):
        parse({**base, "lora_backend": "peft", "jobs": [{"name": "a"}]})
    assert parse({**base, "lora_backend": "cublas", "jobs": [{"name": "a"}]}).lora_backend == "cublas"
    # dropout is supported: a per-job p, parsed as float and carried into the job's spec
    run = parse({**base, "jobs": [{"name": "a", "lora_dropout": "0.1"}, {"name": "b"}]})
    assert [j.lora_dropout for j in run.jobs] == [0.1, 0.0]
    assert run.jobs[0].spec("llama").lora_dropout == 0.1


# ---------------------------------------------------------------------------------------------- memory model
def test_memory_model_fit_recovers_coefficients():
    m = MemoryModel()
    true = dict(b0=5e8, b1=2e5, b2=3.0, bpp=20.0, brt=10.0)
    rng = random.Random(0)
    for _ in range(12):
        t = rng.choice([512, 1024, 2048, 4096])
        jobs = [JobFootprint(f"j{i}", rng.randint(100_000, 1_000_000), rng.choice([56, 112, 224])) for i in range(rng.randint(1, 6))]
        y = (true["b0"] + true["b1"] * t + true["b2"] * t * t + sum(true["bpp"] * j.params + true["brt"] * j.rank_sum * t
                                                                   for j in jobs))
        m.observe(t, jobs, y)
    assert m.fit()
    jobs = [JobFootprint("x", 500_000, 112)]
    want = true["b0"] + true["b1"] * 3000 + true["b2"] * 9e6 + true["bpp"] * 500_000 + true["brt"] * 112 * 3000
    assert m.predict(3000, jobs) == pytest.approx(want, rel=1e-3)


def test_memory_model_counts_lora_dropout_keep_masks():
    # lora_dropout > 0 stores a one-byte keep-mask per LoRA input element until backward (int8 in the grouped
    # kernel over every row of the module call, bool per job's rows on the torch paths): the model adds
    # T * sum(d_in) bytes per module that any dropout job adapts, once per module, not per job
    from bdlora.train.engine.jobs import Job

    base = {"model": "m", "output_dir": "o", "train_file": "x.jsonl", "nblocks": 1}
    run = parse_run({**base, "jobs": [{"name": "drop", "lora_dropout": 0.1}, {"name": "nodrop"},
                                      {"name": "drop2", "lora_dropout": 0.2, "r": 16},
                                      {"name": "nodrop2", "r": 16},
                                      {"name": "drop_q", "lora_dropout": 0.1, "target_modules": ["q_proj"]}]},
                    check_paths=False)
    targets = {"model.layers.0.self_attn.q_proj": ("column", 64, 64),
               "model.layers.0.mlp.down_proj": ("row", 176, 64),
               "model.layers.1.self_attn.q_proj": ("column", 64, 64)}
    fp = {j.name: Job(i, j, None, 0).footprint(targets) for i, j in enumerate(run.jobs)}
    m = MemoryModel(beta=[1e9, 1e5, 5.0])
    t = 512
    masks = t * (64 + 176 + 64)  # bytes: 1 per element of each adapted module's (T, d_in) input
    assert fp["nodrop"].dropout_modules == ()
    assert m.predict(t, [fp["drop"]]) - m.predict(t, [fp["nodrop"]]) == masks
    # two dropout jobs on the same modules share the micro-batch's rows: the masks count once
    assert m.predict(t, [fp["drop"], fp["drop2"]]) - m.predict(t, [fp["nodrop"], fp["nodrop2"]]) == masks
    assert m.predict(t, [fp["nodrop"], fp["drop2"]]) - m.predict(t, [fp["nodrop"], fp["nodrop2"]]) == masks
    # a dropout job on a subset of the modules: only those modules' masks
    assert m.mask_bytes(t, [fp["drop_q"], fp["nodrop"]]) == t * (64 + 64)
    assert m.mask_bytes(t, [fp["drop_q"], fp["drop"]]) == masks
    # a refit sees the measured peaks less the (known) masks, so predict does not count them twice
    rng = random.Random(1)
    true = dict(b0=5e8, b1=2e5, b2=3.0, bpp=20.0, brt=10.0)
    for _ in range(12):
        t2 = rng.choice([512, 1024, 2048, 4096])
        jobs = rng.sample(list(fp.values()), rng.randint(1, 4))
        y = (true["b0"] + true["b1"] * t2 + true["b2"] * t2 * t2
             + sum(true["bpp"] * j.params + true["brt"] * j.rank_sum * t2 for j in jobs) + m.mask_bytes(t2, jobs))
        m.observe(t2, jobs, y)
    assert m.fit()
    want = (true["b0"] + true["b1"] * 3000 + true["b2"] * 9e6 + true["bpp"] * fp["drop"].params
            + true["brt"] * fp["drop"].rank_sum * 3000 + 3000 * (64 + 176 + 64))
    assert m.predict(3000, [fp["drop"]]) == pytest.approx(want, rel=1e-3)


def test_auto_token_budget_takes_the_largest_admitted_size_no_larger_than_a_step():
    from bdlora.train.engine.memory import AUTO_TOKEN_BUDGETS, CPU_TOKEN_BUDGET, auto_token_budget

    m = MemoryModel(beta=[1e9, 1e5, 5.0])
    jobs = [JobFootprint("a", 1_000_000, 64), JobFootprint("b", 2_000_000, 128)]
    p = {t: m.predict(t, jobs) for t in AUTO_TOKEN_BUDGETS}
    assert p[512] < p[1024] < p[2048] < p[4096] < p[8192] < p[16384]
    # a limit between two sizes: the smaller of the two, whatever the steps hold
    assert auto_token_budget(m, jobs, (p[4096] + p[8192]) / 2, step_tokens=10**6, longest=256) == 4096
    assert auto_token_budget(m, jobs, p[8192], step_tokens=10**6, longest=256) == 8192
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=10**6, longest=256) == 16384
    # no larger than the smallest size that holds one step of every job: a larger one only raises the prediction
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=3000, longest=256) == 4096
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=600, longest=256) == 1024
    # never below the longest example, itself a candidate (the smallest)
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=100, longest=256) == 256
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=100, longest=700) == 700
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=800, longest=700) == 1024
    assert auto_token_budget(m, jobs, p[16384] * 2, step_tokens=10**6, longest=20000) == 20000
    assert auto_token_budget(m, jobs, m.predict(700, jobs), step_tokens=10**6, longest=700) == 700
    # nothing admitted: the smallest candidate (admission then refuses the jobs, with its message)
    assert auto_token_budget(m, jobs, 1.0, step_tokens=10**6, longest=256) == 256
    # no memory limit (CPU): the CPU default, or the longest example
    assert auto_token_budget(m, jobs, None, step_tokens=10**6, longest=256) == CPU_TOKEN_BUDGET == 2048
    assert auto_token_budget(m, jobs, None, step_tokens=10**6, longest=4000) == 4000


def test_memory_model_counts_checkpointed_layers_by_their_input():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=32000,
                          num_attention_heads=32)
    per_tok = {c: MemoryModel.analytic(cfg, 8_000_000_000, 2, 2, checkpointed_layers=c).beta[1] for c in (0, 16, 32)}
    layer = (16 * 4096 + 4 * 14336) * 2
    logits = 3 * 32000 * 4
    assert per_tok[0] == 32 * layer + logits
    # every layer recomputes: their inputs, and one layer's activations again during its recompute
    assert per_tok[32] == layer + 32 * 4096 * 2 + logits
    assert per_tok[16] == 17 * layer + 16 * 4096 * 2 + logits


def test_memory_model_counts_fused_layers_and_attention_by_route():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=32000,
                          num_attention_heads=32)
    def per_token(**kw):
        return MemoryModel.analytic(cfg, 8_000_000_000, 2, 2, **kw).beta[1]

    logits = 3 * 32000 * 4
    assert per_token() == 32 * (16 * 4096 + 4 * 14336) * 2 + logits
    # Liger's RMSNorm and SwiGLU keep fewer activations
    assert per_token(fused_layers=True) == 32 * (10 * 4096 + 7 * 14336 // 2) * 2 + logits
    # a capped row's bool mask, once; eager attention's probabilities per layer and head
    assert per_token(mask_length=258) == per_token() + 258
    assert per_token(mask_length=258, eager_attention=True) == per_token() + 258 + 32 * 32 * 258 * 2 * 2
    # no route holds a micro-batch-wide T x T tensor: the quadratic term is the refit's alone
    assert MemoryModel.analytic(cfg, 8_000_000_000, 2, 2, mask_length=258).beta[2] == 0.0


def test_auto_token_budget_on_the_8b_shape_fits_the_device():
    """The engine's own pieces on Llama-3.1-8B's shape (built on the meta device): its memory model, its LoRA targets
    and its jobs' footprints. Four jobs of ranks 16-128 at batches of 8 take 8192 tokens per micro-batch on an H200
    (what the GPU table measured) and less on a 48 GB card, each admitted by the prediction it was picked by."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bdlora.train.engine.jobs import Job
    from bdlora.train.engine.memory import GiB, auto_token_budget
    from bdlora.train.engine.multilora import BatchContext, inject_multilora

    config = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    memory = MemoryModel.for_model(model)
    assert 7.0e9 < sum(p.numel() for p in model.parameters()) < 7.5e9
    cols, rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    targets = inject_multilora(model, cols, rows, BatchContext(backend="torch"), {})
    assert len(targets) == 7 * 32
    run = parse_run({"model": "m", "output_dir": "o", "train_file": "x.jsonl", "nblocks": 4, "batch_size": 8,
                     "max_length": 258, "jobs": [{"name": f"j{r}", "r": r} for r in (16, 32, 64, 128)]},
                    check_paths=False)
    jobs = [Job(i, j, None, 0, model_type="llama").footprint(targets) for i, j in enumerate(run.jobs)]
    step = sum(j.step_samples * j.max_length for j in run.jobs)
    for gib, want in ((0.9 * 140, 8192), (0.9 * 48, 2048)):  # an H200, an L40S (device_budget_bytes: 90%)
        budget = auto_token_budget(memory, jobs, gib * GiB, step_tokens=step, longest=258)
        assert budget == want and memory.predict(budget, jobs) <= gib * GiB < memory.predict(2 * budget, jobs)
    # with Liger's layers four jobs at batches of 32 share micro-batches of 16384 tokens on an H200 (at 8192 each
    # job's ~4,500 tokens took a micro-batch of its own, and four jobs ran 0.94-0.97x one job); the peaks measured
    # there stay under the prediction: one job at 5,150 tokens a micro-batch 39.2 GiB, three at <= 16384 85.1 GiB
    fused = MemoryModel.for_model(model, fused_layers=True)
    budget = auto_token_budget(fused, jobs, 0.9 * 140 * GiB, step_tokens=4 * 32 * 258, longest=258)
    assert budget == 16384 and fused.predict(16384, jobs) <= 0.9 * 140 * GiB
    assert fused.predict(5150, jobs[:1]) > 39.2 * GiB and fused.predict(13000, jobs[:3]) > 85.1 * GiB
