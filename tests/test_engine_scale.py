"""The engine at scale: pipeline stages load only their own layers from the safetensors files
(memory per stage ~1/D of the weights, measured on 2 CPU processes), and data-parallel gradients are all-reduced
in one flat buffer per job and step."""

from __future__ import annotations

import json
import os

import pytest
import torch

from test_engine_utils import run_dict, write_alpaca


def _save_llama(path, layers: int, tied: bool, shard: str | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=100, tie_word_embeddings=tied)
    kw = {"max_shard_size": shard} if shard else {}
    LlamaForCausalLM(cfg).save_pretrained(str(path), **kw)
    return path


@pytest.mark.parametrize("tied,shard,stages", [(False, None, 2), (True, "50KB", 3), (False, "40KB", 4)])
def test_stage_loader_reads_only_its_tensors_and_equals_the_full_load(tmp_path, tied, shard, stages):
    """Every stage's tensors equal from_pretrained's (bf16 and fp32); the stages together read every checkpoint
    tensor once (a tied head: the embedding tensor on the first and the last stage); each stage holds only its
    layers, with the embeddings on the first, norm + head on the last."""
    from transformers import AutoModelForCausalLM

    from bdlora.train.engine.model import _OtherStage, load_stage_model, stage_bounds

    path = _save_llama(tmp_path / "m", 5, tied, shard)
    assert (path / "model.safetensors.index.json").is_file() == (shard is not None)
    full = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        read: list[str] = []
        for s, (lo, hi) in enumerate(stage_bounds(5, stages)):
            m = load_stage_model(path, dtype, "cpu", None, s, stages)
            rec = m.stage_load
            assert rec["layers"] == [lo, hi]
            layers = list(m.model.layers)
            assert [i for i, layer in enumerate(layers) if not isinstance(layer, _OtherStage)] == list(range(lo, hi))
            assert (m.model.embed_tokens is not None) == (s == 0)
            assert (m.lm_head is not None) == (s == stages - 1)
            sd = m.state_dict()
            for name, t in sd.items():
                assert t.device.type == "cpu" and not t.is_meta
                ref = full[name]
                if "inv_freq" not in name:
                    assert t.dtype == dtype
                    ref = ref.to(dtype)
                assert torch.equal(t, ref), name
            assert not any(n.startswith(f"model.layers.{i}.") for n in sd for i in range(5) if not lo <= i < hi)
            assert rec["bytes_materialized"] == sum(p.numel() * p.element_size() for p in m.parameters())
            read += rec["keys"]
        checkpoint_keys = set(full) - ({"lm_head.weight"} if tied else set())
        assert set(read) == checkpoint_keys
        doubled = ["model.embed_tokens.weight"] if tied else []  # the tied head reads the embeddings again
        assert sorted(read) == sorted(list(checkpoint_keys) + doubled)
        assert rec["checkpoint_bytes"] == sum(full[k].numel() * 4 for k in checkpoint_keys)


def test_stage_loader_needs_safetensors(tmp_path):
    from bdlora.train.engine.scheduler import EngineError
    from bdlora.train.engine.model import load_stage_model

    path = _save_llama(tmp_path / "m", 2, False)
    (path / "model.safetensors").unlink()
    with pytest.raises(EngineError, match="safetensors"):
        load_stage_model(path, torch.float32, "cpu", None, 0, 2)


@pytest.mark.slow
def test_two_stage_pipeline_holds_half_the_weights_per_stage(tmp_path):
    """A random Llama whose weights dominate (8 layers, hidden 768: 195 MiB fp32), a 2-stage pipeline on 2 CPU
    processes: each stage reads and holds <= 0.6 of the weight bytes, the stages together read every tensor once,
    and each stage's peak RSS grows by <= 0.6 of the weights (+ 64 MiB of slack for the code it imports)."""
    from bdlora.models import build_random_llama
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.launch import run_pipeline_spawn

    model = build_random_llama(tmp_path / "llama8", hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=4,
                               intermediate_size=2048, vocab_size=512, init_std=0.02)
    data = write_alpaca(tmp_path / "d.jsonl", n=24)
    jobs = [{"name": "a", "r": 4, "nblocks": 2, "seed": 1}, {"name": "b", "r": 8, "nblocks": 4, "seed": 2}]
    res = run_pipeline_spawn(parse_run(run_dict(model, data, tmp_path / "pipe", jobs, pipeline_stages=2,
                                                token_budget=96, eval_every=10,
                                                defaults={"max_steps": 2, "batch_size": 2, "lr": 1e-3,
                                                          "max_length": 48})))
    assert [r["steps"] for r in res["jobs"]] == [2, 2]
    loads = res["pipeline"]["load_per_stage"]
    total = loads[0]["checkpoint_bytes"]
    assert total > 190 * 2**20 and all(ld["checkpoint_bytes"] == total for ld in loads)
    assert [ld["layers"] for ld in loads] == [[0, 4], [4, 8]]
    assert sum(ld["bytes_read"] for ld in loads) == total  # every tensor once (untied)
    for ld in loads:
        assert ld["bytes_read"] <= 0.6 * total and ld["bytes_materialized"] <= 0.6 * total
        if ld["peak_rss_growth_bytes"] is not None:
            assert ld["peak_rss_growth_bytes"] <= 0.6 * total + 64 * 2**20, ld
    print("per-stage load (MiB):", [{k: round(v / 2**20, 1) if k.endswith("bytes") and v is not None else v
                                     for k, v in ld.items()} for ld in loads])


# -- data parallel: one flat all-reduce per job and step ------------------------------------------------------------
def _counting_worker(rank: int, run, world: int, port: int, out: str) -> None:
    """One data-parallel rank (gloo) that counts torch.distributed.all_reduce calls in each train_round."""
    import torch.distributed as dist

    from bdlora.train.engine.engine import Engine
    from bdlora.train.engine.launch import _spawn_worker

    calls = [0]
    real = dist.all_reduce

    def counting(*a, **k):
        calls[0] += 1
        return real(*a, **k)

    dist.all_reduce = counting  # the engine calls dist.all_reduce on the module: it finds this one
    rounds = []
    train_round = Engine.train_round

    def counted(self):
        active, before = len(self.active_jobs()), calls[0]
        info = train_round(self)
        rounds.append([active, calls[0] - before])
        return info

    Engine.train_round = counted
    _spawn_worker(rank, run, world, port, "gloo")
    with open(os.path.join(out, f"rounds{rank}.json"), "w") as f:
        json.dump(rounds, f)


@pytest.mark.slow
def test_data_parallel_one_all_reduce_per_job_and_step(tiny_llama_dir, tmp_path):
    """2 CPU processes: every round makes (active jobs + 1) all-reduces (the jobs' flat gradient buffers, the
    losses), and the adapters equal the one-process run's."""
    import socket

    import torch.multiprocessing as mp

    from bdlora import load_adapter
    from bdlora.train.engine import parse_run
    from bdlora.train.engine.engine import Engine

    data = write_alpaca(tmp_path / "d.jsonl", n=30)
    jobs = [{"name": "a", "r": 4, "nblocks": 2, "seed": 1, "max_grad_norm": 0.05},
            {"name": "b", "r": 8, "nblocks": 4, "seed": 2, "scheduler": "cosine"},
            {"name": "c", "r": 8, "nblocks": 1, "seed": 3, "max_steps": 2}]
    kw = dict(token_budget=96, eval_every=10, defaults={"max_steps": 3, "batch_size": 4, "lr": 1e-3,
                                                        "max_length": 64})
    one = Engine(parse_run(run_dict(tiny_llama_dir, data, tmp_path / "one", jobs, **kw))).run()
    run = parse_run(run_dict(tiny_llama_dir, data, tmp_path / "two", jobs, **kw))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_counting_worker, args=(run, 2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        rounds = json.loads((tmp_path / f"rounds{rank}.json").read_text())
        assert rounds == [[3, 4], [3, 4], [2, 3]]  # "c" finishes after 2 steps
    two = json.loads((tmp_path / "two" / "results.json").read_text())["jobs"]
    for a, b in zip(one, two):
        assert b["steps"] == a["steps"] and b["tokens"] == a["tokens"]
        assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=1e-5)
        x, y = load_adapter(a["adapter"]), load_adapter(b["adapter"])
        assert set(x.modules) == set(y.modules)
        for p in x.modules:
            torch.testing.assert_close(x.modules[p].lora_A, y.modules[p].lora_A, rtol=1e-4, atol=2e-5)
            torch.testing.assert_close(x.modules[p].lora_B, y.modules[p].lora_B, rtol=1e-4, atol=2e-5)


def test_memory_model_of_a_stage_counts_its_own_layers_dtype_and_logits(tmp_path):
    """Admission on a pipeline stage predicts that stage's memory, not the whole model's: its parameters, the
    activations of its own decoder layers in the base dtype, the logits only on the last stage. The stages'
    activation terms add up to the whole model's (a 70B base over 2 GPUs was refused with every layer counted)."""
    from transformers import AutoModelForCausalLM

    from bdlora.train.engine import MemoryModel
    from bdlora.train.engine.memory import WORKSPACE_BYTES
    from bdlora.train.engine.model import load_stage_model

    path = _save_llama(tmp_path / "m", 4, False, None)
    for dtype in (torch.float32, torch.bfloat16):
        full = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        whole = MemoryModel.for_model(full)
        stages = [MemoryModel.for_model(load_stage_model(path, dtype, "cpu", None, s, 2)) for s in range(2)]
        size = torch.tensor([], dtype=dtype).element_size()
        cfg = full.config
        per_layer = (16 * cfg.hidden_size + 4 * cfg.intermediate_size) * size
        logits = 3 * cfg.vocab_size * 4
        assert whole.beta[1] == 4 * per_layer + logits
        assert [m.beta[1] for m in stages] == [2 * per_layer, 2 * per_layer + logits]
        n = [sum(p.numel() for p in load_stage_model(path, dtype, "cpu", None, s, 2).parameters()) for s in range(2)]
        assert [m.beta[0] for m in stages] == [k * size + WORKSPACE_BYTES for k in n]
        assert sum(n) == sum(p.numel() for p in full.parameters())
