"""The engine's run file in the one vocabulary (bdlora.train.config): bad files refused through ``bdlora sweep``
with a message naming the key (exit 2, no traceback), other tools' names refused with bdlora's, a ``bdlora train`` job
file run unchanged as a one-job sweep, --print-config / --set."""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

from test_engine_utils import write_alpaca

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_alpaca(tmp_path_factory.mktemp("data") / "rev.jsonl", n=30)


def _good(model_dir, data, out) -> dict:
    return {"model": str(model_dir), "train_file": str(data), "output_dir": str(out), "max_steps": 2,
            "batch_size": 2, "max_length": 64, "token_budget": 256, "log_every": 1000, "save_plots": False}


def _sweep(argv, capsys):
    from bdlora.cli import main

    rc = main(["sweep", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# (case id, top-level changes (None removes a key) or a callable(good dict, tmp_path) -> YAML text, what stderr names)
BAD = [
    ("unknown-top-key", {"lrr": 4}, "unknown key(s) 'lrr' (did you mean 'lr'?)"),
    ("unknown-job-key", {"jobs": [{"name": "a", "rnk": 3}]}, "jobs[0] (a): unknown key(s) 'rnk'"),
    ("unknown-search-key", {"search": [{"name": "g", "spcae": {"lr": [1e-3]}}]}, "unknown search key(s) ['spcae']"),
    ("unknown-space-key", {"search": [{"name": "g", "space": {"lrr": [1e-3]}}]}, "unknown key(s) 'lrr'"),
    ("unknown-early-exit-key", {"early_exit": {"enabld": True}}, "early_exit: unknown key(s) 'enabld'"),
    ("datasets-section", {"train_file": None, "datasets": {"d": {"path": "DATA"}}},
     "'datasets' (bdlora's key is 'train_file'"),
    ("trainer-name", {"learning_rate_x": 1, "num_train_epochs": 2}, "'num_train_epochs' (bdlora's key for it is 'epochs')"),
    ("r-not-int", {"r": "eight"}, "r: must be an integer, got 'eight'"),
    ("lr-not-number", {"lr": "fast"}, "lr: must be a number, got 'fast'"),
    ("save-plots-not-bool", {"save_plots": "yes"}, "save_plots: must be true or false"),
    ("max-steps-0", {"max_steps": 0}, "max_steps: must be >= 1, got 0"),
    ("epochs-0", {"max_steps": None, "epochs": 0}, "epochs: must be > 0"),
    ("lr-0", {"lr": 0}, "lr: must be > 0"),
    ("negative-warmup-steps", {"warmup_steps": -1}, "warmup_steps: must be >= 0"),
    ("negative-warmup-ratio", {"warmup_ratio": -0.1}, "warmup_ratio: must be in [0, 1)"),
    ("lr-inf", {"lr": float("inf")}, "lr: must be a finite number"),
    ("nblocks-0", {"nblocks": 0}, "nblocks: must be >= 1"),
    ("r-not-divisible", {"r": 6, "nblocks": 4}, "r: rank 6 is not divisible by nblocks=4"),
    ("nblocks-bad-for-model", {"r": 6, "nblocks": 3}, "nblocks: model.layers.0.self_attn.q_proj: out_features=256 is not "
                                                      "divisible by nblocks=3"),
    ("unknown-target-module", {"target_modules": "qq_proj"}, "target_modules: unknown target modules ['qq_proj']"),
    ("missing-data-file", {"train_file": "/nonexistent/train.jsonl"}, "train_file: /nonexistent/train.jsonl does not exist"),
    ("data-file-is-directory", {"train_file": "EMPTYDIR"}, "train_file=EMPTYDIR"),
    ("missing-train-file", {"train_file": None}, "train_file: is required"),
    ("grid-value-not-list", {"search": [{"name": "g", "space": {"lr": 1e-3}}]}, "space.lr: grid values must be a list"),
    ("grid-empty-list", {"search": [{"name": "g", "space": {"lr": []}}]}, "space.lr: an empty list of values"),
    ("search-bad-type", {"search": [{"name": "g", "type": "bayes", "space": {"lr": [1e-3]}}]}, "type: must be grid or random"),
    ("random-no-samples", {"search": [{"name": "g", "type": "random", "space": {"lr": [1e-3]}}]}, "num_samples"),
    ("random-log-range-0", {"search": [{"name": "g", "type": "random", "num_samples": 2,
                                        "space": {"lr": {"low": 0, "high": 1e-3, "log": True}}}]}, "space.lr: a log range"),
    ("search-bad-value", {"search": [{"name": "g", "space": {"r": [8, "x"]}}]}, "r: must be an integer, got 'x'"),
    ("duplicate-job-names", {"jobs": [{"name": "a"}, {"name": "a"}]}, "name: duplicate job names ['a']"),
    ("dataset-in-job", {"jobs": [{"name": "a", "dataset": "x"}]}, "'dataset' (bdlora's key is 'train_file'"),
    ("missing-model", {"model": None}, "model: is required"),
    ("packing-false", {"packing": False}, "packing: False is not supported by `bdlora sweep`: the engine always packs"),
    ("report-to-wandb", {"report_to": ["wandb"]}, "report_to: `bdlora sweep` writes tensorboard event files"),
    ("push-to-hub", {"push_to_hub": True}, "push_to_hub: True is not supported by `bdlora sweep`"),
    ("record-samples-in-job", {"jobs": [{"name": "a", "record_samples": True}]}, "record_samples: True is not supported"),
    ("yaml-syntax-error", lambda good, tmp: "model: [unclosed\nr: 8\n", "YAML syntax error"),
    ("duplicate-yaml-key", lambda good, tmp: yaml.safe_dump(good) + "r: 8\nr: 16\n", "key 'r' given twice"),
    ("non-mapping-top-level", lambda good, tmp: "- r: 8\n- r: 16\n", "expected a YAML mapping"),
    ("token-budget-below-max-length", {"token_budget": 32}, "token_budget: 32 is smaller than the longest max_length (64)"),
    ("token-budget-word", {"token_budget": "lots"}, "token_budget: must be an integer or auto, got 'lots'"),
    ("bad-lora-backend", {"lora_backend": "cuda"}, "lora_backend: must be one of"),
    ("pipeline-stages-0", {"pipeline_stages": 0}, "pipeline_stages: must be >= 1"),
    ("pipeline-stages-text", {"pipeline_stages": "two"}, "pipeline_stages: must be a number"),
    ("missing-model-folder", {"model": "/nonexistent/model"}, "model '/nonexistent/model' is neither"),
    ("uncached-hub-model", {"model": "no-such-org/no-such-model"}, "'no-such-org/no-such-model' is not in the local"),
    ("jobs-not-a-list", {"jobs": {"name": "a"}}, "jobs: expected a list of jobs"),
    ("run-level-key-in-job", {"jobs": [{"name": "a", "model": "x"}]}, "jobs[0]: model: is shared by every job"),
    ("engine-key-in-job", {"jobs": [{"name": "a", "token_budget": 9}]}, "jobs[0]: token_budget: is an engine key"),
    ("checkpointing-in-job", {"jobs": [{"name": "a", "gradient_checkpointing": True}]},
     "jobs[0]: gradient_checkpointing: is shared by every job"),
    ("every-n-without-checkpointing", {"gradient_checkpointing_every_n_layers": 2},
     "gradient_checkpointing_every_n_layers: takes effect with gradient_checkpointing: true"),
    ("early-exit-window", {"early_exit": {"enabled": True, "window": 1}, "eval_every": 1}, "early_exit.window: must be >= 2"),
    ("early-exit-without-evals", {"early_exit": {"enabled": True}}, "eval_every: early_exit needs evaluations"),
    ("max-active-jobs-0", {"max_active_jobs": 0}, "max_active_jobs: must be >= 1"),
    ("memory-budget-negative", {"memory_budget_gb": -1}, "memory_budget_gb: must be > 0"),
    ("other-tool-dtype", {"dtype": "bfloat16"}, "'dtype' (bdlora's key for it is 'precision')"),
    ("precision-fp16", {"precision": "fp16"}, "precision: fp16 is not supported by the engine"),
    ("job-name-path", {"jobs": [{"name": "../escape"}]}, "name: '../escape' is not a usable folder name"),
    ("resume-folder", {"resume": "some/checkpoint-3"}, "resume: the engine resumes from its own output_dir"),
    ("training-args", {"training_args": {"optim": "adamw_torch"}}, "training_args: the engine runs its own"),
    ("other-tool-name", {"rank": 8, "base_model": "x"}, "'base_model' (bdlora's key for it is 'model'), 'rank' (bdlora's key for it is 'r')"),
    ("eval-fraction", {"eval_fraction": 1.5}, "eval_fraction: must be in [0, 1)"),
    ("no-jobs", {"jobs": []}, "jobs: no jobs"),
    ("bad-device", {"device": "gpu0"}, "device: must be auto, cpu, cuda or cuda:K"),
]


@pytest.mark.parametrize("case,change,expected", BAD, ids=[c[0] for c in BAD])
def test_bad_run_file_is_refused_with_the_key(case, change, expected, tiny_llama_dir, data_file, tmp_path, capsys):
    good = _good(tiny_llama_dir, data_file, tmp_path / "out")
    if callable(change):
        text = change(good, tmp_path)
    else:
        raw = dict(good)
        for k, v in change.items():
            if v is None:
                raw.pop(k, None)
            else:
                raw[k] = v
        text = yaml.safe_dump(raw, sort_keys=False)
    empty = tmp_path / "emptydir"
    empty.mkdir()
    text = text.replace("EMPTYDIR", str(empty)).replace("DATA", str(data_file))
    expected = expected.replace("EMPTYDIR", str(empty))
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        rc, out, err = _sweep(["--config", str(path)], capsys)
    assert rc == 2, (case, out[-500:], err[-1000:])
    last = err.strip().splitlines()[-1]  # (model loading may draw a progress bar first)
    assert last.startswith(f"bdlora sweep: error: {path}"), err  # names the file
    assert expected in last, err
    assert "Traceback" not in err and "RuntimeError" not in err
    assert not (tmp_path / "out" / "adapters").exists()  # nothing trained


def test_a_bdlora_train_job_file_runs_as_a_one_job_sweep(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """A flat job file (no jobs:/search:), written for `bdlora train`, runs unchanged; relative paths are relative
    to the working directory; the job is named after output_dir and its adapter has the file's nblocks and r."""
    from bdlora import load_adapter
    from bdlora.train.tasks import toy_chat_records, write_jsonl

    monkeypatch.chdir(tmp_path)
    write_jsonl(toy_chat_records(24), tmp_path / "data" / "train.jsonl")
    job = {"model": str(tiny_llama_dir), "train_file": "data/train.jsonl", "output_dir": "runs/my-job",
           "nblocks": 4, "r": 8, "lora_alpha": 8, "target_modules": "q_proj", "max_steps": 3, "batch_size": 4,
           "max_length": 64, "lr": 1e-3, "eval_fraction": 0.2, "seed": 3, "report_to": ["none"], "progress": False}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    rc, out, err = _sweep(["--config", "job.yaml", "--set", "log_every=100", "--set", "save_plots=false"], capsys)
    assert rc == 0, err[-2000:]
    folder = tmp_path / "runs" / "my-job" / "adapters" / "my-job"
    ad = load_adapter(folder)
    assert ad.config.nblocks == 4 and ad.config.r == 8
    # target_modules: q_proj is one module, not its characters
    assert {name.rsplit(".", 1)[-1] for name in ad.modules} == {"q_proj"}
    assert any(f.lora_B.abs().max() > 0 for f in ad.modules.values())  # it trained
    assert "completed" in out


def test_set_overrides_and_print_config(tiny_llama_dir, data_file, tmp_path, capsys):
    from bdlora.train.config import TrainConfig
    from bdlora.train.engine.config import ENGINE_KEYS, load_run

    rc, out, err = _sweep(["--print-config"], capsys)
    assert rc == 0
    printed = yaml.safe_load(out)  # valid YAML: every key once, with its default
    refused = {"training_args", "record_samples", "save_total_limit", "push_to_hub",
               "hub_model_id", "hub_private_repo", "overwrite_output_dir", "load_in_8bit", "kbit_upcast_fp32"}
    for key in TrainConfig.valid_keys() + ["name", "group", "priority"] + list(ENGINE_KEYS):
        assert (key in printed) == (key not in refused), key
    assert printed["nblocks"] == 2 and printed["scheduler"] == "linear" and printed["token_budget"] == "auto"
    assert "# Tokens per packed micro-batch" in out and "# Total LoRA rank" in out
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**_good(tiny_llama_dir, data_file, tmp_path / "o"),
                                    "jobs": [{"name": "a"}, {"name": "b", "r": 16}]}))
    run = load_run(path, {"r": 4, "token_budget": 512})
    assert [j.r for j in run.jobs] == [4, 16] and run.token_budget == 512
    rc, out, err = _sweep(["--config", str(path), "--set", "lr=0"], capsys)
    assert rc == 2 and "jobs[0] (a): lr: must be > 0" in err
    rc, out, err = _sweep(["--config", str(path), "--set", "lr"], capsys)
    assert rc == 2 and "--set 'lr': expected key=value" in err
    assert load_run(path, {"early_exit.enabled": True, "eval_every": 1}).early_exit.enabled
    rc, out, err = _sweep([], capsys)
    assert rc == 2 and "--config run.yaml is required" in err


def test_a_sweep_whose_every_job_is_refused_exits_2_naming_why(tiny_llama_dir, data_file, tmp_path, capsys):
    """The memory model admits no job (a budget below the base itself): exit 2 with the refusal and its remedies,
    no adapter written; the same run with room trains and exits 0."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**_good(tiny_llama_dir, data_file, tmp_path / "o"), "memory_budget_gb": 1e-6,
                                    "jobs": [{"name": "a"}, {"name": "b", "r": 16}]}))
    rc, out, err = _sweep(["--config", str(path)], capsys)
    assert rc == 2 and "every job was refused, nothing trained: refused: needs ~" in err
    assert "raise memory_budget_gb" in err and "(2 job(s);" in err and "Traceback" not in err
    assert not (tmp_path / "o" / "adapters").exists() or not any((tmp_path / "o" / "adapters").iterdir())
    rc, out, err = _sweep(["--config", str(path), "--set", "memory_budget_gb=100", "--no-resume"], capsys)
    assert rc == 0 and (tmp_path / "o" / "adapters" / "b" / "adapter_config.json").is_file()


def test_a_full_disk_in_a_sweep_is_a_message(tiny_llama_dir, data_file, tmp_path, capsys, monkeypatch):
    """A job's adapter write fails for lack of space (safetensors' error on a full disk): exit 2 naming the reason, the
    free space and the way on; no traceback, no adapter folder half-written."""
    import safetensors
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    path = tmp_path / "run.yaml"
    out = tmp_path / "o"
    path.write_text(yaml.safe_dump({**_good(tiny_llama_dir, data_file, out), "jobs": [{"name": "a"}]}))
    rc, _, err = _sweep(["--config", str(path)], capsys)
    assert rc == 2 and f"bdlora sweep: error: could not write under {out}: no space left on device (" in err
    assert "make room, then run the same command again" in err and "Traceback" not in err
    assert not (out / "adapters" / "a").exists()


def test_more_pipeline_stages_than_gpus_is_refused(monkeypatch):
    """pipeline_stages: 2 on a machine with one GPU: refused before any process starts, naming the GPU count (a
    stage would otherwise ask for a GPU that is not there, in a spawned process); CPU runs and enough GPUs pass."""
    from types import SimpleNamespace

    import torch

    from bdlora.train.config import ConfigError
    from bdlora.train.engine import launch

    run = SimpleNamespace(device="auto", pipeline_stages=2, source="run.yaml")
    launch.check_stage_gpus(run)  # no GPU here: the stages run on CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"run.yaml: pipeline_stages: 2 runs one stage per GPU, but this machine "
                                          r"has 1 GPU\(s\): set pipeline_stages to at most 1"):
        launch.check_stage_gpus(run)
    launch.check_stage_gpus(SimpleNamespace(device="cpu", pipeline_stages=2, source="run.yaml"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch.check_stage_gpus(run)
    called = []

    def refuse(r):
        called.append(r)
        raise ConfigError("stop")

    monkeypatch.setattr(launch, "check_stage_gpus", refuse)
    with pytest.raises(ConfigError, match="stop"):
        launch.run_pipeline_spawn(run)
    assert called == [run]  # checked before anything is spawned


def test_other_tools_names_are_refused_as_in_train(tmp_path, data_file):
    """One rule for train and sweep: a name another tool (or an older engine) gives a bdlora key is refused with
    bdlora's key, at the top level, in jobs: and in search spaces; the job defaults are TrainConfig's."""
    from bdlora.train.config import ConfigError, TrainConfig
    from bdlora.train.engine.config import parse_run

    good = {"model": "m", "train_file": str(data_file), "output_dir": str(tmp_path / "o")}
    for where, raw in (("top", {**good, "learning_rate": 1e-3}),
                       ("job", {**good, "jobs": [{"name": "a", "learning_rate": 1e-3}]}),
                       ("space", {**good, "search": [{"name": "g", "space": {"learning_rate": [1e-3]}}]})):
        with pytest.raises(ConfigError, match="'learning_rate' \\(bdlora's key for it is 'lr'\\)"):
            parse_run(raw)
        if where == "top":
            with pytest.raises(ConfigError, match="'learning_rate' \\(bdlora's key for it is 'lr'\\)"):
                TrainConfig.from_dict({k: v for k, v in raw.items() if k != "output_dir"})
    with pytest.raises(ConfigError, match="resume: the engine resumes from its own output_dir"):
        parse_run({**good, "resume": True})
    c = parse_run({**good, "jobs": [{"name": "x"}]})
    assert (c.jobs[0].nblocks, c.jobs[0].scheduler, c.jobs[0].warmup_ratio, c.model) == (2, "linear", 0.05, "m")


def test_engine_config_error_is_the_trainers():
    from bdlora.train.config import ConfigError
    from bdlora.train.engine import ConfigError as EngineConfigError

    assert EngineConfigError is ConfigError


def test_tiny_random_shortcut_never_asks_the_hub(tmp_path, data_file, monkeypatch):
    """model: tiny-random resolves to the locally built model (the engine used to hand the string to
    from_pretrained, which retried the hub for ~50 s)."""
    import huggingface_hub

    import bdlora.models as models
    from bdlora.train.engine.config import parse_run
    from bdlora.train.engine.engine import Engine

    def no_hub(*a, **k):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_hub)
    monkeypatch.setattr(models, "DEFAULT_CACHE", tmp_path / "cache")
    run = parse_run({"model": "tiny-random", "train_file": str(data_file), "output_dir": str(tmp_path / "o"),
                     "max_length": 64, "max_steps": 1})
    eng = Engine(run)
    assert eng.base_path == str(tmp_path / "cache" / "tiny-random-llama")
    assert next(eng.model.parameters()).dtype == torch.float32  # precision auto on CPU


def test_sweep_example_parses_in_the_new_vocabulary(monkeypatch):
    from pathlib import Path

    from bdlora.train.engine.config import load_run

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # its paths are relative to the working directory: the repository root
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated name left in the example
        run = load_run(root / "examples" / "sweep.yaml")
    assert len(run.jobs) == 1 + 16 + 4 and run.resume and run.early_exit.enabled
    assert {j.nblocks for j in run.jobs} == {3} and all(j.r % 3 == 0 for j in run.jobs)
