"""Packed rows attended example by example (train/attention.py): the examples' boundaries read from the batch, the
attention function against transformers' own block-causal sdpa and each example run alone, the varlen call for
each signature torch's varlen_attn has had, and `bdlora sweep` / `bdlora train` training the same adapters with it.

The flash route itself needs a GPU (its test is skipped without one); on a CPU the same function takes its reference
route, sdpa under the examples' block-causal mask built from the same boundaries."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from bdlora.train import attention as A
from bdlora.train import data as D


def _packed_batch(seed: int = 3, n: int = 9, row_tokens: int = 40):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(2, 30, (n,), generator=g)]
    exs = [D.Example(input_ids=torch.randint(3, 200, (k,), generator=g).tolist(), labels=list(range(k)), index=i)
           for i, k in enumerate(lens)]
    return exs, D.make_collator(0, padding_free=True, row_tokens=row_tokens)(exs)


def test_packed_batches_carry_their_example_boundaries():
    """Every example and every row's padding tail is one span of ``cu_seq_lens_q`` over the flattened rows, whose
    position ids restart at 0 exactly at those starts; the longest span is ``max_length_q``."""
    exs, batch = _packed_batch()
    cu, pos = batch["cu_seq_lens_q"], batch["position_ids"]
    assert cu.dtype == torch.int32 and batch["cu_seq_lens_k"] is cu
    assert int(cu[0]) == 0 and int(cu[-1]) == pos.numel()
    spans = (cu[1:] - cu[:-1]).tolist()
    assert min(spans) > 0 and batch["max_length_q"] == batch["max_length_k"] == max(spans)
    flat = pos.reshape(-1)
    assert torch.nonzero(flat == 0).flatten().tolist() == cu[:-1].tolist()
    tails = int((batch["attention_mask"].sum(1) < pos.shape[1]).sum())
    assert len(spans) == len(exs) + tails  # each example, plus one span per row with a padding tail
    assert sorted(s for s in spans) == sorted([len(e.input_ids) for e in exs]
                                              + [pos.shape[1] - int(m) for m in batch["attention_mask"].sum(1)
                                                 if int(m) < pos.shape[1]])


def test_boundaries_are_read_on_the_host_from_rows_that_start_an_example():
    with pytest.raises(ValueError, match="on the host"):
        A.packed_sequence_kwargs(torch.zeros(1, 4, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match="position 0"):
        A.packed_sequence_kwargs(torch.tensor([[1, 2, 0, 1]]))


@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
def test_each_example_gets_its_own_logits(tiny_llama_dir, boundaries):
    """A tiny Llama (float64) under :func:`packed_attention`: each example's logits in its packed row equal those of
    the example run alone, with the boundaries from the batch's ``cu_seq_lens_q`` or, without them, from the
    position ids; the model's own attention implementation is back after the context."""
    from transformers import AutoModelForCausalLM

    exs, batch = _packed_batch()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa", dtype=torch.float64)
    model.config.use_cache = False
    extra = {k: batch[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    with torch.no_grad():
        with A.packed_attention(model):
            assert model.config._attn_implementation == A.PACKED_ATTENTION
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           **(extra if boundaries == "cu_seq_lens" else {})).logits
        assert model.config._attn_implementation == "sdpa"
        cu = batch["cu_seq_lens_q"].tolist()
        width = batch["input_ids"].shape[1]
        flat_ids, flat_logits = batch["input_ids"].reshape(-1), packed.reshape(-1, packed.shape[-1])
        matched = 0
        for a, b in zip(cu, cu[1:]):
            if batch["attention_mask"].reshape(-1)[a] == 0:  # a row's padding tail
                continue
            assert a // width == (b - 1) // width  # no example crosses a row
            alone = model(input_ids=flat_ids[a:b][None]).logits[0]
            torch.testing.assert_close(flat_logits[a:b], alone, rtol=1e-9, atol=1e-9)
            matched += 1
    assert matched == len(exs)


def _block_causal_reference(q, k, v, cu, scale):
    """float64 causal attention of each span of ``cu`` alone; q (T, H, D), k / v (T, Hkv, D)."""
    out = torch.empty_like(q, dtype=torch.float64)
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(cu.tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)
    return out


def _varlen_older(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """The first public signature (torch 2.10): causality as a flag, no scale, as many key as query heads."""
    assert query.shape[1] == key.shape[1], "this signature takes no grouped key / value heads"
    assert is_causal and cu_seq_q is cu_seq_k and max_q == max_k >= int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
    return _block_causal_reference(query, key, value, cu_seq_q, None).to(query.dtype)


def _varlen_newer(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                  window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The later signature: causality as a window, a scale, grouped key / value heads on request."""
    assert tuple(window_size) == (-1, 0)
    assert enable_gqa or query.shape[1] == key.shape[1]
    return _block_causal_reference(query, key, value, cu_seq_q, scale).to(query.dtype)


@pytest.mark.parametrize("api", [_varlen_older, _varlen_newer], ids=["is_causal", "window_size"])
@pytest.mark.parametrize("kv_heads, scale", [(4, None), (2, None), (2, 0.2)])
def test_the_varlen_call_fits_each_signature(api, kv_heads, scale):
    """:func:`varlen_causal` passes grouped heads, a non-default scale and causality in whichever form the torch at
    hand takes them, giving each span's causal attention alone (float64 reference, ragged spans)."""
    import inspect

    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 5, 6, 19, 40, 41], dtype=torch.int32)
    T, H, Dh = int(cu[-1]), 4, 16
    q, k, v = (torch.randn(T, h, Dh, generator=g, dtype=torch.float64) for h in (H, kv_heads, kv_heads))
    longest = int((cu[1:] - cu[:-1]).max())
    got = A.varlen_causal((api, frozenset(inspect.signature(api).parameters)), q, k, v, cu, longest, scale)
    want = _block_causal_reference(q, k, v, cu, scale)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not A.packed_attention_supported("cuda") if torch.cuda.is_available() else True,
                    reason="torch's varlen flash attention runs on a CUDA GPU")
def test_flash_route_matches_the_reference_route_on_a_gpu():
    """On a GPU, bf16, grouped heads, ragged packed rows: the varlen flash route's output and gradients against
    the same function's block-causal sdpa route."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    exs, batch = _packed_batch(n=30, row_tokens=128)
    rows, L = batch["input_ids"].shape
    dev = torch.device("cuda")
    module = SimpleNamespace(is_causal=True, num_key_value_groups=4)
    kw = {"cu_seq_lens_q": batch["cu_seq_lens_q"].to(dev), "max_length_q": batch["max_length_q"],
          "position_ids": batch["position_ids"].to(dev)}
    base = [torch.randn(rows, h, L, 64, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2)]
    outs, grads = [], []
    for route in ("flash", "reference"):
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        if route == "flash":
            out, _ = A.packed_sdpa_forward(module, q, k, v, None, scaling=64 ** -0.5, **kw)
        else:
            out, _ = A._block_causal_sdpa(module, q, k, v, None, 0.0, 64 ** -0.5, kw)
        out.float().square().sum().backward()
        outs.append(out.float())
        grads.append([t.grad.float() for t in (q, k, v)])
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


@pytest.fixture
def packed_calls(monkeypatch):
    """Records each call of the packed attention function (registered by :func:`packed_attention` when it runs):
    whether it had the batch's example boundaries and came as one row."""
    calls = []
    real = A.packed_sdpa_forward

    def counted(module, query, *args, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q") is not None and query.shape[0] == 1)
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(A, "packed_sdpa_forward", counted)
    return calls


def _sweep_raw(model, tmp_path, **kw) -> dict:
    from tests.test_engine_utils import run_dict

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "hello world number " + "and more " * (i % 5) + str(i)}) + "\n"
                            for i in range(24)))
    jobs = [{"name": "r4", "r": 4}, {"name": "r8", "r": 8, "lr": 3e-3}]
    return run_dict(model, data, tmp_path / "out", jobs, **{"device": "cpu", "precision": "fp32", **kw})


@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointed"])
def test_sweep_trains_the_same_jobs_with_packed_attention(tmp_path, tiny_llama_dir, monkeypatch, packed_calls, ckpt):
    """`bdlora sweep` with packed attention switched on (on a CPU: its reference route, from the micro-batches'
    boundaries; its micro-batches in one row) trains the jobs as transformers' own packed sdpa does on capped rows:
    the same losses, and the same adapters to the rounding of GEMMs of other shapes (which three AdamW steps at lr
    1e-3 turn into differences of ~1e-5 on factors of ~0.07; with the same rows they are bit-identical). With
    gradient checkpointing the recomputed forward gets the same boundaries."""
    from bdlora import load_adapter
    from bdlora.train.engine import Engine, parse_run
    from bdlora.train.engine import engine as E

    results, histories = {}, {}
    for packed in (False, True):
        monkeypatch.setattr(E, "packed_attention_supported", lambda device, packed=packed: packed)
        monkeypatch.setattr(E, "packed_attention_fits", lambda model: True)  # fp32 here: the reference route
        lines = []
        raw = _sweep_raw(tiny_llama_dir, tmp_path / str(packed),
                         **({"gradient_checkpointing": True} if ckpt else {}))
        eng = Engine(parse_run(raw), log=lines.append)
        assert bool(eng.checkpointed_layers) is ckpt
        assert eng.packed_attention is packed
        before = len(packed_calls)
        results[packed] = eng.run()
        assert any("packed attention" in line for line in lines) is packed
        # every attention call of the packed run had the micro-batch's boundaries, in one row
        assert (len(packed_calls) > before and all(packed_calls[before:])) is packed
        assert eng.model.config._attn_implementation != A.PACKED_ATTENTION  # restored after the run
        histories[packed] = [[v for _, v in j.history["train"]] for j in eng.jobs]
    for a, b in zip(histories[False], histories[True]):
        assert len(a) == len(b) > 0
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert len(results[False]) == len(results[True]) == 2
    for ref, got in zip(results[False], results[True]):
        want, have = load_adapter(ref["adapter"]), load_adapter(got["adapter"])
        for n, f in want.modules.items():
            torch.testing.assert_close(have.modules[n].lora_A, f.lora_A, rtol=1e-3, atol=2e-4, msg=n)
            torch.testing.assert_close(have.modules[n].lora_B, f.lora_B, rtol=1e-3, atol=2e-4, msg=n)


def test_a_named_attention_implementation_keeps_its_own(tmp_path, tiny_llama_dir, monkeypatch):
    """Where varlen flash attention runs, a run that names ``attn_implementation: sdpa`` keeps transformers'
    block-causal mask (the way to opt out, and the baseline the benchmarks compare with)."""
    from bdlora.train.engine import Engine, parse_run
    from bdlora.train.engine import engine as E

    monkeypatch.setattr(E, "packed_attention_supported", lambda device: True)
    monkeypatch.setattr(E, "packed_attention_fits", lambda model: True)
    assert Engine(parse_run(_sweep_raw(tiny_llama_dir, tmp_path / "a"))).packed_attention is True
    raw = _sweep_raw(tiny_llama_dir, tmp_path / "b")
    raw["attn_implementation"] = "sdpa"
    assert Engine(parse_run(raw)).packed_attention is False


@pytest.mark.parametrize("ckpt", [False, True], ids=["", "checkpointed"])
def test_trainer_with_packing_trains_the_same_adapter_with_packed_attention(tmp_path, monkeypatch, capsys,
                                                                           packed_calls, ckpt):
    """`bdlora train` with ``packing: true`` and packed attention switched on (its reference route on a CPU; each
    batch in one row) saves the adapter transformers' own packed sdpa trains on capped rows (to the rounding of
    GEMMs of other shapes), and says which attention it ran."""
    from bdlora import load_adapter
    from bdlora.train import TrainConfig, run_training
    from bdlora.train import trainer as T

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": "hello world number " + "and more " * (i % 5) + str(i)}) + "\n"
                            for i in range(16)))
    adapters, logs = {}, {}
    for packed in (False, True):
        monkeypatch.setattr(T, "packed_attention_supported", lambda device, packed=packed: packed)
        monkeypatch.setattr(T, "packed_attention_fits", lambda model: True)  # fp32 here: the reference route
        cfg = TrainConfig(model="tiny-random", nblocks=2, r=4, train_file=str(data), data_format="text",
                          eval_fraction=0.25, max_steps=3, batch_size=4, packing=True, precision="fp32",
                          gradient_checkpointing=ckpt,
                          output_dir=str(tmp_path / f"out{packed}"), report_to=[], progress=False)
        before = len(packed_calls)
        res = run_training(cfg, validate_adapter=False)
        assert ("packed attention (varlen flash)" in capsys.readouterr().out) is packed
        assert (len(packed_calls) > before and all(packed_calls[before:])) is packed
        adapters[packed] = load_adapter(res.adapter_dir)
        logs[packed] = res
    assert abs(logs[True].eval["eval_loss"] - logs[False].eval["eval_loss"]) < 1e-4
    assert abs(logs[True].train_loss - logs[False].train_loss) < 1e-4
    assert logs[True].model.config._attn_implementation != A.PACKED_ATTENTION  # restored after training
    for n, f in adapters[False].modules.items():
        torch.testing.assert_close(adapters[True].modules[n].lora_A, f.lora_A, rtol=1e-3, atol=2e-4, msg=n)
        torch.testing.assert_close(adapters[True].modules[n].lora_B, f.lora_B, rtol=1e-3, atol=2e-4, msg=n)


def _varlen_not_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                       enable_gqa=False):
    """A varlen_attn that ignores the causal window (what a changed signature could silently give)."""
    out = torch.empty_like(query)
    rep = query.shape[1] // key.shape[1]
    for a, b in zip(cu_seq_q.tolist(), cu_seq_q[1:].tolist()):
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (query, key, value))
        out[a:b] = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0),
                                                  scale=scale).transpose(0, 1).to(query.dtype)
    return out


@pytest.mark.parametrize("api, works", [(_varlen_older, True), (_varlen_newer, True), (_varlen_not_causal, False)],
                         ids=["is_causal", "window_size", "ignores-causality"])
def test_the_first_call_check_accepts_only_causal_varlen_attention(api, works, monkeypatch):
    """The check :func:`packed_attention_supported` runs once per GPU (here on the CPU, through stand-ins of
    varlen_attn): each signature that computes causal attention passes; one that does not is refused, so training
    keeps sdpa's mask."""
    import inspect

    monkeypatch.setattr(A, "_varlen_api", lambda: (api, frozenset(inspect.signature(api).parameters)))
    assert A._check_varlen(torch.device("cpu")) is works


@pytest.mark.skipif(not A.packed_attention_supported("cuda") if torch.cuda.is_available() else True,
                    reason="torch's varlen flash attention runs on a CUDA GPU")
def test_sweep_on_a_gpu_with_varlen_flash_attention(tmp_path, tiny_llama_dir, packed_calls):
    """On a GPU, bf16: `bdlora sweep` as it runs by default (varlen flash attention, one-row micro-batches) against
    the same run with ``attn_implementation: sdpa`` (transformers' block-causal mask, capped rows): the same
    per-step losses to bf16 rounding."""
    from bdlora.train.engine import Engine, parse_run

    losses = {}
    for attn in (None, "sdpa"):
        raw = _sweep_raw(tiny_llama_dir, tmp_path / str(attn))
        raw.update(device="cuda", precision="bf16", attn_implementation=attn)
        eng = Engine(parse_run(raw))
        assert eng.packed_attention is (attn is None)
        before = len(packed_calls)
        eng.run()
        assert (len(packed_calls) > before and all(packed_calls[before:])) is (attn is None)
        losses[attn] = [[v for _, v in j.history["train"]] for j in eng.jobs]
    for a, b in zip(losses[None], losses["sdpa"]):
        assert len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) < 3e-2, (a, b)


def test_a_model_that_refuses_the_switch_keeps_its_attention(tiny_llama_dir, monkeypatch):
    """Where transformers (or the model) refuses the attention switch, training goes on with the model's own
    attention and a warning says so, rather than failing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa")

    def refuse(name):
        raise ValueError(f"{name} is not supported by this model")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with pytest.warns(UserWarning, match="packed attention not used.*keeps sdpa"):
        with A.packed_attention(model):
            assert model.config._attn_implementation == "sdpa"


def test_packed_attention_only_where_the_flash_route_runs(tiny_llama_dir):
    """The one-row layout is chosen only for models whose every attention layer the flash route runs (half
    precision, causal, no sliding window or soft-capping): elsewhere the reference route would attend over the whole
    row under a dense mask. Tiny Llama in bf16: yes; in fp32, with a sliding window, or with soft-capping: no."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16)
    assert A.packed_attention_fits(model)
    assert not A.packed_attention_fits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32))
    model.config.sliding_window = 16
    assert not A.packed_attention_fits(model)
    model.config.sliding_window = None
    model.config.attn_logit_softcapping = 30.0
    assert not A.packed_attention_fits(model)
