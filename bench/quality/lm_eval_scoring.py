"""BoolQ accuracy through EleutherAI's lm-evaluation-harness (``pip install lm-eval``), on the benchmark's own eval
file: the same question, in the same chat template, scored as lm-eval scores a multiple-choice task (``acc``: the
choice with the higher summed log-likelihood), beside the benchmark's own scoring (:func:`metrics.boolq_accuracy`).

The task is built from the local JSONL (no download): each record's prompt is rendered through the tokenizer's chat
template exactly as the trainer renders it, the context being everything before the assistant's answer and each
choice (``yes`` / ``no``) the answer with the template's end-of-turn marker, the tokens the benchmark's own
likelihood counts (lm-eval moves the context's trailing whitespace, the newline after the assistant header, into
each continuation: its log-likelihoods add log p(newline | prompt), the same term for both answers, so its decisions
are the benchmark's). The model is the one already loaded (base, or a PEFT adapter on it), handed to lm-eval's
``HFLM`` as an instance.
"""

from __future__ import annotations

from pathlib import Path

CHOICES = ("yes", "no")


def boolq_task_config(tokenizer, eval_file: Path, name: str = "bdlora_boolq") -> dict:
    """lm-eval task config (a dict, as its YAML files give) for the benchmark's BoolQ eval file: multiple choice over
    the chat-templated answer, ``acc`` metric, the file read by ``datasets``' json builder."""
    from bdlora.train.data import response_spans, to_messages

    def parts(doc: dict) -> tuple[str, list[str]]:
        context, choices = None, []
        for answer in CHOICES:
            text, [(start, end)] = response_spans(tokenizer, to_messages(dict(doc, output=answer), "alpaca"))
            if context is not None and text[:start] != context:
                raise ValueError("the chat template renders the prompt differently for the two answers")
            context = text[:start]
            choices.append(text[start:end])
        return context, choices

    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"validation": str(eval_file)}},
        "validation_split": "validation",
        "output_type": "multiple_choice",
        "doc_to_text": lambda doc: parts(doc)[0],
        "doc_to_choice": lambda doc: parts(doc)[1],
        "doc_to_target": lambda doc: 0 if doc["label"] else 1,
        "target_delimiter": "",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }


def boolq_accuracy_lm_eval(model, tokenizer, eval_file: Path, n: int, batch_size: int,
                           log_samples: bool = False) -> dict:
    """``accuracy_lm_eval`` (and ``accuracy_lm_eval_n``) of ``model`` on the first ``n`` records of ``eval_file``
    through ``lm_eval.simple_evaluate``; with ``log_samples`` also ``samples``: per record, the log-likelihood of
    each choice, in file order."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = simple_evaluate(model=lm, tasks=[boolq_task_config(tokenizer, eval_file)], limit=n, log_samples=log_samples,
                          bootstrap_iters=0, verbosity="WARNING")
    scores = {"accuracy_lm_eval": float(out["results"]["bdlora_boolq"]["acc,none"]),
              "accuracy_lm_eval_n": int(out["n-samples"]["bdlora_boolq"]["effective"])}
    if log_samples:
        samples = sorted(out["samples"]["bdlora_boolq"], key=lambda s: s["doc_id"])
        scores["samples"] = [[float(r[0]) for r in s["filtered_resps"]] for s in samples]
    return scores


__all__ = ["CHOICES", "boolq_accuracy_lm_eval", "boolq_task_config"]
