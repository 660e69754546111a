"""BD-LoRA on a bitsandbytes 4-/8-bit base, on CPU with bitsandbytes 0.50.2.

PEFT 0.21's bitsandbytes LoRA layers never return the BD variant: without bdlora.quant a `use_bdlora` config on a
4-bit base trains a dense LoRA. These tests check that bdlora's trainer builds the genuine block-diagonal adapter on
a quantized base (packed factors), that it is N independent rank r/N adapters of the dequantized weight's shards,
that it trains (and trains correctly: gradients equal those of the dequantized fp32 model, also after an
evaluation), that the saved folder loads on the unquantized base, and the refusals; and that `bdlora sweep` trains
several jobs on one shared 4-bit base (each job's folder scored by PEFT on a 4-bit base as the engine scored it).
"""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")

import bitsandbytes as bnb  # noqa: E402

from bdlora import BDLoraSpec  # noqa: E402
from bdlora.quant import (QuantError, check_kbit_bd, dequantized_weight, disable_cpu_inference_packing,  # noqa: E402
                          enable_bdlora_on_kbit, kbit_lora_classes, kbit_variant_class)
from bdlora.layout import COLUMN, ROW  # noqa: E402
from bdlora.spec import BDLoraError  # noqa: E402
from bdlora.train.config import ConfigError, TrainConfig  # noqa: E402
from bdlora.train.tasks import toy_chat_records, write_jsonl  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")

KBIT = {4: bnb.nn.Linear4bit, 8: bnb.nn.Linear8bitLt}


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    return str(write_jsonl(toy_chat_records(64, seed=3), tmp_path_factory.mktemp("kbit-data") / "train.jsonl"))


def _cfg(model_dir, train_file, tmp_path=None, **kw):
    base = dict(model=str(model_dir), train_file=train_file, load_in_4bit=True, nblocks=2, r=8, lora_alpha=16,
                report_to=[], progress=False, max_length=64, output_dir=str(tmp_path or "unused"))
    base.update(kw)
    return TrainConfig.from_dict(base)


def _randomize(model, seed=0, std=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def _peft_on_fresh_4bit_base(model_dir, folder):
    """A saved adapter folder loaded by PEFT (in eval mode) onto the model quantized anew to 4 bits (nf4, double
    quantization: the trainer's defaults), PEFT's k-bit layers made to build BD-LoRA first."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    enable_bdlora_on_kbit()
    q4 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                              quantization_config=BitsAndBytesConfig(
                                                  load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                  bnb_4bit_use_double_quant=True))
    disable_cpu_inference_packing(q4)
    return PeftModel.from_pretrained(q4, str(folder)).eval()


def _lora_layers(model):
    for name, m in model.named_modules():
        if isinstance(getattr(m, "lora_A", None), torch.nn.ModuleDict) and "default" in m.lora_A:
            yield name.removeprefix("base_model.model."), m


def _dequantized_reference(kbit_model, model_dir, spec):
    """The unquantized PEFT model whose base weights are the k-bit model's dequantized weights and whose adapter is
    the k-bit model's (same state dict): what the k-bit model must compute."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for name, m in kbit_model.named_modules():
            if isinstance(m, tuple(KBIT.values())):
                target = name.removeprefix("base_model.model.").removesuffix(".base_layer")
                ref.get_submodule(target).weight.copy_(dequantized_weight(m).float())
    ref = get_peft_model(ref, spec.to_peft_config(task_type="CAUSAL_LM"))
    lora = {k: v for k, v in kbit_model.state_dict().items() if "lora_" in k}
    res = ref.load_state_dict(lora, strict=False)
    assert not res.unexpected_keys and len(lora) == sum(1 for k in ref.state_dict() if "lora_" in k)
    return ref


# ---------------------------------------------------------------------------------------------------- structure
@pytest.mark.parametrize("bits,nblocks,r", [(4, 2, 8), (4, 4, 8), (8, 2, 8)])
def test_kbit_base_gets_packed_bd_factors(tiny_llama_dir, train_file, bits, nblocks, r):
    from bdlora.train.trainer import build_peft_model

    cfg = _cfg(tiny_llama_dir, train_file, load_in_4bit=bits == 4, load_in_8bit=bits == 8, nblocks=nblocks, r=r)
    model, spec = build_peft_model(cfg, tiny_llama_dir)
    layers = dict(_lora_layers(model))
    assert len(layers) == 14 and check_kbit_bd(model, nblocks) == 14
    Variant = kbit_variant_class()
    for name, m in layers.items():
        base = m.get_base_layer()
        assert isinstance(base, KBIT[bits]), name
        assert isinstance(m.lora_variant["default"], Variant)
        a, b = m.lora_A["default"].weight, m.lora_B["default"].weight
        d_in, d_out = base.in_features, base.out_features
        assert a.dtype == b.dtype == torch.float32 and a.requires_grad and b.requires_grad
        if spec.layout_of(name.rsplit(".", 1)[-1]) == COLUMN:  # B packed (d_out, r/N); A dense (r, d_in)
            assert tuple(a.shape) == (r, d_in) and tuple(b.shape) == (d_out, r // nblocks), name
        else:  # ROW: A packed (r, d_in/N); B dense (d_out, r)
            assert tuple(a.shape) == (r, d_in // nblocks) and tuple(b.shape) == (d_out, r), name
    # only the adapter trains: the packed factors are all the parameters (zeros never stored)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    want = sum(r * d_in + d_out * r // nblocks if lay == COLUMN else r * d_in // nblocks + d_out * r
               for lay, d_in, d_out in ((spec.layout_of(n.rsplit(".", 1)[-1]), m.in_features, m.out_features)
                                        for n, m in layers.items()))
    assert n_train == want


def test_peft_alone_trains_dense_and_the_check_catches_it(tiny_llama_dir, monkeypatch):
    """Without bdlora's patch PEFT 0.21 silently builds dense factors on a 4-bit base; check_kbit_bd refuses that."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    enable_bdlora_on_kbit()
    for cls in kbit_lora_classes():  # PEFT's own methods, as shipped
        monkeypatch.setattr(cls, "resolve_lora_variant", cls.resolve_lora_variant.__kwdefaults__["_original"])
        monkeypatch.setattr(cls, "__init__", cls.__init__.__kwdefaults__["_original"])
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                                quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    model = get_peft_model(base, BDLoraSpec(nblocks=2, r=8, lora_alpha=16).to_peft_config())
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert tuple(q.lora_B["default"].weight.shape) == (256, 8)  # dense: the bug
    with pytest.raises(QuantError, match="dense LoRA"):
        check_kbit_bd(model, 2)


def test_bd_with_another_variant_is_refused_on_kbit(tiny_llama_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    enable_bdlora_on_kbit()
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                                quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match="use_bdlora cannot be combined with \\['use_dora'\\]"):
        get_peft_model(base, BDLoraSpec(nblocks=2, r=8, lora_alpha=16).to_peft_config(use_dora=True))


def test_patch_is_idempotent_and_leaves_other_configs_to_peft(tiny_llama_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    first = [c.resolve_lora_variant for c in enable_bdlora_on_kbit()]
    assert [c.resolve_lora_variant for c in enable_bdlora_on_kbit()] == first
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                                quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj"]))  # plain LoRA: PEFT's, unchanged
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert not q.lora_variant and tuple(q.lora_B["default"].weight.shape) == (256, 8)


# ---------------------------------------------------------------------------------------------------- the math
@pytest.mark.parametrize("bits", [4, 8])
def test_kbit_delta_is_n_independent_shard_adapters_of_the_dequantized_weight(tiny_llama_dir, train_file, bits):
    """Each LoRA'd k-bit layer computes, per shard i of its dequantized weight W, an independent rank r/N adapter
    (A_i, B_i) with scale alpha/sqrt(r/N): column layers concatenate the N outputs, row layers sum the N partials."""
    from bdlora.train.trainer import build_peft_model

    nblocks, r = 2, 8
    cfg = _cfg(tiny_llama_dir, train_file, load_in_4bit=bits == 4, load_in_8bit=bits == 8, nblocks=nblocks, r=r)
    model, spec = build_peft_model(cfg, tiny_llama_dir)
    _randomize(model, seed=5)
    model.eval()
    s, k = spec.scale, r // nblocks
    assert math.isclose(s, 16 / math.sqrt(k))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    layer0 = model.base_model.model.model.layers[0]
    for name, m in (("q_proj", layer0.self_attn.q_proj), ("o_proj", layer0.self_attn.o_proj)):
        base = m.get_base_layer()
        W = dequantized_weight(base).float()  # (d_out, d_in)
        A, B = m.lora_A["default"].weight.detach(), m.lora_B["default"].weight.detach()
        d_out, d_in = W.shape
        with torch.no_grad():
            y, y_base = m(x), base(x)
        if spec.layout_of(name) == COLUMN:
            rows = d_out // nblocks
            shards = [x @ W[i * rows:(i + 1) * rows].T
                      + s * (x @ A[i * k:(i + 1) * k].T) @ B[i * rows:(i + 1) * rows].T for i in range(nblocks)]
            ref = torch.cat(shards, dim=-1)
            delta = torch.cat([s * (x @ A[i * k:(i + 1) * k].T) @ B[i * rows:(i + 1) * rows].T
                               for i in range(nblocks)], dim=-1)
        else:
            cols = d_in // nblocks
            xs = [x[:, i * cols:(i + 1) * cols] for i in range(nblocks)]
            ref = sum(xs[i] @ W[:, i * cols:(i + 1) * cols].T + s * (xs[i] @ A[i * k:(i + 1) * k].T)
                      @ B[:, i * k:(i + 1) * k].T for i in range(nblocks))
            delta = sum(s * (xs[i] @ A[i * k:(i + 1) * k].T) @ B[:, i * k:(i + 1) * k].T for i in range(nblocks))
        # the adapter's contribution is exactly the N shard adapters' (fp32, no quantization involved)
        torch.testing.assert_close(y - y_base, delta, atol=1e-5, rtol=1e-5)
        # the whole layer against the dequantized weight: within the k-bit matmul's own error (4-bit on CPU
        # dequantizes and runs an fp32 matmul: exact; 8-bit multiplies int8 with fp16-rounded inputs)
        base_err = (y_base - x @ W.T).abs().max().item()
        tol = 1e-5 if bits == 4 else 0.05
        assert base_err <= tol
        assert (y - ref).abs().max().item() <= tol + 1e-5
        # the variant's delta weight (merge) is the block-diagonal product
        dw = kbit_variant_class().delta_weight(m, "default")
        torch.testing.assert_close(x @ dw.T, delta, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_kbit_model_matches_dequantized_fp32_model_forward_and_gradients(tiny_llama_dir, train_file, bits):
    """Logits and every LoRA gradient of the k-bit model equal those of the unquantized PEFT model whose weights are
    the dequantized ones, also after an eval-mode forward (bitsandbytes 0.50's CPU repacking would otherwise drop
    the gradient through the frozen 4-bit base from then on)."""
    from bdlora.train.trainer import build_peft_model

    cfg = _cfg(tiny_llama_dir, train_file, load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    model, spec = build_peft_model(cfg, tiny_llama_dir)
    _randomize(model, seed=2)
    ref = _dequantized_reference(model, tiny_llama_dir, spec)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    model.eval(), ref.eval()
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=1e-5 if bits == 4 else 0.2, rtol=1e-4 if bits == 4 else 0.1)
    model.train(), ref.train()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(got) == 28
    worst = max(((got[n] - want[n]).norm() / want[n].norm()).item() for n in want)
    assert worst < (1e-4 if bits == 4 else 2e-2), worst


@pytest.mark.parametrize("bits", [4, 8])
def test_kernel_variant_on_kbit_base_matches_peft_kbit_layer(tiny_llama_dir, train_file, bits):
    """``lora_backend: cublas`` on a k-bit base: every BD layer's LoRA term runs on bdlora's kernels, added onto the
    base layer's own k-bit output, and logits and every LoRA gradient equal PEFT's k-bit layer's on the same
    weights; the base output PEFT's 8-bit layer hands over is left as it was (the term goes onto a copy)."""
    from bdlora.train.trainer import build_peft_model

    kw = dict(load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    ref, _ = build_peft_model(_cfg(tiny_llama_dir, train_file, lora_backend="peft", **kw), tiny_llama_dir)
    fused, _ = build_peft_model(_cfg(tiny_llama_dir, train_file, lora_backend="cublas", **kw), tiny_llama_dir)
    for m in (ref, fused):
        _randomize(m, seed=2)
    layers = [m for _, m in _lora_layers(fused)]
    assert len(layers) == 14 and all(type(m.get_base_layer()) is KBIT[bits] for m in layers)
    assert {type(m.lora_variant["default"]).__name__ for m in layers} == {"KernelBdLoraKbitVariant"}
    terms, bases = [], []
    for m in layers:  # count the kernel calls and keep what the base layer returned
        variant = m.lora_variant["default"]
        add = variant.add_term_
        variant.add_term_ = lambda result, x, call, add=add: terms.append(1) or add(result, x, call)
        m.get_base_layer().register_forward_hook(lambda mod, args, out: bases.append((out, out.clone())))
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(0))
    ref.train(), fused.train()
    out_ref, out = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert len(terms) == 14
    for got, before in bases:
        assert torch.equal(got, before)
    torch.testing.assert_close(out.logits, out_ref.logits, atol=1e-5, rtol=1e-4)
    out_ref.loss.backward(), out.loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    got = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    assert got.keys() == want.keys() and len(got) == 28
    for n in want:
        torch.testing.assert_close(got[n], want[n], atol=1e-6, rtol=1e-4, msg=n)


def test_cpu_repacking_is_switched_off(tiny_llama_dir):
    """bitsandbytes 0.50 repacks a 4-bit weight for CPU inference at the first eval forward (no autograd from then
    on); bdlora switches that off at load and refuses a model where it already happened."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    def load():
        return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32,
                                                    quantization_config=BitsAndBytesConfig(load_in_4bit=True)).eval()

    m = load()
    if not m.model.layers[0].self_attn.q_proj.support_avx512bf16_for_cpu:
        pytest.skip("this CPU has no AVX512-BF16: bitsandbytes never repacks here")
    with torch.no_grad():
        m(input_ids=torch.tensor([[5, 6, 7]]))
    assert m.model.layers[0].self_attn.q_proj.weight.quant_state.packing_format_for_cpu
    with pytest.raises(QuantError, match="already repacked"):
        disable_cpu_inference_packing(m)
    m = load()
    assert disable_cpu_inference_packing(m) == 14
    with torch.no_grad():
        m(input_ids=torch.tensor([[5, 6, 7]]))
    assert not getattr(m.model.layers[0].self_attn.q_proj.weight.quant_state, "packing_format_for_cpu", False)


@pytest.mark.parametrize("bits", [4, 8])
def test_merge_into_kbit_weight_adds_the_bd_delta(tiny_llama_dir, train_file, bits):
    """PEFT's bnb merge dequantizes, calls the variant's merge_safe and requantizes: the merged weight is the old one
    plus the block-diagonal delta up to the requantization error; unmerge comes back the same way."""
    from bdlora.train.trainer import build_peft_model

    cfg = _cfg(tiny_llama_dir, train_file, load_in_4bit=bits == 4, load_in_8bit=bits == 8)
    model, _ = build_peft_model(cfg, tiny_llama_dir)
    _randomize(model, seed=4, std=0.01)
    m = model.base_model.model.model.layers[1].mlp.down_proj
    W0 = dequantized_weight(m.get_base_layer()).float()
    delta = kbit_variant_class().delta_weight(m, "default")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        m.merge()
        W1 = dequantized_weight(m.get_base_layer()).float()
        m.unmerge()
    want = (W0 + delta).detach()
    if bits == 4:  # exactly bitsandbytes' 4-bit quantization of the float merge
        import bitsandbytes.functional as BF

        qs = m.get_base_layer().weight.quant_state
        q, st = BF.quantize_4bit(want, blocksize=qs.blocksize, compress_statistics=qs.nested, quant_type=qs.quant_type)
        torch.testing.assert_close(W1, BF.dequantize_4bit(q, st).float(), atol=1e-6, rtol=0)
    else:  # int8 rows: rounding to a step of each row's absmax / 127 (+ the fp16 row scale's rounding)
        half_step = want.abs().amax(dim=1, keepdim=True) / 127 / 2
        err = (W1 - want).abs() / half_step
        assert err.max().item() <= 1.25 and err.mean().item() < 0.6


# ---------------------------------------------------------------------------------------------------- training
def test_train_on_4bit_base_lowers_loss_and_saves_a_normal_bd_folder(tiny_llama_dir, train_file, tmp_path):
    from peft import PeftModel
    from peft.tuners.lora.variants import BlockDiagonalLinear
    from transformers import AutoModelForCausalLM

    from bdlora.adapter import load_adapter
    from bdlora.train.trainer import run_training

    out = tmp_path / "run"
    cfg = _cfg(tiny_llama_dir, train_file, out, lr=5e-3, batch_size=8, max_steps=8, eval_every=4, eval_fraction=0.1,
               gradient_checkpointing=True)
    res = run_training(cfg)
    losses = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "train_loss" in json.loads(line)]
    assert len(losses) == 8 and sum(losses[-2:]) / 2 < sum(losses[:2]) / 2 - 0.5, losses
    folder = res.adapter_dir
    card = (folder / "README.md").read_text()
    assert "bitsandbytes 4-bit (nf4, double quantization) quantized base" in card
    conf = json.loads((folder / "adapter_config.json").read_text())
    assert conf["use_bdlora"]["nblocks"] == 2 and conf["r"] == 8 and conf["use_rslora"]
    assert "quantization" not in json.dumps(conf).lower()
    ad = load_adapter(folder)  # bdlora's strict reader
    assert ad.config.is_bd and ad.config.nblocks == 2

    # PEFT on the UNQUANTIZED base: BD factors, the trained values
    trained = {k.replace(".default", ""): v for k, v in res.model.state_dict().items() if "lora_" in k}
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(plain, str(folder))
    q = loaded.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.lora_B["default"], BlockDiagonalLinear) and tuple(q.lora_B["default"].weight.shape) == (256, 4)
    got = {k.replace(".default", ""): v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert got.keys() == trained.keys()
    for k in trained:
        torch.testing.assert_close(got[k], trained[k], atol=0, rtol=0)

    # ... and on the dequantized base it reproduces the trained 4-bit model's logits exactly
    spec = res.spec
    deq = _dequantized_reference(res.model, tiny_llama_dir, spec)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(7))
    res.model.eval(), deq.eval()
    with torch.no_grad():
        torch.testing.assert_close(deq(input_ids=ids).logits, res.model(input_ids=ids).logits, atol=1e-5, rtol=1e-4)

    # on a 4-bit base again (inference), after enable_bdlora_on_kbit: same logits as the trained model
    again = _peft_on_fresh_4bit_base(tiny_llama_dir, folder)
    check_kbit_bd(again, 2)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, res.model(input_ids=ids).logits, atol=1e-5, rtol=1e-4)


def test_kbit_upcast_fp32_is_peft_prepare_and_off_by_default(tiny_llama_dir, train_file):
    from bdlora.train.trainer import load_base_model

    kept = load_base_model(_cfg(tiny_llama_dir, train_file, precision="bf16"), tiny_llama_dir, "cpu")
    assert kept.model.embed_tokens.weight.dtype == torch.bfloat16 and kept.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(kept.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    assert kept.model.layers[0].self_attn.q_proj.weight.quant_state.dtype == torch.bfloat16
    up = load_base_model(_cfg(tiny_llama_dir, train_file, precision="bf16", kbit_upcast_fp32=True), tiny_llama_dir,
                         "cpu")
    assert up.model.embed_tokens.weight.dtype == torch.float32 and up.model.norm.weight.dtype == torch.float32
    assert not any(p.requires_grad for p in kept.parameters()) and not any(p.requires_grad for p in up.parameters())


def test_quantization_config_from_keys(train_file, tiny_llama_dir):
    from bdlora.train.trainer import kbit_quantization_config

    q = kbit_quantization_config(_cfg(tiny_llama_dir, train_file, precision="bf16"), "cuda")
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.bfloat16
    q = kbit_quantization_config(_cfg(tiny_llama_dir, train_file, bnb_4bit_quant_type="fp4",
                                      bnb_4bit_use_double_quant=False, bnb_4bit_compute_dtype="fp16"), "cpu")
    assert q.bnb_4bit_quant_type == "fp4" and not q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype == torch.float16
    q = kbit_quantization_config(_cfg(tiny_llama_dir, train_file, load_in_4bit=False, load_in_8bit=True), "cpu")
    assert q.load_in_8bit and not q.load_in_4bit
    assert kbit_quantization_config(_cfg(tiny_llama_dir, train_file, load_in_4bit=False), "cpu") is None


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("keys,key,msg", [
    ({"load_in_8bit": True}, "load_in_8bit", "both true; choose one"),
    ({"load_in_4bit": False, "bnb_4bit_quant_type": "nf4"}, "bnb_4bit_quant_type", "only applies with load_in_4bit"),
    ({"load_in_4bit": False, "load_in_8bit": True, "bnb_4bit_use_double_quant": True}, "bnb_4bit_use_double_quant",
     "load_in_8bit has no 4-bit options"),
    ({"load_in_4bit": False, "bnb_4bit_compute_dtype": "bf16"}, "bnb_4bit_compute_dtype", "only applies"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type", "not one of \\['nf4', 'fp4'\\]"),
    ({"bnb_4bit_compute_dtype": "float16"}, "bnb_4bit_compute_dtype", "not one of \\['bf16', 'fp16', 'fp32'\\]"),
    ({"load_in_4bit": False, "kbit_upcast_fp32": True}, "kbit_upcast_fp32", "only applies with load_in_4bit or"),
    ({"load_in_4bit": "yes"}, "load_in_4bit", "must be true or false"),
    ({"training_args": {"fsdp": "full_shard"}}, "training_args.fsdp", "over a 4-bit base is not supported"),
])
def test_kbit_key_refusals(train_file, tiny_llama_dir, keys, key, msg):
    with pytest.raises(ConfigError, match=f"{key}: .*{msg}"):
        _cfg(tiny_llama_dir, train_file, **keys)


def test_missing_bitsandbytes_is_a_config_error(tiny_llama_dir, train_file, monkeypatch):
    import bdlora.quant as quant
    from bdlora.train.trainer import build_peft_model

    monkeypatch.setattr(quant, "bnb_problem", lambda: "bitsandbytes is not installed; pip install 'bdlora[quant]'")
    with pytest.raises(ConfigError, match=r"load_in_4bit: bitsandbytes is not installed; pip install 'bdlora\[quant\]'"):
        build_peft_model(_cfg(tiny_llama_dir, train_file), tiny_llama_dir)


def _sweep(tiny_llama_dir, train_file, out, jobs, **kw):
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.engine import Engine

    run = {"model": str(tiny_llama_dir), "train_file": train_file, "output_dir": str(out), "load_in_4bit": True,
           "max_steps": 6, "batch_size": 4, "lr": 5e-3, "max_length": 64, "eval_fraction": 0.2, "eval_every": 3,
           "scheduler": "constant", "warmup_ratio": 0.0, "token_budget": 512, "save_plots": False,
           "log_every": 10**6, "jobs": jobs, **kw}
    return Engine(parse_run(run))


def _peft_eval_loss_on_4bit(tiny_llama_dir, folder, samples) -> float:
    """The saved adapter loaded by PEFT on a freshly quantized 4-bit base: response-token mean loss on ``samples``."""
    model = _peft_on_fresh_4bit_base(tiny_llama_dir, folder)
    check_kbit_bd(model, json.loads((folder / "adapter_config.json").read_text())["use_bdlora"]["nblocks"])
    tot, n = 0.0, 0
    with torch.no_grad():
        for smp in samples:
            ids = torch.tensor([smp.input_ids])
            mask = torch.tensor(smp.loss_mask[1:], dtype=torch.bool)
            logits = model(input_ids=ids).logits[0, :-1]
            tot += float(torch.nn.functional.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum"))
            n += int(mask.sum())
    return tot / n


def test_engine_trains_jobs_on_one_4bit_base(tiny_llama_dir, train_file, tmp_path):
    """`bdlora sweep` with load_in_4bit: the jobs share one bitsandbytes 4-bit base; each job's saved folder is a
    normal BD adapter that PEFT, on a 4-bit base of its own, scores as the engine did; and a job trained beside
    another equals the same job trained alone."""
    jobs = [{"name": "bd2", "nblocks": 2, "r": 8}, {"name": "bd4", "nblocks": 4, "r": 8, "seed": 1}]
    eng = _sweep(tiny_llama_dir, train_file, tmp_path / "both", jobs)
    assert all(isinstance(m.base, bnb.nn.Linear4bit) for m in eng.model.modules()
               if type(m).__name__ == "MultiLoraLinear")
    # the memory model counts the base's bytes as stored (4-bit weights: packed uint8), not as bf16 parameters
    from bdlora.train.engine.memory import WORKSPACE_BYTES

    stored = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    assert eng.memory.beta[0] == pytest.approx(stored + WORKSPACE_BYTES, abs=8)
    rows = eng.run()
    assert [r["stop_reason"] for r in rows] == ["completed", "completed"]
    for job, row in zip(eng.jobs, rows):
        train = [loss for _, loss in job.history["train"]]
        assert len(train) == 6 and train[-1] < train[0] - 0.3, train
        folder = Path(row["adapter"])
        conf = json.loads((folder / "adapter_config.json").read_text())
        assert conf["use_bdlora"]["nblocks"] == job.cfg.nblocks and conf["r"] == 8
        got = _peft_eval_loss_on_4bit(tiny_llama_dir, folder, job.data.val)
        assert got == pytest.approx(row["final_eval_loss"], rel=1e-4), (job.cfg.name, got, row["final_eval_loss"])

    alone = _sweep(tiny_llama_dir, train_file, tmp_path / "alone", jobs[1:]).run()
    from bdlora.adapter import load_adapter

    a, b = load_adapter(rows[1]["adapter"]), load_adapter(alone[0]["adapter"])
    assert a.modules.keys() == b.modules.keys()
    for k in a.modules:
        torch.testing.assert_close(a.modules[k].lora_A, b.modules[k].lora_A, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(a.modules[k].lora_B, b.modules[k].lora_B, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("where,keys,msg", [
    ("job", {"load_in_4bit": True}, "load_in_4bit: is shared by every job of a run"),
    ("top", {"load_in_8bit": True, "load_in_4bit": False}, "load_in_8bit: True is not supported by `bdlora sweep`"),
    ("top", {"kbit_upcast_fp32": True}, "kbit_upcast_fp32: True is not supported by `bdlora sweep`"),
    ("top", {"pipeline_stages": 2}, "load_in_4bit: pipeline stages load their layers"),
])
def test_engine_kbit_refusals(tiny_llama_dir, train_file, tmp_path, where, keys, msg):
    from bdlora.train.engine.config import parse_run

    job = {"name": "a", **(keys if where == "job" else {})}
    run = {"model": str(tiny_llama_dir), "train_file": train_file, "output_dir": str(tmp_path / "e"),
           "load_in_4bit": True, "max_steps": 1, "jobs": [job], **(keys if where == "top" else {})}
    with pytest.raises(ConfigError, match=re.escape(msg)):
        parse_run(run)


def test_resume_check_accepts_checkpoints_from_before_the_kbit_keys(tiny_llama_dir, train_file, tmp_path):
    import yaml

    from bdlora.train.trainer import CONFIG_NAME, check_resume_compatible

    cfg = _cfg(tiny_llama_dir, train_file, load_in_4bit=False)
    old = {k: v for k, v in cfg.to_dict().items() if "bit" not in k and k != "kbit_upcast_fp32"}
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    (ckpt / CONFIG_NAME).write_text(yaml.safe_dump(old))
    check_resume_compatible(ckpt, cfg, 1)  # an unquantized run then and now
    with pytest.raises(ConfigError, match="load_in_4bit: False -> True"):
        check_resume_compatible(ckpt, _cfg(tiny_llama_dir, train_file), 1)


def test_check_bd_structure_refuses_a_wrong_block_count(tiny_llama_dir, train_file):
    from bdlora.peft_model import check_bd_structure
    from bdlora.train.trainer import build_peft_model

    model, spec = build_peft_model(_cfg(tiny_llama_dir, train_file), tiny_llama_dir)
    expected = {n: (ROW if spec.layout_of(n.rsplit(".", 1)[-1]) == ROW else COLUMN) for n, _ in _lora_layers(model)}
    check_bd_structure(model, spec, expected)
    model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].nblocks = 4
    with pytest.raises(BDLoraError, match="q_proj: block-diagonal factor of 4 blocks"):
        check_bd_structure(model, spec, expected)
    with pytest.raises(QuantError, match="expected exactly one block-diagonal factor of 2 blocks"):
        check_kbit_bd(model, 2)


# ---------------------------------------------------------------------------------------------------- the benchmark
def test_bench_kbit_builds_a_quantized_llama_layer_by_layer_and_trains(tmp_path):
    """bench/train/bench_kbit.py on CPU with the tiny shape: meta init, projections quantized one by one, the
    trainer's k-bit model-building checks, a few steps, one JSON object."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "train" / "bench_kbit.py"
    spec = importlib.util.spec_from_file_location("bench_kbit", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--shape", "tiny", "--device", "cpu", "--steps", "3", "--warmup", "1", "--seq", "32",
                       "--nblocks", "2", "--r", "8", "--lr", "1e-2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lora_layers"] == 14 and res["nblocks"] == 2 and res["tokens_per_s"] > 0
    assert len(res["losses"]) == 4 and all(math.isfinite(x) for x in res["losses"])
    # the built base: every projection a quantized Linear4bit, nothing left on the meta device
    base = bench.build_quantized_llama(bench.SHAPES["tiny"], torch.device("cpu"))
    q = base.model.layers[1].mlp.down_proj
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.bnb_quantized and q.weight.quant_type == "nf4"
    assert dequantized_weight(q).shape == (256, 512)
    assert not any(p.is_meta for p in base.parameters())
