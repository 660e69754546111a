"""FSDP2 through accelerate (examples/accelerate/fsdp2_1node.yaml) on 2 and 4 GPUs (1 where only one exists: a
one-rank mesh, which still runs the sharded-parameter paths): the frozen base sharded, the adapter gathered into one
PEFT folder, equal to the single-process run, and a kill -9 of the whole launch then ``resume: auto`` bit-identical to
an uninterrupted FSDP2 run. accelerate builds FSDP only for GPU process groups (not MULTI_CPU), so this runs where
GPUs exist; CI's CPU runs skip it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from killing import sigkill_when

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
PROCS = [n for n in (2, 4) if n <= GPUS] or ([1] if GPUS else [])
needs_gpus = pytest.mark.skipif(GPUS == 0, reason="FSDP2 needs GPUs (accelerate has no FSDP on CPU process groups)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp_path, model, data, name, **kw) -> str:
    import yaml

    cfg = dict(model=str(model), nblocks=2, r=8, train_file=str(data), eval_fraction=0.0, batch_size=4, max_steps=4,
               lr=1e-3, precision="fp32", output_dir=str(tmp_path / name), progress=False, report_to=[])
    cfg.update(kw)
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def _fsdp_cmd(nproc: int, job: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "examples/accelerate/fsdp2_1node.yaml"), "--num_processes", str(nproc), "--mixed_precision", "no",
            "--main_process_port", str(_free_port()), "-m", "bdlora.train", "--config", job]


def _adapter(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter" / "adapter_model.safetensors"))


ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false")


@needs_gpus
@pytest.mark.parametrize("nproc", PROCS)
def test_fsdp2_matches_one_process(tiny_llama_dir, tmp_path, nproc):
    """nproc processes x batch 4/nproc = one process x batch 4 (same examples per step): equal within fp32 noise.
    The one-process run is a plain `bdlora train` on a machine with several GPUs: it must train on one GPU (not
    transformers' DataParallel over all of them, which would double its batch) and say so."""
    import bdlora
    from bdlora.train.tasks import toy_chat_records, write_jsonl

    data = write_jsonl(toy_chat_records(32, seed=4), tmp_path / "d.jsonl")
    one = subprocess.run([sys.executable, "-m", "bdlora.train", "--config",
                          _job(tmp_path, tiny_llama_dir, data, "one")], env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert "4 examples (1 process(es))" in one.stdout
    if GPUS > 1:
        assert f"{GPUS} GPUs visible; this one process trains on GPU" in one.stderr
    job = _job(tmp_path, tiny_llama_dir, data, "fsdp", save_every=2, batch_size=4 // nproc)
    two = subprocess.run(_fsdp_cmd(nproc, job), env=ENV, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]
    assert f"4 examples ({nproc} process(es))" in two.stdout and "FSDP2" in two.stdout
    a, b = _adapter(tmp_path / "one"), _adapter(tmp_path / "fsdp")
    assert a.keys() == b.keys() and len(a) == 28
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=2e-3, atol=2e-5, msg=k)
    assert bdlora.load_adapter(tmp_path / "fsdp" / "adapter").config.nblocks == 2
    assert (tmp_path / "fsdp" / "checkpoint-2").is_dir()


@needs_gpus
def test_fsdp2_kill_9_then_resume_is_bit_identical(tiny_llama_dir, tmp_path):
    """SIGKILL the whole FSDP2 launch (launcher and every rank) after a sharded checkpoint, then the same command
    with resume: auto: the final adapter equals an uninterrupted FSDP2 run's, tensor for tensor."""
    from bdlora.train.tasks import toy_chat_records, write_jsonl

    nproc = PROCS[0]
    data = write_jsonl(toy_chat_records(48, seed=5), tmp_path / "d.jsonl")
    kw = dict(batch_size=4 // nproc, max_steps=8, save_every=1, save_total_limit=2, lora_dropout=0.1,
              scheduler="cosine", warmup_steps=1, resume="auto")
    straight = subprocess.run(_fsdp_cmd(nproc, _job(tmp_path, tiny_llama_dir, data, "straight", **kw)), env=ENV,
                              capture_output=True, text=True, timeout=600)
    assert straight.returncode == 0, straight.stderr[-4000:]
    out = tmp_path / "killed"
    job = _job(tmp_path, tiny_llama_dir, data, "killed", **kw)
    proc = subprocess.Popen(_fsdp_cmd(nproc, job), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    assert sigkill_when(proc, lambda: (out / "checkpoint-4").is_dir(), timeout_s=400, poll_s=0.01, group=True), \
        "the run ended before checkpoint-4 appeared"
    assert not (out / "adapter").exists()
    resumed = subprocess.run(_fsdp_cmd(nproc, job), env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming from" in resumed.stdout
    want, got = _adapter(tmp_path / "straight"), _adapter(out)
    assert want.keys() == got.keys() and len(want) == 28
    for k in want:
        assert torch.equal(want[k], got[k]), k
