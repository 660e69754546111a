"""bdlora.vllm_plugin at tensor-parallel size 2 (worker processes, gloo + shared-memory all-reduce on CPU).

One BD engine serves every adapter at once (N = 2 = M, N = 4 with M | N, N = 1 and dense with N | M, a partial
adapter), then one stock ``--fully-sharded-loras`` engine proves that the collective counter sees LoRA collectives.
"""

from __future__ import annotations

import json
import shutil

import pytest

vllm = pytest.importorskip("vllm")

from vllm.lora.request import LoRARequest  # noqa: E402

from bdlora.vllm_plugin import testing as T  # noqa: E402
from bdlora.vllm_plugin import diagnostics as D  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]
TOL = 1e-4
MAX_RANK = 16
TP2 = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    # collective_rpc with test probes (callables), and collective counters installed by register() in workers.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "BDLORA_COUNT_COLLECTIVES": "1",
}
IDS = {name: i + 1 for i, name in enumerate(["bd2_r8", "bd2_r16", "bd4_r16", "bd1_r8", "bd2_part", "dense_r8",
                                             "dense_r16"])}


def _req(adapters, name):
    return None if name is None else LoRARequest(name, IDS[name], str(adapters[name]))


class Engines:
    bd = None


@pytest.fixture(scope="module")
def bd_llm(tiny_llama_dir):
    Engines.bd = T.start_llm(tiny_llama_dir, env=TP2, tensor_parallel_size=2, enable_lora=True,
                             max_lora_rank=MAX_RANK, max_loras=4, additional_config={"bdlora": True})
    yield Engines.bd
    if Engines.bd is not None:
        T.stop_llm(Engines.bd)
        Engines.bd = None


def _check(model_dir, adapters, llm, spec):
    return T.assert_parity(llm, model_dir, [(p, _req(adapters, n)) for p, n in spec],
                           [adapters[n] if n else None for _, n in spec], TOL)


@pytest.mark.parametrize("name", ["bd2_r8", "bd2_r16", "bd4_r16", "bd1_r8", "bd2_part", "dense_r8"])
def test_tp2_parity_single(bd_llm, tiny_llama_dir, vllm_adapters, name):
    rows = _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[0], name), (PROMPTS[2], name),
                                                           (PROMPTS[0], None)])
    assert rows[0]["tokens"] != rows[-1]["tokens"], "adapter does not change the output"


def test_tp2_parity_mixed_batch(bd_llm, tiny_llama_dir, vllm_adapters):
    """Base requests and four adapters (ranks 8/16/16/8, nblocks 2/2/4/dense) in one batch, all slots taken."""
    spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[2], "bd2_r16"), (PROMPTS[0], "bd4_r16"),
            (PROMPTS[1], "dense_r8"), (PROMPTS[2], None), (PROMPTS[2], "bd2_r8")]
    _check(tiny_llama_dir, vllm_adapters, bd_llm, spec)


def test_tp2_no_lora_collectives(bd_llm, tiny_llama_dir, vllm_adapters):
    """BD mode adds no collective: the counters in both workers see only the base model's all-reduces."""
    bd_llm.collective_rpc(D.reset_collective_counters)
    T.generate_mixed(bd_llm, [(PROMPTS[0], _req(vllm_adapters, "bd2_r16")), (PROMPTS[1], None)])
    counts = bd_llm.collective_rpc(D.read_collective_counters)
    assert len(counts) == 2
    for c in counts:
        assert c.get("base:all_reduce", 0) > 0, counts  # the counter is live in the worker
        assert not any(k.startswith("lora:") for k in c), counts


def _nfs_elements(model_dir, r, tp):
    """Per-rank elements of a dense rank-r LoRA on all seven projections under vLLM's default sharding."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    h, i, kv = c.hidden_size, c.intermediate_size, c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    column = [(h, h), (h, kv), (h, kv), (h, i), (h, i)]  # (d_in, d_out): q, k, v, gate, up
    row = [(h, h), (i, h)]  # o, down
    per_layer = sum(r * d_in + d_out // tp * r for d_in, d_out in column)
    per_layer += sum(r * d_in // tp + d_out * r for d_in, d_out in row)
    return per_layer * c.num_hidden_layers


def test_tp2_memory_is_one_over_n(bd_llm, tiny_llama_dir, vllm_adapters):
    """Per rank, the BD adapter (r=16, N=2) holds 1/N of what vLLM's default sharding holds for a dense r=16
    adapter, both in the loaded factors and in its slot of the stacked buffers."""
    T.generate_mixed(bd_llm, [(PROMPTS[0], _req(vllm_adapters, "bd2_r16"))], max_tokens=1)
    reports = bd_llm.collective_rpc(D.lora_memory, args=(IDS["bd2_r16"],))
    dense_loaded = _nfs_elements(tiny_llama_dir, 16, 2) * 4
    stock_slot = _nfs_elements(tiny_llama_dir, MAX_RANK, 2) * 4
    for rep in reports:
        assert rep["buffer_ranks"] == [MAX_RANK // 2]
        assert rep["loaded"] * 2 == dense_loaded, rep["loaded"]
        assert rep["slot"] * 2 == stock_slot, rep["slot"]


def test_tp2_refusals_keep_engine_alive(bd_llm, tiny_llama_dir, vllm_adapters, tmp_path):
    n3 = tmp_path / "n3"
    shutil.copytree(vllm_adapters["bd2_r8"], n3)
    with open(n3 / "adapter_config.json") as f:
        cfg = json.load(f)
    cfg["r"], cfg["use_bdlora"]["nblocks"] = 6, 3
    with open(n3 / "adapter_config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="nblocks=3 but tensor-parallel size is 2"):
        T.generate_mixed(bd_llm, [(PROMPTS[0], LoRARequest("n3", 99, str(n3)))])
    with pytest.raises(ValueError, match="needs rank 16 on each of the 2 devices"):
        T.generate_mixed(bd_llm, [(PROMPTS[0], _req(vllm_adapters, "dense_r16"))])
    _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[1], "bd4_r16"), (PROMPTS[1], None)])


def test_tp2_fully_sharded_counts_lora_collectives(bd_llm, tiny_llama_dir, vllm_adapters):
    """Control: stock vLLM with --fully-sharded-loras at TP=2 does add LoRA collectives (the counter works)."""
    T.stop_llm(bd_llm)  # two cores: one engine at a time
    Engines.bd = None
    llm = T.start_llm(tiny_llama_dir, env=TP2, tensor_parallel_size=2, enable_lora=True, max_lora_rank=MAX_RANK,
                      max_loras=2, fully_sharded_loras=True)
    try:
        llm.collective_rpc(D.reset_collective_counters)
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[0], "dense_r8"), (PROMPTS[1], None)])
        for c in llm.collective_rpc(D.read_collective_counters):
            assert c.get("lora:all_gather", 0) > 0 and c.get("lora:all_reduce", 0) > 0, c
    finally:
        T.stop_llm(llm)
