"""bdlora's kernel variant of PEFT's BD-LoRA layer (``bdlora.peft_model.use_bdlora_kernels``) against PEFT's own
layer on the same weights: outputs and every LoRA gradient, both layouts, N = 1 / 2 / 4, dropout against the
kernels' counter-hash masks, the Triton dS/dB and dropout kernels under the interpreter, merge and save unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from bdlora import BDLoraSpec
from bdlora.kernels import KernelOptions
from bdlora.kernels.dropout import segment_keep_mask
from bdlora.peft_model import LORA_BACKENDS, use_bdlora_kernels
from bdlora.spec import BDLoraError
from tests.conftest import randomize_lora


def _peft_model(model_dir, spec, dtype=torch.float32, seed=0):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = get_peft_model(base, spec.to_peft_config(task_type="CAUSAL_LM"))
    randomize_lora(model, seed=seed)
    return model


def _bf16_pair(model_dir, spec, backend):
    """(PEFT's model on a bf16 base with fp32 factors, as bdlora train's bf16 precision has them; a copy of it with
    its BD layers on ``backend``)."""
    ref = _peft_model(model_dir, spec, dtype=torch.bfloat16)
    for p in ref.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    other = copy.deepcopy(ref)
    assert use_bdlora_kernels(other, backend) == 14
    return ref, other


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


def _ids(n=2, t=37, vocab=512, seed=3):
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fuse_base", [True, False])
@pytest.mark.parametrize("nblocks,r", [(1, 8), (2, 8), (4, 16)])
def test_kernel_variant_matches_peft_layer(tiny_llama_dir, nblocks, r, fuse_base):
    """Base GEMM and LoRA term in one function (``fuse_base``) or the term added onto PEFT's base layer output."""
    spec = BDLoraSpec(nblocks=nblocks, r=r, lora_alpha=16)
    ref = _peft_model(tiny_llama_dir, spec)
    fused = copy.deepcopy(ref)
    assert use_bdlora_kernels(fused, "cublas", fuse_base=fuse_base) == 14  # 7 projections x 2 layers
    ids = _ids()
    logits_ref, g_ref = _loss_and_grads(ref, ids)
    logits, g = _loss_and_grads(fused, ids)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    assert g.keys() == g_ref.keys() and len(g) == 28
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_kernel_variant_bf16_activations_fp32_factors(tiny_llama_dir):
    """A bf16 base with fp32 factors (bdlora train's bf16 precision): products in bf16 as under autocast, gradients
    in the factors' fp32; PEFT's layer under bf16 autocast is the reference."""
    ref, fused = _bf16_pair(tiny_llama_dir, BDLoraSpec(nblocks=2, r=8, lora_alpha=16), "cublas")
    ids = _ids()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits_ref, g_ref = _loss_and_grads(ref, ids)
        logits, g = _loss_and_grads(fused, ids)
    assert all(t.dtype == torch.float32 for t in g.values())
    # bf16 products round differently per CPU (native bf16 dot products on AVX512-BF16): bound the whole tensor's
    # relative error and the worst logit; dropping the LoRA term gives 1.3 and 4.7 here
    diff = (logits.float() - logits_ref.float())
    assert diff.norm() / logits_ref.float().norm() < 0.05 and diff.abs().max() < 0.25, float(diff.abs().max())
    for name in g_ref:
        err = (g[name] - g_ref[name]).norm() / g_ref[name].norm()
        assert err < 0.05, (name, float(err))


def test_kernel_variant_dropout_uses_counter_masks(tiny_llama_dir):
    """With dropout the layer's LoRA term is scale * (x * keep / (1 - p)) @ A @ B with keep the kernels'
    counter-hash mask of the seed drawn from torch's CPU generator; eval mode has no dropout."""
    from peft.tuners.lora.layer import Linear

    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16, lora_dropout=0.3)
    model = _peft_model(tiny_llama_dir, spec)
    use_bdlora_kernels(model, "cublas")
    layer = next(m for n, m in model.named_modules() if isinstance(m, Linear) and n.endswith("down_proj"))
    a, b = layer.lora_A["default"], layer.lora_B["default"]
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(0))
    base = layer.base_layer(x)
    a_full = torch.block_diag(*a.weight.chunk(2, 0)) if hasattr(a, "nblocks") else a.weight
    b_full = b.weight
    scale = layer.scaling["default"]

    layer.train()
    torch.manual_seed(11)
    y = layer(x)
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**62, ()))
    keep = segment_keep_mask(seed, 0, 10, layer.in_features, 0.3, x.device).view_as(x)
    want = base + scale * ((x * keep / 0.7) @ a_full.t() @ b_full.t())
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert 0.6 < keep.float().mean() < 0.8

    layer.eval()
    torch.testing.assert_close(layer(x), base + scale * (x @ a_full.t() @ b_full.t()), rtol=1e-5, atol=1e-5)


def test_kernel_variant_triton_kernels_under_interpreter(tiny_llama_dir):
    """The fused dS/dB kernel (dense B up to rank 64) and the dropout kernels, as they run on a GPU, here under the
    Triton interpreter: gradients equal PEFT's layer's (dropout off) and the dropout route's expectation."""
    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16, column_modules=("q_proj",), row_modules=("down_proj",))
    ref = _peft_model(tiny_llama_dir, spec)
    fused = copy.deepcopy(ref)
    use_bdlora_kernels(fused, "cublas", KernelOptions(fused_dsdb=True, fused_dropout=True))
    ids = _ids(n=1, t=19)
    logits_ref, g_ref = _loss_and_grads(ref, ids)
    logits, g = _loss_and_grads(fused, ids)
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_fused_base_runs_where_peft_would_add_the_term(tiny_llama_dir):
    """With ``fuse_base`` a layer's call skips its base layer (the base GEMM runs inside the fused function) exactly
    where the kernels take the term; disabled or merged adapters, ``adapter_names`` and ``fuse_base=False`` call
    PEFT's base layer, and every route gives PEFT's output. A deep copy keeps the fused layers."""
    from peft.tuners.lora.layer import Linear

    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    ref = _peft_model(tiny_llama_dir, spec)
    fused, unfused = copy.deepcopy(ref), copy.deepcopy(ref)
    use_bdlora_kernels(fused, "cublas")
    use_bdlora_kernels(unfused, "cublas", fuse_base=False)
    base_calls = []

    def count_base_calls(model):
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert len(layers) == 14
        for m in layers:
            m.base_layer.register_forward_hook(lambda *a: base_calls.append(1))

    count_base_calls(fused)
    count_base_calls(unfused)
    ids = _ids()
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        torch.testing.assert_close(fused(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert base_calls == []
        torch.testing.assert_close(unfused(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert len(base_calls) == 14
        base_calls.clear()
        with fused.disable_adapter():
            with ref.disable_adapter():
                base_want = ref(input_ids=ids).logits
            torch.testing.assert_close(fused(input_ids=ids).logits, base_want, rtol=0, atol=0)
        assert len(base_calls) == 14 and not torch.allclose(base_want, want)
        base_calls.clear()
        fused.eval()  # PEFT takes adapter_names in eval mode only
        mixed = fused(input_ids=ids, adapter_names=["default", "__base__"]).logits
        torch.testing.assert_close(mixed[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mixed[1], base_want[1], rtol=1e-5, atol=1e-5)
        assert len(base_calls) == 14
        copied = copy.deepcopy(fused)
        assert {type(m).__name__ for m in copied.modules() if isinstance(m, Linear)} == {"KernelLoraLinear"}
        base_calls.clear()
        torch.testing.assert_close(copied(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
        assert base_calls == []  # the copy's hooks count into the same list: none ran
        fused.merge_adapter()
        torch.testing.assert_close(fused(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        assert len(base_calls) == 14


def test_kernel_variant_keeps_peft_merge_and_save(tiny_llama_dir, tmp_path):
    """The variant changes only how the LoRA term is computed: merged weights and the saved adapter are PEFT's."""
    from safetensors.torch import load_file

    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    ref = _peft_model(tiny_llama_dir, spec)
    fused = copy.deepcopy(ref)
    use_bdlora_kernels(fused, "cublas")
    ref.save_pretrained(tmp_path / "ref")
    fused.save_pretrained(tmp_path / "fused")
    a, b = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ref", "fused"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = _ids()
    with torch.no_grad():
        unmerged = fused(input_ids=ids).logits
        merged = fused.merge_and_unload()(input_ids=ids).logits
    torch.testing.assert_close(merged, unmerged, rtol=1e-4, atol=1e-4)


def test_backend_choice(tiny_llama_dir):
    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    model = _peft_model(tiny_llama_dir, spec)
    assert LORA_BACKENDS == ("auto", "peft", "cublas")
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    assert use_bdlora_kernels(model, "peft") == 0
    assert use_bdlora_kernels(model, "auto") == 14
    with torch.no_grad():  # on CPU "auto" runs PEFT's own computation: the same logits bit for bit
        assert torch.equal(model(input_ids=ids).logits, want)
    with pytest.raises(BDLoraError, match="lora_backend: 'fast' is not one of"):
        use_bdlora_kernels(model, "fast")


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_auto_under_autocast_is_peft_bit_for_bit(tiny_llama_dir, dropout):
    """Calls "auto" leaves to PEFT's computation, under bf16 autocast with a bf16 base and fp32 factors (bdlora
    train's bf16 setup): without dropout the input goes to PEFT uncast (the GEMMs cast it for autocast anyway), with
    dropout cast as PEFT does (its masks depend on the dtype); logits and every gradient equal PEFT's own layer bit for
    bit either way."""
    ref, auto = _bf16_pair(tiny_llama_dir, BDLoraSpec(nblocks=2, r=8, lora_alpha=16, lora_dropout=dropout), "auto")
    ref.train(), auto.train()
    ids = _ids()
    results = []
    for model in (ref, auto):
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(model, ids))
    (logits_ref, g_ref), (logits, g) = results
    assert torch.equal(logits, logits_ref)
    assert g.keys() == g_ref.keys() and all(torch.equal(g[n], g_ref[n]) for n in g_ref)
    if not dropout:  # and without PEFT's two copies of the input per layer (to fp32 and back) in the forward
        def copies(model):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                    model(input_ids=ids)
            return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")

        assert copies(ref) - copies(auto) >= 2 * 14


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_trainer_trains_the_same_adapter_on_either_backend(tiny_llama_dir, tmp_path, monkeypatch, capsys, compiled):
    """``bdlora train`` with ``lora_backend: cublas`` against ``peft``: the same adapter after a few AdamW steps;
    also with ``training_args.torch_compile`` (the custom op inside the graph; AOTAutograd without code generation,
    which traces what inductor compiles), the adapter saved from the compiled model."""
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    from bdlora.train.config import TrainConfig
    from bdlora.train.tasks import toy_chat_records, write_jsonl
    from bdlora.train.trainer import run_training

    # TrainingArguments' torch_compile exports the backend to accelerate through the environment: keep it to this test
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
    data = write_jsonl(toy_chat_records(12, seed=2), tmp_path / "d.jsonl")
    adapters = {}
    for backend in ("peft", "cublas"):
        extra = ({"torch_compile": True, "torch_compile_backend": "aot_eager"}
                 if compiled and backend == "cublas" else {})
        cfg = TrainConfig(model=str(tiny_llama_dir), nblocks=2, r=8, lora_alpha=16, train_file=str(data),
                          eval_fraction=0.0, lr=5e-3, warmup_ratio=0.0, batch_size=4, max_steps=3, seed=4,
                          lora_backend=backend, output_dir=str(tmp_path / backend), report_to=[], progress=False,
                          training_args=extra)
        torch._dynamo.reset()
        counters.clear()
        adapters[backend] = load_file(run_training(cfg).adapter_dir / "adapter_model.safetensors")
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
        assert bool(counters["stats"]["unique_graphs"]) == bool(extra)  # the compiled run really compiled
        said = "lora_backend cublas (bdlora's kernels as a custom op in the graph under torch_compile)"
        assert (said in capsys.readouterr().out) == bool(extra)
    ref, got = adapters["peft"], adapters["cublas"]
    assert ref.keys() == got.keys() and len(ref) == 28
    moved = 0
    for k in ref:
        # fp32, summation orders differ between the two layers; Adam divides by sqrt(v), so an entry whose gradient is
        # ~0 can move by ~1e-5 from that noise (seen on AVX512 CPUs); factors are 0.005-0.09 here
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=3e-5, msg=k)
        moved += bool("lora_B" in k and ref[k].abs().max() > 0)
    assert moved == 14  # B starts at zero: every layer was really trained


def test_regional_compilation_trains_the_adapter_whole_model_compilation_trains(tiny_llama_dir, tmp_path,
                                                                                  monkeypatch):
    """accelerate's regional compilation (``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1`` or ``accelerate launch
    --dynamo_use_regional_compilation``: the repeated decoder layer compiled once, not the whole model) with the
    custom op in each layer's graph: the same adapter, bit for bit, as compiling the whole model."""
    from safetensors.torch import load_file
    from torch._dynamo.utils import counters

    from bdlora.train.config import TrainConfig
    from bdlora.train.tasks import toy_chat_records, write_jsonl
    from bdlora.train.trainer import run_training

    data = write_jsonl(toy_chat_records(12, seed=2), tmp_path / "d.jsonl")
    adapters, graphs = {}, {}
    for regional in ("0", "1"):
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", regional)
        cfg = TrainConfig(model=str(tiny_llama_dir), nblocks=2, r=8, lora_alpha=16, train_file=str(data),
                          eval_fraction=0.0, lr=5e-3, warmup_ratio=0.0, batch_size=4, max_steps=3, seed=4,
                          lora_backend="cublas", output_dir=str(tmp_path / regional), report_to=[], progress=False,
                          training_args={"torch_compile": True, "torch_compile_backend": "aot_eager"})
        torch._dynamo.reset()
        counters.clear()
        adapters[regional] = load_file(run_training(cfg).adapter_dir / "adapter_model.safetensors")
        graphs[regional] = counters["stats"]["unique_graphs"]
    # the whole model: one graph (and its dynamic-shape recompile); regions: a graph per compiled piece
    assert 0 < graphs["0"] < graphs["1"]
    whole, regional = adapters["0"], adapters["1"]
    assert whole.keys() == regional.keys() and len(whole) == 28
    assert all(torch.equal(whole[k], regional[k]) for k in whole)


def test_partitioned_factors_take_peft_calls(tiny_llama_dir):
    """Factors partitioned by DeepSpeed ZeRO-3 (a ``ds_id`` on the parameter: gathered only when their sub-module is
    called) go through PEFT's own sub-module calls, even with ``cublas`` asked for."""
    from peft.tuners.lora.layer import Linear

    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    model = _peft_model(tiny_llama_dir, spec)
    use_bdlora_kernels(model, "cublas")
    layer = next(m for m in model.modules() if isinstance(m, Linear))
    calls = []
    layer.lora_A["default"].register_forward_hook(lambda *a: calls.append(1))
    x = torch.randn(3, layer.in_features)
    layer(x)
    assert calls == []  # the kernels read the factors directly
    layer.lora_A["default"].weight.ds_id = 7
    y = layer(x)
    assert calls == [1]
    del layer.lora_A["default"].weight.ds_id
    torch.testing.assert_close(y, layer(x), rtol=1e-5, atol=1e-6)
    base_calls = []
    layer.base_layer.register_forward_hook(lambda *a: base_calls.append(1))
    layer(x)
    assert base_calls == []  # the fused route: the base GEMM inside the kernels' function
    layer.base_layer.weight.ds_id = 3  # a partitioned base weight: the base layer's own call gathers it
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-6)
    assert base_calls == [1]


@pytest.mark.parametrize("backend", ["cublas", "auto"])
def test_compiled_model_matches_peft_layer(tiny_llama_dir, backend):
    """Under torch.compile (``training_args.torch_compile``) ``cublas`` runs the kernels inside the compiled graph
    (the ``bdlora::train_lora_linear`` custom op: one graph, no break at any of the 14 layers) and ``auto`` compiles
    PEFT's layer with the model: the same logits and LoRA gradients as PEFT's layer in eager mode. Dynamo's AOTAutograd
    backend traces exactly what inductor would, without code generation."""
    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16)
    ref = _peft_model(tiny_llama_dir, spec)
    fused = copy.deepcopy(ref)
    assert use_bdlora_kernels(fused, backend) == 14
    ids = _ids()
    logits_ref, g_ref = _loss_and_grads(ref, ids)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fused)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons[:3]
    fused.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(fused, backend="aot_eager")
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits.detach(), logits_ref, rtol=1e-5, atol=1e-5)
    g = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
    assert g.keys() == g_ref.keys() and len(g) == 28
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU code generation needs a CUDA GPU")
@pytest.mark.parametrize("nblocks", [2, 4])
def test_compiled_model_on_gpu_matches_peft_layer(tmp_path, nblocks):
    """``bdlora train``'s compiled GPU setup (bf16 base, fp32 factors, bf16 autocast, inductor, lengths that change
    between calls so the graph turns dynamic) with the custom op inside the graph: the same loss and LoRA gradients
    as PEFT's layer in eager mode, up to bf16 rounding, at widths where every GPU route of the layer runs. The
    factors are small enough that the adapter does not dominate the base (else bf16 rounding differences grow
    layer by layer and no tolerance separates a bug from them)."""
    from bdlora.models import build_random_llama

    model_dir = build_random_llama(tmp_path / "m", hidden_size=1024, num_heads=8, num_kv_heads=2,
                                   intermediate_size=3584, vocab_size=4096, dtype="bfloat16", init_std=0.02,
                                   device="cuda")
    ref = _peft_model(model_dir, BDLoraSpec(nblocks=nblocks, r=64, lora_alpha=128), dtype=torch.bfloat16).cuda()
    randomize_lora(ref, std=0.004)
    for p in ref.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    fused = copy.deepcopy(ref)
    assert use_bdlora_kernels(fused, "cublas") == 14
    torch._dynamo.reset()
    compiled = torch.compile(fused)
    for t in (37, 53, 41):
        ids = _ids(n=3, t=t, vocab=4096, seed=t).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref.zero_grad(set_to_none=True)
            loss_ref = ref(input_ids=ids, labels=ids).loss
            loss_ref.backward()
            fused.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
        # measured on an H200: the eager kernels differ from PEFT's layer by up to ~3% of a gradient's largest entry
        torch.testing.assert_close(loss.detach().float(), loss_ref.detach().float(), rtol=0, atol=5e-3)
        g_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        g = {n: p.grad for n, p in fused.named_parameters() if p.requires_grad}
        assert g.keys() == g_ref.keys() and len(g) == 28
        for name in g_ref:
            err = (g[name] - g_ref[name]).abs().max() / g_ref[name].abs().max()
            assert err < 0.06, (name, t, err.item())


def test_fused_base_matches_the_term_added_onto_the_base_output_with_dropout_under_autocast(tiny_llama_dir):
    """``bdlora train``'s GPU setup (bf16 base, fp32 factors, bf16 autocast) with dropout, through gradient
    checkpointing: the fused base GEMM draws the same masks as the term added onto PEFT's base output (one seed per
    call from torch's CPU generator, again in the recomputation) and gives the same logits and gradients up to bf16
    rounding of the two summation orders."""
    spec = BDLoraSpec(nblocks=2, r=8, lora_alpha=16, lora_dropout=0.2)
    ref, fused = _bf16_pair(tiny_llama_dir, spec, "cublas")
    unfused = copy.deepcopy(ref)
    use_bdlora_kernels(unfused, "cublas", fuse_base=False)
    ids = _ids()
    results = []
    for model in (unfused, fused):
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        torch.manual_seed(9)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_loss_and_grads(model, ids))
    (logits_ref, g_ref), (logits, g) = results
    diff = logits.float() - logits_ref.float()
    assert diff.norm() / logits_ref.float().norm() < 0.02, float(diff.norm() / logits_ref.float().norm())
    assert g.keys() == g_ref.keys() and len(g) == 28
    for name in g_ref:
        err = (g[name] - g_ref[name]).norm() / g_ref[name].norm()
        assert err < 0.05, (name, float(err))
    # and the masks matter: another seed moves the gradients well beyond that
    torch.manual_seed(10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, g_other = _loss_and_grads(fused, ids)
    assert max(float((g_other[n] - g[n]).norm() / g[n].norm()) for n in g) > 0.2
