"""The quality benchmark's BoolQ scored through lm-evaluation-harness (bench/quality/lm_eval_scoring.py) against its
own scoring (bench/quality/metrics.py), on the tiny random Llama with a random PEFT BD-LoRA adapter: the same
log-likelihood for every answer of every question (up to the one term lm-eval adds to both answers), so the same
accuracy."""

from __future__ import annotations

import json
import random

import pytest
import torch

from bench.quality.data import boolq_record
from bench.quality.lm_eval_scoring import boolq_accuracy_lm_eval, boolq_task_config
from bench.quality.metrics import _nll_per_example, boolq_accuracy
from tests.conftest import randomize_lora


@pytest.fixture(scope="module")
def boolq_file(tmp_path_factory):
    rng = random.Random(7)
    words = "river stone light house green question answer small open north water".split()
    rows = [boolq_record(" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))),
                         " ".join(rng.choice(words) for _ in range(rng.randint(3, 7))) + "?",
                         rng.random() < 0.5, 200) for _ in range(14)]
    path = tmp_path_factory.mktemp("boolq") / "eval.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def adapted(tiny_llama_dir):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from bdlora import BDLoraSpec
    from bdlora.train.trainer import load_tokenizer

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32),
                           BDLoraSpec(nblocks=2, r=8, lora_alpha=16).to_peft_config())
    randomize_lora(model, seed=3, std=0.2)
    return model.eval(), load_tokenizer(tiny_llama_dir)


def test_same_likelihoods_and_accuracy_as_the_benchmark(adapted, boolq_file):
    from bdlora.train.data import encode, to_messages

    model, tok = adapted
    rows = [json.loads(line) for line in boolq_file.read_text().splitlines()]
    ours = boolq_accuracy(model, tok, boolq_file, n=len(rows), max_length=512, batch_size=4)
    exs = [encode(tok, to_messages(dict(r, output=a), "alpaca"), 512) for r in rows for a in ("yes", "no")]
    nll = _nll_per_example(model, exs, tok.pad_token_id, 4, torch.device("cpu"))

    theirs = boolq_accuracy_lm_eval(model, tok, boolq_file, n=len(rows), batch_size=4, log_samples=True)
    assert theirs["accuracy_lm_eval_n"] == ours["accuracy_n"] == len(rows)
    # lm-eval moves the context's trailing whitespace (the newline after the assistant header) into the
    # continuation: its log-likelihoods add log p(newline | prompt), one term shared by both answers of a question
    shared = [[ll + nll[2 * k + j] for j, ll in enumerate(pair)] for k, pair in enumerate(theirs["samples"])]
    assert all(abs(a - b) < 2e-4 and a < 0 for a, b in shared), shared
    # the decisions are far from ties here, so both pick the same answers
    assert min(abs(a - b) for a, b in theirs["samples"]) > 1e-2
    assert theirs["accuracy_lm_eval"] == pytest.approx(ours["accuracy"])
    assert 0 < ours["accuracy"] < 1  # a random adapter gets some right, some wrong: the comparison means something


def test_task_config_reads_the_local_file_and_the_template(adapted, boolq_file):
    model, tok = adapted
    cfg = boolq_task_config(tok, boolq_file)
    assert cfg["dataset_kwargs"]["data_files"]["validation"] == str(boolq_file)
    doc = json.loads(boolq_file.read_text().splitlines()[0])
    context, choices = cfg["doc_to_text"](doc), cfg["doc_to_choice"](doc)
    # the choices are the answer with the template's end-of-turn marker; the context ends where the answer starts
    assert [c.startswith(a) and len(c) > len(a) for c, a in zip(choices, ("yes", "no"))] == [True, True]
    from bdlora.train.data import prompt_text, to_messages

    assert context == prompt_text(tok, to_messages(dict(doc, output="yes"), "alpaca"))  # the generation prompt
    assert cfg["doc_to_target"](doc) == (0 if doc["label"] else 1)
