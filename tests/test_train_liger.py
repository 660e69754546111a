"""``use_liger_kernel``: Liger Kernel through transformers' integration, on where it runs (auto), refused with the
reason where ``true`` cannot run, and spelled one way."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from bdlora.train import TrainConfig, run_training
from bdlora.train import trainer as T
from bdlora.train.config import ConfigError


def _cfg(tmp_path, **kw) -> TrainConfig:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"hello world number {i}"}) + "\n" for i in range(8)))
    return TrainConfig(model="tiny-random", nblocks=2, r=4, train_file=str(data), data_format="text",
                       eval_fraction=0.0, max_steps=1, batch_size=2, output_dir=str(tmp_path / "out"), report_to=[],
                       progress=False, **kw)


@pytest.fixture
def gpu_like(monkeypatch):
    """The decision as it is taken on a GPU machine (the kernels themselves only run on one)."""
    monkeypatch.setattr(T, "_use_cpu", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def on_cpu(monkeypatch):
    """A run on the CPU, as on a GPU machine with ``ACCELERATE_USE_CPU=1`` (the CI machines have no GPU)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")


@pytest.fixture
def llama_module_restored(monkeypatch):
    """liger-kernel's patch also replaces transformers' llama module functions and classes for the whole process:
    put them back after the test, so later tests in this worker build and run the plain model."""
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))


def test_auto_is_off_on_cpu_and_says_why(tmp_path, capsys, on_cpu):
    res = run_training(_cfg(tmp_path), validate_adapter=False)
    assert res.step == 1
    assert "Liger kernels off (auto: no GPU" in capsys.readouterr().out


def test_true_on_cpu_is_refused_before_the_model_loads(tmp_path, on_cpu):
    with pytest.raises(ConfigError, match=r"use_liger_kernel: true, but no GPU .*drop the key \(auto\)"):
        run_training(_cfg(tmp_path, use_liger_kernel=True), validate_adapter=False)
    assert not (tmp_path / "out" / "adapter").exists()


def test_decision_on_a_gpu(tmp_path, gpu_like, monkeypatch):
    installed = importlib.util.find_spec("liger_kernel") is not None
    llama = _cfg(tmp_path)
    if installed:
        assert T.liger_choice(llama, "llama") == (True, "on (auto)")
        assert T.liger_choice(_cfg(tmp_path, use_liger_kernel=True), "llama") == (True, "on")
        on, why = T.liger_choice(llama, "gpt2")
        assert not on and "no kernels for model type 'gpt2'" in why
        with pytest.raises(ConfigError, match="no kernels for model type 'gpt2'"):
            T.liger_choice(_cfg(tmp_path, use_liger_kernel=True), "gpt2")
        on, why = T.liger_choice(_cfg(tmp_path, load_in_4bit=True), "llama")
        assert not on and "k-bit base" in why
        compiled = dict(training_args={"torch_compile": True})
        on, why = T.liger_choice(_cfg(tmp_path, lora_backend="cublas", **compiled), "llama")
        assert not on and why.startswith("off (auto: training_args.torch_compile with lora_backend: cublas")
        with pytest.raises(ConfigError, match=r"use_liger_kernel: true, but training_args.torch_compile with "
                                              r"lora_backend: cublas"):
            T.liger_choice(_cfg(tmp_path, lora_backend="cublas", use_liger_kernel=True, **compiled), "llama")
        assert T.liger_choice(_cfg(tmp_path, **compiled), "llama") == (True, "on (auto)")  # auto: PEFT's layer
        # compiling turned on another way: a backend or mode alone (transformers), accelerate's dynamo backend
        for training_args in ({"torch_compile_backend": "inductor"}, {"torch_compile_mode": "max-autotune"}):
            on, why = T.liger_choice(_cfg(tmp_path, lora_backend="cublas", training_args=training_args), "llama")
            assert not on and "torch_compile with lora_backend: cublas" in why
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
        on, why = T.liger_choice(_cfg(tmp_path, lora_backend="cublas"), "llama")
        assert not on and "torch_compile with lora_backend: cublas" in why
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")
        assert T.liger_choice(_cfg(tmp_path, lora_backend="cublas"), "llama") == (True, "on (auto)")
    assert T.liger_choice(_cfg(tmp_path, use_liger_kernel=False), "llama") == (False, "off (use_liger_kernel: false)")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real_find_spec(name, *a))
    on, why = T.liger_choice(llama, "llama")
    assert not on and why == "off (auto: liger-kernel is not installed (pip install liger-kernel))"
    with pytest.raises(ConfigError, match=r"pip install liger-kernel"):
        T.liger_choice(_cfg(tmp_path, use_liger_kernel=True), "llama")


def test_training_args_get_the_decision(tmp_path):
    args = T.training_arguments(_cfg(tmp_path), 1, False, liger=True)
    assert args.use_liger_kernel is True
    assert T.training_arguments(_cfg(tmp_path), 1, False).use_liger_kernel is False


def test_sharded_parameters_leave_out_the_fused_linear_cross_entropy(tmp_path, monkeypatch):
    """Liger's fused loss reads lm_head.weight outside the head's forward: under FSDP2 a DTensor beside PEFT's plain
    hidden states (a mixed-tensor error at the first step on GPUs), under ZeRO-3 an empty partition. FSDP and ZeRO-3
    runs keep the other kernels and use transformers' loss; plain runs and ZeRO-2 keep every kernel."""
    assert not T.training_arguments(_cfg(tmp_path), 1, False, liger=True).liger_kernel_config
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    args = T.training_arguments(_cfg(tmp_path), 1, False, liger=True)
    assert args.use_liger_kernel and args.liger_kernel_config == {"fused_linear_cross_entropy": False}
    assert T.training_arguments(_cfg(tmp_path), 1, False).liger_kernel_config is None
    assert T.liger_kernel_config(experts=True, sharded=True) == {"swiglu": False, "fused_linear_cross_entropy": False}
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert not T.shards_parameters(_cfg(tmp_path))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert T.shards_parameters(_cfg(tmp_path))
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert T.shards_parameters(_cfg(tmp_path, training_args={"deepspeed": str(ds)}))
    assert T.shards_parameters(_cfg(tmp_path, training_args={"deepspeed": {"zero_optimization": {"stage": 3}}}))
    assert not T.shards_parameters(_cfg(tmp_path, training_args={"deepspeed": {"zero_optimization": {"stage": 2}}}))
    assert T.shards_parameters(_cfg(tmp_path, training_args={"fsdp": "full_shard"}))


@pytest.mark.parametrize("text, key", [("training_args: {use_liger_kernel: true}\n", "training_args.use_liger_kernel"),
                                       ("enable_liger_kernel: true\n", "enable_liger_kernel")])
def test_other_spellings_name_the_key(tmp_path, text, key):
    f = tmp_path / "job.yaml"
    f.write_text(f"model: tiny-random\ntrain_file: {tmp_path / 'd.jsonl'}\n" + text)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_yaml(f)
    assert key in str(e.value) and "use_liger_kernel" in str(e.value).replace(key, "")


def _sweep_raw(model, tmp_path, **kw) -> dict:
    from tests.test_engine_utils import run_dict

    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"hello world number {i} of the sweep"}) + "\n" for i in range(24)))
    jobs = [{"name": "r4", "r": 4}, {"name": "r8", "r": 8, "lr": 3e-3}]
    return run_dict(model, data, tmp_path / "out", jobs, **kw)


def test_sweep_takes_it_once_for_the_run(tmp_path, tiny_llama_dir):
    """The engine's jobs share one base: ``use_liger_kernel`` is a run-level key, refused inside ``jobs:``."""
    from bdlora.train.engine.config import parse_run

    assert parse_run(_sweep_raw(tiny_llama_dir, tmp_path, use_liger_kernel=False)).use_liger_kernel is False
    assert parse_run(_sweep_raw(tiny_llama_dir, tmp_path)).use_liger_kernel is None
    raw = _sweep_raw(tiny_llama_dir, tmp_path)
    raw["jobs"][1]["use_liger_kernel"] = True
    with pytest.raises(ConfigError, match="use_liger_kernel"):
        parse_run(raw)


def test_sweep_on_cpu_says_off_and_refuses_true(tmp_path, tiny_llama_dir):
    from bdlora.train.engine import Engine, parse_run

    lines = []
    eng = Engine(parse_run(_sweep_raw(tiny_llama_dir, tmp_path, device="cpu")), log=lines.append)
    assert (eng.liger, eng.liger_note) == (False, "off (auto: no GPU (Liger's kernels are Triton GPU kernels))")
    eng.run()
    assert any("Liger kernels off (auto: no GPU" in line for line in lines)
    with pytest.raises(ConfigError, match=r"use_liger_kernel: true, but no GPU"):
        Engine(parse_run(_sweep_raw(tiny_llama_dir, tmp_path / "t", device="cpu", use_liger_kernel=True)))


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("liger_kernel") is None,
                    reason="Liger's kernels are Triton GPU kernels (and need liger-kernel installed)")
def test_sweep_with_liger_trains_the_same_jobs(tmp_path, tiny_llama_dir, llama_module_restored):
    """On a GPU: two jobs of ``bdlora sweep`` with Liger's RMSNorm / SwiGLU / RoPE on the base against the same
    run without them, in fp32: the same per-step losses and adapters to kernel rounding."""
    from bdlora.train.engine import Engine, parse_run

    from bdlora import load_adapter

    engines, rows = {}, {}
    for liger in (False, True):
        eng = Engine(parse_run(_sweep_raw(tiny_llama_dir, tmp_path / str(liger), device="cuda",
                                          precision="fp32", use_liger_kernel=liger)))
        assert eng.liger is liger
        assert hasattr(eng.model.model.norm, "casting_mode") is liger  # Liger's RMSNorm patched in, or not
        rows[liger] = eng.run()
        engines[liger] = eng
    for ref, got in zip(engines[False].jobs, engines[True].jobs):
        a, b = [v for _, v in ref.history["train"]], [v for _, v in got.history["train"]]
        assert len(a) == len(b) == 3
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (ref.name, a, b)
        # a finished job's factors live in its saved adapter (the engine frees them)
        want, have = (load_adapter(rows[liger][ref.id]["adapter"]) for liger in (False, True))
        assert want.modules.keys() == have.modules.keys()
        for n, f in want.modules.items():
            torch.testing.assert_close(have.modules[n].lora_A, f.lora_A, rtol=1e-3, atol=1e-5, msg=n)
            torch.testing.assert_close(have.modules[n].lora_B, f.lora_B, rtol=1e-3, atol=1e-5, msg=n)


def test_engine_patch_of_the_base_and_its_failure(tiny_llama_dir, llama_module_restored):
    """``apply_liger_to_base`` swaps the base's RMSNorm / SwiGLU forwards for Liger's (patching runs no kernel, so
    this runs on CPU); a layout liger-kernel does not expect is a ConfigError naming the key, not a traceback."""
    pytest.importorskip("liger_kernel")
    from transformers import AutoModelForCausalLM

    from bdlora.train.liger import apply_liger_to_base

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    mlp_forward = model.model.layers[0].mlp.forward
    apply_liger_to_base(model)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    assert norms and all(hasattr(m, "casting_mode") for m in norms)
    assert model.model.layers[0].mlp.forward.__func__ is not mlp_forward.__func__
    broken = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    del broken.model.layers
    with pytest.raises(ConfigError, match="could not patch this llama model .*use_liger_kernel: false"):
        apply_liger_to_base(broken)
