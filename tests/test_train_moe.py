"""`bdlora train` on a Mixture-of-Experts model: BD-LoRA on the fused expert tensors beside the attention projections,
saved in PEFT's expert-LoRA format; the dense equivalent loads in PEFT with the trained model's outputs; checkpoints
carry the expert factors and a resumed run ends bit-identical; the choices of ``target_parameters`` and the guards
around the experts' forward."""

from __future__ import annotations

import json
import types

import pytest
import torch

from bdlora.train.config import ConfigError, TrainConfig
from bdlora.train.tasks import toy_chat_records, write_jsonl
from bdlora.train.trainer import EXPERTS_CHECKPOINT_NAME, bd_experts, build_peft_model, list_checkpoints, run_training


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from bdlora.models import build_random_qwen3_moe

    return build_random_qwen3_moe(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(24, seed=5), tmp_path_factory.mktemp("moe-data") / "d.jsonl"))


def _cfg(model, data_file, out, **kw):
    base = dict(model=str(model), nblocks=2, r=8, lora_alpha=16, train_file=data_file, eval_fraction=0.2,
                eval_every=0, lr=3e-3, scheduler="cosine", warmup_steps=1, batch_size=3, grad_accum=2, max_steps=4,
                seed=11, output_dir=str(out), progress=False, report_to=[])
    base.update(kw)
    return TrainConfig.from_dict(base)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_moe_job_trains_expert_adapters_and_the_dense_equivalent_reproduces_it(moe_dir, data_file, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import bdlora
    from bdlora.cli import main as cli_main

    res = run_training(_cfg(moe_dir, data_file, tmp_path / "run"))
    folder = res.adapter_dir
    raw = json.loads((folder / "adapter_config.json").read_text())
    assert raw["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert sorted(raw["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert "gate_up_proj" in raw["use_bdlora"]["target_modules_bd_b"]
    assert "down_proj" in raw["use_bdlora"]["target_modules_bd_a"]
    ad = bdlora.load_adapter(folder)
    assert len(ad.modules) == 8 and len(ad.experts) == 4 and ad.config.nblocks == 2
    # every expert factor trained: the zero-initialised B factors moved, and A moved from its initialisation
    assert all(f.lora_B.abs().max() > 0 for f in ad.experts.values())
    card = (folder / "README.md").read_text()
    assert "fused experts of 2 MoE layers" in card and "convert to-dense" in card
    assert "--enable-lora --enable-bdlora --tensor-parallel-size 2" in card
    assert "M | 2 or 2 | M" in card

    dense = tmp_path / "dense"
    assert cli_main(["convert", "to-dense", str(folder), str(dense)]) == 0
    ids = torch.randint(3, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        trained = res.model.eval()(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(dense)).eval()(input_ids=ids).logits
    torch.testing.assert_close(peft_logits, trained, rtol=1e-4, atol=1e-5)
    assert (trained - base_logits).abs().max() > 1e-4  # the adapter changes the outputs


def test_moe_resume_is_exact(moe_dir, data_file, tmp_path):
    def cfg(out, **kw):
        return _cfg(moe_dir, data_file, out, lora_dropout=0.1, **kw)

    straight = run_training(cfg(tmp_path / "a"))
    first = run_training(cfg(tmp_path / "b"), stop_after_steps=2)
    assert first.adapter_dir is None
    ckpt = list_checkpoints(tmp_path / "b")[-1]
    assert (ckpt / EXPERTS_CHECKPOINT_NAME).is_file()
    resumed = run_training(cfg(tmp_path / "b", resume="auto"))
    a, b = _params(straight.model), _params(resumed.model)
    assert a.keys() == b.keys() and sum("experts" in n for n in a) == 8
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert (straight.adapter_dir / "adapter_model.safetensors").read_bytes() == \
        (resumed.adapter_dir / "adapter_model.safetensors").read_bytes()

    # a checkpoint without the expert factors (not written by this job) is refused, not resumed without them
    (ckpt / EXPERTS_CHECKPOINT_NAME).unlink()
    with pytest.raises(ConfigError, match=EXPERTS_CHECKPOINT_NAME):
        run_training(cfg(tmp_path / "b", resume=str(ckpt)))


def test_target_parameters_choices(moe_dir, tiny_llama_dir, data_file, tmp_path):
    model, _ = build_peft_model(_cfg(moe_dir, data_file, tmp_path / "x"), moe_dir)
    assert list(bd_experts(model)) == [f"base_model.model.model.layers.{i}.mlp.experts" for i in range(2)]
    with_experts = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model, _ = build_peft_model(_cfg(moe_dir, data_file, tmp_path / "x", target_parameters=[]), moe_dir)
    assert not bd_experts(model)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) < with_experts
    # the base's expert weights stay frozen
    model, _ = build_peft_model(_cfg(moe_dir, data_file, tmp_path / "x"), moe_dir)
    assert not any(p.requires_grad for n, p in model.named_parameters() if n.endswith(("experts.base.gate_up_proj",
                                                                                        "experts.base.down_proj")))
    with pytest.raises(ConfigError, match="has no fused experts"):
        build_peft_model(_cfg(tiny_llama_dir, data_file, tmp_path / "y",
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                         tiny_llama_dir)
    with pytest.raises(ConfigError, match="both fused expert tensors or none"):
        _cfg(moe_dir, data_file, tmp_path / "z", target_parameters=["mlp.experts.down_proj"])
    from bdlora.models import build_random_qwen3_moe

    odd = build_random_qwen3_moe(tmp_path / "odd", hidden_size=48, head_dim=12, moe_intermediate_size=32)
    with pytest.raises(ConfigError, match=r"target_parameters: base_model\.model\.model\.layers\.0\.mlp\.experts\."
                                          r"gate_up_proj .*nblocks=3"):
        build_peft_model(_cfg(odd, data_file, tmp_path / "z", nblocks=3, r=6), odd)


def test_experts_that_compute_differently_are_refused_and_a_rebound_forward_is_caught():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from bdlora.moe import BDLoraError, check_experts_intact, wrap_experts

    cfg = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         vocab_size=64)
    model = Qwen3MoeForCausalLM(cfg)
    experts = model.model.layers[0].mlp.experts
    original = type(experts).forward
    experts.forward = types.MethodType(lambda self, x, i, w: 2 * original(self, x, i, w), experts)
    with pytest.raises(BDLoraError, match="do not compute"):
        wrap_experts(model, 2, 4, 8.0)

    model = Qwen3MoeForCausalLM(cfg)
    wrapped = wrap_experts(model, 2, 4, 8.0)
    assert check_experts_intact(wrapped) is None
    m = next(iter(wrapped.values()))
    m.forward = types.MethodType(lambda self, x, i, w: x, m)  # what Liger's SwiGLU patch does to experts modules
    assert "forward was replaced" in check_experts_intact(wrapped)


def test_liger_leaves_the_experts_forward_alone(moe_dir, data_file, tmp_path):
    from bdlora.train.trainer import training_arguments

    cfg = _cfg(moe_dir, data_file, tmp_path / "l")
    args = training_arguments(cfg, 4, False, liger=True, experts=True)
    assert args.use_liger_kernel and args.liger_kernel_config == {"swiglu": False}
    assert not training_arguments(cfg, 4, False, liger=True).liger_kernel_config


def test_sweep_on_a_moe_model_needs_attention_only_jobs(moe_dir, data_file, tmp_path):
    """`bdlora sweep` adapts linear layers only: on a MoE model, where `bdlora train` also adapts the experts, a job
    that leaves target_parameters unset is refused before training; with `[]` it trains attention adapters."""
    from bdlora import load_adapter
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.launch import run_engine

    raw = {"model": str(moe_dir), "train_file": data_file, "output_dir": str(tmp_path / "sweep"), "nblocks": 2,
           "r": 8, "max_steps": 2, "batch_size": 4, "max_length": 64, "eval_fraction": 0.2, "report_to": [],
           "progress": False}
    with pytest.raises(ConfigError, match=r"target_parameters: \[\] to sweep attention-only adapters"):
        run_engine(parse_run(raw))
    run_engine(parse_run({**raw, "target_parameters": []}))
    folder = next((tmp_path / "sweep" / "adapters").iterdir())
    ad = load_adapter(folder)
    assert not ad.experts and {n.rsplit(".", 1)[-1] for n in ad.modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
