"""Data parallel training over 2 CPU processes (accelerate launch --multi_gpu = torchrun, gloo): disjoint data shards,
identical adapters, tokens_seen summed over both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from bdlora.train.tasks import toy_chat_records, write_jsonl


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_data_parallel(tiny_llama_dir, tmp_path):
    import yaml

    data = write_jsonl(toy_chat_records(20, seed=2), tmp_path / "d.jsonl")

    def launch(out, **extra):
        job = out.with_suffix(".yaml")
        job.write_text(yaml.safe_dump(dict(
            model=str(tiny_llama_dir), nblocks=2, r=8, train_file=str(data), eval_fraction=0.2, batch_size=2,
            grad_accum=2, max_steps=3, lora_dropout=0.1, output_dir=str(out), record_samples=True, progress=False,
            report_to=[], save_every=2, **extra,
        )))
        # `--multi_gpu` is accelerate's torchrun launcher (2 local processes); ACCELERATE_USE_CPU keeps them on CPU
        # with gloo even where a GPU exists. (`--cpu --num_processes 2` would start one process: accelerate's simple
        # launcher needs an MPI hostfile for multi-CPU.)
        env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
               "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(_free_port()), "-m", "bdlora.train", "--config", str(job)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "2 process(es)" in proc.stdout
        return [(r["step"], r["tokens_seen"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
                if "train_loss" in r]

    out = tmp_path / "out"
    tokens = launch(out)
    # tokens_seen (counted on each process, summed over both at the logs) equals transformers' per-step count
    assert tokens == launch(tmp_path / "counted", training_args={"include_num_input_tokens_seen": "non_padding"})
    assert [s for s, _ in tokens] == [1, 2, 3]

    per_rank = {}
    for rank in (0, 1):
        lines = [json.loads(x) for x in (out / f"samples.rank{rank}.jsonl").read_text().splitlines()]
        per_rank[rank] = lines
    batches = {r: [tuple(x["records"]) for x in v if "records" in x] for r, v in per_rank.items()}
    # 3 steps x 2 micro-batches of 2 examples on each rank.
    assert len(batches[0]) == len(batches[1]) == 6
    # Different data on the two ranks within every micro-batch, and one step consumes 8 distinct stream positions:
    # with 16 training examples, steps 0-1 cover the first epoch exactly once.
    for b0, b1 in zip(batches[0], batches[1]):
        assert not set(b0) & set(b1)
    first_epoch = [i for b in batches[0][:4] + batches[1][:4] for i in b]
    assert len(first_epoch) == 16 and len(set(first_epoch)) == 16
    # DDP kept the adapters identical on both ranks.
    digests = {r: [x["params_sha256"] for x in v if "params_sha256" in x] for r, v in per_rank.items()}
    assert digests[0] == digests[1] and len(digests[0]) == 1

    import bdlora

    ad = bdlora.load_adapter(out / "adapter")
    assert ad.config.nblocks == 2
    assert (out / "checkpoint-2" / "trainer_state.json").is_file() and (out / "checkpoint-2" / "rng_state_1.pth").is_file()
