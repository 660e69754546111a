"""How the quality benchmark scores a model (base or adapter) on each task, the same way for every row.

* every task: eval loss / perplexity over the eval set's response tokens (:func:`eval_loss`);
* BoolQ: accuracy of the answer ("yes"/"no") with the higher likelihood, beside the eval set's majority rate
  (with ``lm_eval`` set, also through lm-evaluation-harness: ``accuracy_lm_eval``, :mod:`.lm_eval_scoring`);
* recall: exact match of the greedy answer (``CODE: <word>``) on held-out phrasings;
* XSum: ROUGE-L F1 of greedy one-sentence summaries against the references (:func:`rouge_l`: ``rouge_score``'s
  ``rougeL``, Google's reference implementation, without stemming).
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path


def _nll_per_example(model, examples, pad_id: int, batch_size: int, device) -> list[float]:
    import torch

    from bdlora.train.data import IGNORE_INDEX, collate

    out: list[float] = []
    model.eval()
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            b = {k: v.to(device) for k, v in collate(examples[i:i + batch_size], pad_id).items()}
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            labels = b["labels"][:, 1:]
            lp = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels,
                                                   ignore_index=IGNORE_INDEX, reduction="none")
            out.extend(lp.sum(1).tolist())
    return out


def boolq_accuracy(model, tokenizer, eval_file: Path, n: int, max_length: int, batch_size: int) -> dict:
    """Accuracy of picking the answer ("yes"/"no") with the higher likelihood as the assistant response."""
    from bdlora.train.data import encode, to_messages

    rows = [json.loads(l) for l in eval_file.read_text().splitlines() if l.strip()][:n]
    exs, gold = [], []
    for j, r in enumerate(rows):
        pair = []
        for cand in ("yes", "no"):
            ex = encode(tokenizer, to_messages(dict(r, output=cand), "alpaca"), max_length, index=j)
            pair.append(ex)
        if any(e is None for e in pair):
            continue
        exs.extend(pair)
        gold.append(bool(r["label"]))
    device = next(model.parameters()).device
    nll = _nll_per_example(model, exs, tokenizer.pad_token_id, batch_size, device)
    correct = 0
    for k, g in enumerate(gold):
        says_yes = nll[2 * k] < nll[2 * k + 1]
        correct += int(says_yes == g)
    return {"accuracy": correct / max(1, len(gold)), "accuracy_n": len(gold),
            "majority_baseline": max(sum(gold), len(gold) - sum(gold)) / max(1, len(gold))}


def eval_loss(model, tokenizer, eval_file: Path, max_length: int, batch_size: int) -> dict:
    """Mean loss and perplexity over the eval set's response tokens (the trainer's ``eval_loss`` for a model that
    was not trained: the base row)."""
    from bdlora.train.data import encode, to_messages

    rows = [json.loads(l) for l in eval_file.read_text().splitlines() if l.strip()]
    exs = [e for j, r in enumerate(rows) if (e := encode(tokenizer, to_messages(r, "alpaca"), max_length, index=j))]
    tokens = sum(e.num_target_tokens for e in exs)
    total = sum(_nll_per_example(model, exs, tokenizer.pad_token_id, batch_size, next(model.parameters()).device))
    loss = total / max(1, tokens)
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0)), "eval_tokens": tokens}


def recall_exact_match(model, tokenizer, eval_file: Path, batch_size: int) -> dict:
    """Share of held-out recall prompts whose greedy answer is exactly ``CODE: <word>``."""
    from bdlora.train.quickstart import exact_match, greedy_answers

    rows = [json.loads(l) for l in eval_file.read_text().splitlines() if l.strip()]
    preds = greedy_answers(model, tokenizer, rows, max_new_tokens=12, batch_size=batch_size, desc="recall")
    return {"accuracy": exact_match(preds, rows), "accuracy_n": len(rows), "majority_baseline": 0.0}


@functools.lru_cache(maxsize=None)  # one scorer per process: it is stateless and reused for every summary
def _rouge_l_scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (beta 1) of one prediction against one reference."""
    return _rouge_l_scorer().score(reference, prediction)["rougeL"].fmeasure


def xsum_rouge(model, tokenizer, eval_file: Path, n: int, max_new_tokens: int, batch_size: int) -> dict:
    """Mean ROUGE-L F1 of greedy summaries of the first ``n`` eval articles."""
    from bdlora.train.quickstart import greedy_answers

    rows = [json.loads(l) for l in eval_file.read_text().splitlines() if l.strip()][:n]
    preds = greedy_answers(model, tokenizer, rows, max_new_tokens=max_new_tokens, batch_size=batch_size,
                           desc="xsum")
    # a summary is one sentence: what follows the first line is not part of it
    scores = [rouge_l(p.split("\n")[0], r["output"]) for p, r in zip(preds, rows)]
    return {"rougeL": sum(scores) / max(1, len(scores)), "rougeL_n": len(scores)}


#: each task's score (higher is better), beside eval loss and perplexity
TASK_SCORES = {"boolq": "accuracy", "recall": "accuracy", "xsum": "rougeL"}
SCORES = tuple(dict.fromkeys(TASK_SCORES.values()))  # the distinct scores, in that order


def is_scored(row: dict) -> bool:
    """Whether a results row carries its task's score: rows recorded before a task was scored (eval loss only) are
    run again, so that every row of a comparison has the same metrics."""
    key = TASK_SCORES.get(row.get("task"))
    return key is None or key in row


def task_metrics(task: str, model, tokenizer, p: dict, files: dict) -> dict:
    """The task's own metrics (beside eval loss) for one model."""
    if task == "boolq":
        out = boolq_accuracy(model, tokenizer, files["eval"], p["acc_eval"], p["max_length"], p["eval_batch_size"])
        if p.get("lm_eval"):  # the same questions through lm-evaluation-harness, beside the accuracy above
            from .lm_eval_scoring import boolq_accuracy_lm_eval

            out.update(boolq_accuracy_lm_eval(model, tokenizer, files["eval"], p["acc_eval"], p["eval_batch_size"]))
        return out
    if task == "recall":
        return {**recall_exact_match(model, tokenizer, files["eval"], p["gen_batch_size"]),
                "recall_pairs": p["recall_pairs"]}
    if task == "xsum":
        return xsum_rouge(model, tokenizer, files["eval"], p["gen_eval"], p["summary_tokens"], p["gen_batch_size"])
    return {}


def load_scoring_model(model: str, precision: str):
    """(model, tokenizer) every row is scored with: the base in the run's precision on the GPU if there is one, and
    the trainer's own tokenizer (the same template and padding as the trained rows)."""
    import torch

    from bdlora.models import load_causal_lm, torch_dtype_of
    from bdlora.train.trainer import load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return load_causal_lm(path, dtype=torch_dtype_of(precision, device), device=device), load_tokenizer(path)


def load_kbit_scoring_model(model: str, precision: str):
    """(model, tokenizer) a run trained on a 4-bit base is scored with: the base quantized as ``bdlora train`` and
    ``bdlora sweep`` quantize it for ``load_in_4bit`` (bitsandbytes nf4), with PEFT's k-bit layers able to load BD
    adapters (:func:`bdlora.quant.enable_bdlora_on_kbit`)."""
    import torch

    from bdlora.quant import enable_bdlora_on_kbit
    from bdlora.train import TrainConfig
    from bdlora.train.trainer import load_kbit_base_model, load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    enable_bdlora_on_kbit()
    cfg = TrainConfig(model=model, precision=precision, load_in_4bit=True)
    return load_kbit_base_model(cfg, path, device).eval(), load_tokenizer(path)


def device_name() -> str:
    """What the rows were computed on (the results' ``device`` field)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({os.cpu_count()} cores)"
