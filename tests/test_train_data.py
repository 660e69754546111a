"""Data formats (alpaca, chat), chat-template rendering and response-only loss masking."""

from __future__ import annotations

import json

import pytest

from bdlora.train.data import (IGNORE_INDEX, DataError, DataStream, encode, load_datasets, prompt_text,
                               read_records, split_indices, to_messages)


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from bdlora.train.trainer import load_tokenizer

    return load_tokenizer(tiny_llama_dir)


def _target_text(tok, ex):
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])


def _prompt_text(tok, ex):
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab == IGNORE_INDEX])


def test_alpaca_record_renders_with_template_and_masks_prompt(tok):
    rec = {"instruction": "Reverse the words.", "input": "red blue", "output": "blue red", "system": "Be brief."}
    msgs = to_messages(rec)
    assert msgs == [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Reverse the words.\n\nred blue"},
                    {"role": "assistant", "content": "blue red"}]
    ex = encode(tok, msgs, max_length=256)
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(msgs, tokenize=False)
    # Loss only on the response and its end-of-turn marker; the prompt (system, user, assistant header) is -100.
    assert _target_text(tok, ex) == "blue red<|im_end|>"
    assert "Reverse the words" in _prompt_text(tok, ex) and "<|im_start|>assistant" in _prompt_text(tok, ex)
    # Every target label is the token itself (no shift here; the model shifts).
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ex.input_ids, ex.labels))
    # The generation prompt is exactly the unmasked prefix.
    first_target = next(i for i, lab in enumerate(ex.labels) if lab != IGNORE_INDEX)
    assert tok.decode(ex.input_ids[:first_target]) == prompt_text(tok, msgs)


def test_chat_multi_turn_masks_every_non_assistant_token(tok):
    msgs = [{"role": "user", "content": "Copy: cat dog"}, {"role": "assistant", "content": "cat dog"},
            {"role": "user", "content": "Copy: sun moon"}, {"role": "assistant", "content": "sun moon"}]
    ex = encode(tok, to_messages({"messages": msgs}), max_length=256)
    assert _target_text(tok, ex) == "cat dog<|im_end|>sun moon<|im_end|>"
    prompt = _prompt_text(tok, ex)
    assert "Copy: cat dog" in prompt and "Copy: sun moon" in prompt


def test_truncation_and_bad_records(tok, tmp_path):
    msgs = to_messages({"instruction": "word " * 60, "output": "yes"})
    assert encode(tok, msgs, max_length=16) is None  # response beyond the limit: dropped
    ex = encode(tok, to_messages({"instruction": "hi", "output": "one two three four five six seven"}), 20)
    assert ex is not None and len(ex.input_ids) == 20
    with pytest.raises(DataError, match="neither a chat record"):
        to_messages({"question": "x", "answer": "y"}, where="f.jsonl record 3")
    with pytest.raises(DataError, match="no assistant message"):
        to_messages({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(DataError, match="role 'bot'"):
        to_messages({"messages": [{"role": "bot", "content": "x"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_records(bad)


def test_json_and_jsonl_files_and_split(tok, tmp_path):
    from bdlora.train.config import TrainConfig

    recs = [{"instruction": f"say {i}", "output": str(i)} for i in range(10)]
    recs += [{"messages": [{"role": "user", "content": f"echo {i}"}, {"role": "assistant", "content": str(i)}]}
             for i in range(10)]
    js = tmp_path / "d.json"
    js.write_text(json.dumps({"data": recs}))
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert read_records(js) == read_records(jl) == recs
    cfg = TrainConfig.from_dict(dict(model="tiny-random", train_file=str(jl), eval_fraction=0.25, seed=3))
    tr, ev = load_datasets(cfg, tok)
    assert len(tr) == 15 and len(ev) == 5
    assert sorted(e.index for e in tr + ev) == list(range(20))
    assert split_indices(20, 0.25, 3) == split_indices(20, 0.25, 3) != split_indices(20, 0.25, 4)


def test_data_stream_is_deterministic_and_covers_epochs():
    s = DataStream(10, seed=1)
    first = [s.at(p) for p in range(10)]
    second = [s.at(p) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert [DataStream(10, seed=1).at(p) for p in range(20)] == first + second
    # Two processes, grad_accum 2, batch 2: every stream position is consumed exactly once per step.
    got = [i for micro in range(2) for rank in range(2) for i in s.micro_batch(0, micro, 2, 2, 2, rank)]
    assert got == [s.at(p) for p in range(8)]
