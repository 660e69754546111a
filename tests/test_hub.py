"""The Hugging Face Hub from a user's first day: a job names a model and a dataset by hub id and bdlora downloads
them (HF_ENDPOINT pointed at a local server speaking the hub's protocol, the real huggingface_hub client), pushes the
trained adapter (push_to_hub / `bdlora push`), and says what to do when the hub cannot help: offline and not
cached, gated, unknown, not logged in. Also: the model card names what the user gave and the files it writes are
readable by other users (the umask's modes)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hub_server import HubServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llama_dir):
    import shutil

    root = tmp_path_factory.mktemp("hub")
    shutil.copytree(tiny_llama_dir, root / "models" / "acme" / "tiny")
    shutil.copytree(tiny_llama_dir, root / "models" / "acme" / "gated")
    data = root / "datasets" / "acme" / "chat"
    data.mkdir(parents=True)
    from bdlora.train.tasks import toy_chat_records, write_jsonl

    write_jsonl(toy_chat_records(24, seed=3), data / "train.jsonl")
    with HubServer(root, gated=("acme/gated",)) as server:
        yield server


def _env(hub, home: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def _train(tmp_path, env, name="job", **kw):
    cfg = dict(model="acme/tiny", train_file="acme/chat:train", nblocks=2, r=4, max_steps=2, batch_size=4,
               eval_fraction=0.0, output_dir=str(tmp_path / "out"), progress=False, report_to=[])
    cfg.update(kw)
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "bdlora.train", "--config", str(job)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_train_downloads_model_and_data_then_pushes(hub, tmp_path):
    home = tmp_path / "hf"
    env = _env(hub, home, HF_TOKEN="hf_test")
    r = _train(tmp_path, env, push_to_hub=True, hub_model_id="me/bd-tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pushed" in r.stdout and "me/bd-tiny" in r.stdout
    assert any(p.name == "snapshots" for p in (home / "hub" / "models--acme--tiny").iterdir())
    assert (home / "hub" / "datasets--acme--chat").is_dir()
    adapter = tmp_path / "out" / "adapter"
    pushed = hub.root / "models" / "me" / "bd-tiny"
    assert sorted(p.name for p in pushed.iterdir()) == sorted(p.name for p in adapter.iterdir())
    for f in adapter.iterdir():
        assert (pushed / f.name).read_bytes() == f.read_bytes()
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f  # the umask's modes (022 here), never 0600
    card = (adapter / "README.md").read_text()
    assert "base_model: acme/tiny" in card and "vllm serve acme/tiny" in card
    assert "--lora-modules bd-tiny=me/bd-tiny" in card and "/path/to" not in card and "pip install bdlora" not in card
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "acme/tiny"


def test_model_card_of_a_local_folder_serves_this_folder(tmp_path, tiny_llama_dir):
    from bdlora.spec import BDLoraSpec
    from bdlora.train.config import TrainConfig
    from bdlora.train.trainer import write_model_card

    cfg = TrainConfig(model=str(tiny_llama_dir), train_file="/data/train.jsonl", output_dir=str(tmp_path / "run1"))
    write_model_card(tmp_path, BDLoraSpec(nblocks=2, r=8), cfg, str(tiny_llama_dir), steps=3)
    card = (tmp_path / "README.md").read_text()
    assert "base_model:" not in card  # not a hub id: no metadata that would point the hub at a local path
    assert "--lora-modules run1=." in card and "Run it in this folder" in card and "data: train.jsonl" in card


@pytest.mark.parametrize("case, extra, needle", [
    ("offline", {"HF_HUB_OFFLINE": "1"}, "model 'acme/tiny' is not in the local Hugging Face cache"),
    ("gated", {}, "model 'acme/gated' is gated: accept its terms"),
    ("unknown", {}, "model 'acme/nothing' was not found on the hub"),
])
def test_hub_failures_name_the_model_and_the_fix(hub, tmp_path, case, extra, needle):
    model = {"gated": "acme/gated", "unknown": "acme/nothing"}.get(case, "acme/tiny")
    r = _train(tmp_path, _env(hub, tmp_path / "hf", **extra), model=model)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("bdlora train: error: model:") and needle in last, last
    assert "Traceback" not in r.stderr
    if case == "offline":
        assert "`hf download acme/tiny`" in last
    assert not (tmp_path / "out" / "adapter").exists()


def test_bdlora_push_and_its_refusals(hub, tmp_path, peft_bd_adapter):
    env = _env(hub, tmp_path / "hf")
    cmd = [sys.executable, "-m", "bdlora.cli", "push", str(peft_bd_adapter), "me/pushed"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "me/pushed" in r.stderr and ("HF_TOKEN" in r.stderr or "hf auth login" in r.stderr), r.stderr
    r = subprocess.run(cmd, env={**env, "HF_TOKEN": "hf_test"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (hub.root / "models" / "me" / "pushed" / "adapter_model.safetensors").is_file()
    bad = tmp_path / "not-an-adapter"
    bad.mkdir()
    r = subprocess.run([*cmd[:-2], str(bad), "me/x"], env={**env, "HF_TOKEN": "hf_test"}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "no adapter_config.json" in r.stderr
    assert not (hub.root / "models" / "me" / "x").exists()  # nothing is created for a folder bdlora refuses
