"""Data sources (json, jsonl, parquet, csv, saved datasets, folders, cached hub ids), formats (alpaca, sharegpt,
messages with tool turns, prompt/completion, text), the tokenized cache and the padding-free collator."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bdlora.train import data as D
from bdlora.train.data import IGNORE_INDEX, DataError, encode_record, load_datasets, read_records

END = "<|im_end|>"  # the tiny tokenizer's end-of-turn and EOS token


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    if t.pad_token_id is None:
        t.pad_token = t.eos_token
    return t


@pytest.fixture()
def plain_tok(tiny_llama_dir):
    """The same tokenizer without a chat template."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    t.chat_template = None
    return t


def _target(tok, ex):
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab != IGNORE_INDEX])


def _context(tok, ex):
    return tok.decode([t for t, lab in zip(ex.input_ids, ex.labels) if lab == IGNORE_INDEX])


class Cfg:
    def __init__(self, train_file, **kw):
        self.train_file, self.eval_file, self.eval_fraction = str(train_file), None, 0.0
        self.data_format, self.max_length, self.seed = "auto", 256, 0
        self.__dict__.update(kw)


RECORDS = {
    "alpaca": [{"instruction": f"Copy {i}", "input": "red blue" if i % 2 else "", "output": f"red {i}"}
               for i in range(4)],
    "sharegpt": [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": f"hi {i}"},
                                    {"from": "gpt", "value": f"hello {i}"}]} for i in range(4)],
    "messages": [{"messages": [{"role": "user", "content": f"echo {i}"}, {"role": "assistant", "content": str(i)}]}
                 for i in range(4)],
    "prompt_completion": [{"prompt": f"the cat {i} is", "completion": " red"} for i in range(4)],
    "text": [{"text": f"the dog {i} is blue"} for i in range(4)],
}
FLAT = ("alpaca", "prompt_completion", "text")


# ---------------------------------------------------------------------------------------------------- formats
def test_alpaca_and_sharegpt_labels(tok):
    ex = encode_record(tok, {"instruction": "Reverse.", "input": "red blue", "output": "blue red",
                             "system": "Be brief."}, "auto", 256)
    assert _target(tok, ex) == "blue red" + END
    assert "Reverse.\n\nred blue" in _context(tok, ex) and "Be brief." in _context(tok, ex)
    rec = {"system": "Sys.", "conversations": [
        {"from": "human", "value": "Copy: cat dog"}, {"from": "gpt", "value": "cat dog"},
        {"from": "user", "value": "Copy: sun"}, {"from": "assistant", "value": "sun"}]}
    ex = encode_record(tok, rec, "sharegpt", 256)
    assert _target(tok, ex) == f"cat dog{END}sun{END}"
    assert D.to_messages(rec)[0] == {"role": "system", "content": "Sys."}
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(D.to_messages(rec), tokenize=False)
    # Prompt tokens are -100, target labels are the tokens themselves.
    assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ex.input_ids, ex.labels))


def test_tool_turns_are_context_not_target(tok):
    msgs = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "call weather()"},
            {"role": "tool", "content": "sunny 20C"}, {"role": "assistant", "content": "It is sunny."}]
    ex = encode_record(tok, {"messages": msgs}, "messages", 256)
    assert _target(tok, ex) == f"call weather(){END}It is sunny.{END}"
    assert "<|im_start|>tool\nsunny 20C" in _context(tok, ex)
    # ShareGPT function_call / observation turns map to assistant / tool.
    sg = {"conversations": [{"from": "human", "value": "weather?"}, {"from": "function_call", "value": "call weather()"},
                            {"from": "observation", "value": "sunny 20C"}, {"from": "gpt", "value": "It is sunny."}]}
    assert [m["role"] for m in D.to_messages(sg)] == ["user", "assistant", "tool", "assistant"]
    assert encode_record(tok, sg, "auto", 256).labels == ex.labels
    # A template that cannot render a tool turn: a clear DataError naming the record.
    import copy

    t2 = copy.deepcopy(tok)
    t2.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                        "{% endif %}{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(DataError, match=r"f.jsonl record 7: the chat template cannot render .*tool.*no tools"):
        encode_record(t2, {"messages": msgs}, "auto", 256, where="f.jsonl record 7")


def test_prompt_completion_strings_need_no_template(plain_tok):
    tok = plain_tok
    ex = encode_record(tok, {"prompt": "the cat is", "completion": " red and blue"}, "auto", 256)
    assert ex.input_ids[-1] == tok.eos_token_id  # EOS appended and trained
    assert tok.decode(ex.input_ids) == "the cat is red and blue" + END
    assert _target(tok, ex) == " red and blue" + END
    assert _context(tok, ex) == "the cat is"
    with pytest.raises(DataError, match="no chat template"):
        encode_record(tok, RECORDS["messages"][0], "auto", 256)


def test_prompt_completion_conversational(tok):
    rec = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "one"},
                      {"role": "assistant", "content": "uno"}, {"role": "user", "content": "two"}],
           "completion": [{"role": "assistant", "content": "dos"}]}
    ex = encode_record(tok, rec, "prompt_completion", 256)
    assert _target(tok, ex) == "dos" + END  # the prompt's assistant turn is context
    assert "uno" in _context(tok, ex)


def test_text_trains_every_token(plain_tok):
    ex = encode_record(plain_tok, {"text": "the dog is blue"}, "text", 256)
    assert ex.labels == ex.input_ids
    assert plain_tok.decode(ex.input_ids) == "the dog is blue" + END
    assert encode_record(plain_tok, {"text": "the dog is blue"}, "auto", 3).input_ids == ex.input_ids[:3]


def test_format_names_and_bad_records(tok):
    assert D.canonical_format("chat") == "messages"
    with pytest.raises(DataError, match="unknown data format 'xml'"):
        D.canonical_format("xml")
    with pytest.raises(DataError, match="conversations\\[1\\] is from 'robot'"):
        D.to_messages({"conversations": [{"from": "human", "value": "x"}, {"from": "robot", "value": "y"}]})
    with pytest.raises(DataError, match="raw text, not chat messages"):
        D.to_messages({"text": "abc"})
    with pytest.raises(DataError, match="both strings or both lists"):
        D.parse_record({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]})


# ---------------------------------------------------------------------------------------------------- sources
def _write(recs, path: Path) -> Path:
    import datasets

    if path.suffix == ".json":
        path.write_text(json.dumps(recs))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(recs).to_parquet(str(path))
    elif path.suffix == ".csv":
        datasets.Dataset.from_list(recs).to_csv(str(path), index=False)
    else:  # a saved dataset
        datasets.Dataset.from_list(recs).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", list(RECORDS))
def test_every_format_in_every_file_type(tok, tmp_path, fmt):
    recs = RECORDS[fmt]
    want = [encode_record(tok, r, fmt, 256, index=i) for i, r in enumerate(recs)]
    suffixes = [".json", ".jsonl", ".parquet", ""] + ([".csv"] if fmt in FLAT else [])
    for suffix in suffixes:
        path = _write(recs, tmp_path / f"{fmt}{suffix or '_saved'}")
        got = read_records(path)
        if suffix == ".csv" and fmt == "alpaca":  # CSV cells are strings: an empty "input" stays ""
            assert got == [{**r, "input": r["input"]} for r in recs]
        else:
            assert got == recs, suffix
        for data_format in ("auto", fmt):
            tr, ev = load_datasets(Cfg(path, data_format=data_format), tok, cache_dir=False)
            assert ev == [] and tr == want, (suffix, data_format)


def test_folders_and_splits(tok, tmp_path):
    import datasets

    folder = tmp_path / "folder"
    folder.mkdir()
    _write(RECORDS["alpaca"], folder / "a.jsonl")
    _write(RECORDS["text"], folder / "b.parquet")
    assert read_records(folder) == RECORDS["alpaca"] + RECORDS["text"]  # all files, in name order
    split = tmp_path / "split"
    split.mkdir()
    _write(RECORDS["alpaca"], split / "train.jsonl")
    _write(RECORDS["messages"], split / "test.jsonl")
    assert read_records(split) == RECORDS["alpaca"] and read_records(split, "test") == RECORDS["messages"]
    with pytest.raises(DataError, match="no split 'validation'"):
        read_records(split, "validation")
    dd = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS["sharegpt"]),
                          "test": datasets.Dataset.from_list(RECORDS["alpaca"])}).save_to_disk(str(dd))
    assert read_records(dd) == RECORDS["sharegpt"] and read_records(dd, "test") == RECORDS["alpaca"]
    # eval from a split of the training source
    tr, ev = load_datasets(Cfg(split, eval_split="test"), tok, cache_dir=False)
    assert len(tr) == 4 and [_target(tok, e) for e in ev] == [f"{i}{END}" for i in range(4)]


def test_mixed_schema_file_through_arrow(tmp_path):
    """Arrow unifies a mixed file's schema (nulls for missing keys); the records come back without them."""
    recs = RECORDS["alpaca"][:2] + RECORDS["messages"][:2]
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_struct_array(pa.array(recs)), path)  # the union schema
    assert read_records(path) == recs


def _fake_hub_cache(root: Path, repo_id: str, splits: dict) -> None:
    """The layout `hf download --repo-type dataset` leaves: refs/main and a snapshot of parquet files."""
    import datasets

    repo = root / "hub" / ("datasets--" + repo_id.replace("/", "--"))
    rev = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    data = repo / "snapshots" / rev / "data"
    data.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for split, recs in splits.items():  # snapshot files are links to content-addressed blobs
        blob = repo / "blobs" / f"{split}blob"
        datasets.Dataset.from_list(recs).to_parquet(str(blob))
        (data / f"{split}-00000-of-00001.parquet").symlink_to(os.path.relpath(blob, data))


def _fake_datasets_cache(root: Path, repo_id: str, splits: dict, tmp: Path) -> None:
    """The layout an online `datasets.load_dataset(repo_id)` leaves in $HF_HOME/datasets (a prepared Arrow cache)."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    org, name = repo_id.split("/")
    files = {}
    for split, recs in splits.items():
        files[split] = [str(tmp / f"{split}.parquet")]
        datasets.Dataset.from_list(recs).to_parquet(files[split][0])
    cache = root / "datasets"
    b = Parquet(cache_dir=str(cache), dataset_name=name, hash="0abc", data_files=files)
    b.download_and_prepare()
    (cache / name / b.config_id).rename(cache / name / "default")
    (cache / name).rename(cache / f"{org}___{name}")


@pytest.fixture()
def hf_home(tmp_path, monkeypatch):
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return home


def test_hub_names_from_the_offline_cache(tok, hf_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    _fake_hub_cache(hf_home, "toyorg/toyset", {"train": RECORDS["alpaca"], "test": RECORDS["text"]})
    assert read_records("toyorg/toyset") == RECORDS["alpaca"]
    assert read_records("toyorg/toyset:test") == read_records("toyorg/toyset", split="test") == RECORDS["text"]
    src = D.resolve_source("toyorg/toyset")
    assert src.identity["revision"] == "0123456789abcdef0123456789abcdef01234567"
    tr, ev = load_datasets(Cfg("toyorg/toyset", eval_file="toyorg/toyset:test"), tok, cache_dir=tmp_path / "c")
    assert len(tr) == 4 and [_target(tok, e) for e in ev] == [r["text"] + END for r in RECORDS["text"]]
    # A dataset prepared by datasets.load_dataset (no hub snapshot) is found too.
    _fake_datasets_cache(hf_home, "other/prepared", {"train": RECORDS["sharegpt"]}, tmp_path)
    assert read_records("other/prepared") == RECORDS["sharegpt"]
    with pytest.raises(DataError, match="no split|Unknown split"):
        read_records("toyorg/toyset:validation")
    with pytest.raises(DataError, match=r"dataset 'nobody/nothing' is not in the local Hugging Face cache.*"
                                        r"`hf download nobody/nothing --repo-type dataset`.*HF_HOME"):
        read_records("nobody/nothing")


def test_file_errors_are_data_errors(tok, tmp_path):
    with pytest.raises(DataError, match="data file .*missing.jsonl does not exist"):
        read_records(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(DataError, match="empty_dir is a directory, and neither a saved dataset"):
        read_records(empty)
    for suffix in (".jsonl", ".json", ".csv"):
        bad = tmp_path / f"latin1{suffix}"
        head = 'instruction,output\n"a","b"\n' if suffix == ".csv" else '{"instruction": "a", "output": "b"}\n'
        bad.write_bytes(head.encode() + '{"instruction": "caf\u00e9", "output": "x"}\n'.encode("latin-1"))
        byte = len(head) + len('{"instruction": "caf')
        line = head.count("\n") + 1
        with pytest.raises(DataError, match=f"latin1\\{suffix}: not UTF-8 text at byte {byte} \\(line {line}\\)"):
            read_records(bad)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl record 2: neither a chat record"):
        load_datasets(Cfg(bad), tok, cache_dir=False)


def test_non_file_source_messages(tmp_path):
    f = tmp_path / "plain.jsonl"
    f.write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match="does not exist"):
        read_records(f / "sub.jsonl")


# ---------------------------------------------------------------------------------------------------- cache
def test_tokenized_cache_hit_miss_and_atomic(tok, tmp_path, monkeypatch):
    path = _write(RECORDS["alpaca"] + RECORDS["text"], tmp_path / "d.jsonl")
    calls = []
    real = D._tokenize
    monkeypatch.setattr(D, "_tokenize", lambda *a: calls.append(1) or real(*a))
    cache = tmp_path / "cache"
    cfg = Cfg(path, eval_fraction=0.25, seed=1)
    first = load_datasets(cfg, tok, cache_dir=cache)
    assert len(calls) == 1
    entry = D.tokenized_cache_path(cfg, tok, cache)
    assert entry.is_dir() and [p.name for p in cache.iterdir()] == [entry.name]  # no temp folder left
    second = load_datasets(cfg, tok, cache_dir=cache)
    assert len(calls) == 1 and second == first  # loaded, not tokenized
    load_datasets(Cfg(path, eval_fraction=0.25, seed=1, max_length=64), tok, cache_dir=cache)
    assert len(calls) == 2  # another max_length: another entry
    import copy

    t2 = copy.deepcopy(tok)
    t2.chat_template = t2.chat_template.replace("<|im_start|>", "<|im_start|> ")
    load_datasets(cfg, t2, cache_dir=cache)
    assert len(calls) == 3  # another template
    # A process that finds the entry already there (another rank won the race) keeps it.
    D._save_atomic(entry, first[0], first[1])
    assert load_datasets(cfg, tok, cache_dir=cache) == first and len(calls) == 3
    _write(RECORDS["alpaca"] + RECORDS["text"][:3], path)
    load_datasets(cfg, tok, cache_dir=cache)
    assert len(calls) == 4  # the file changed
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_tokenized_cache_without_eval_split_is_hit(tok, tmp_path, monkeypatch, caplog):
    """No eval rows (eval_fraction 0, no eval file): the entry holds the train split only and is read back, not
    rebuilt with an 'unreadable' warning on every run."""
    path = _write(RECORDS["alpaca"], tmp_path / "d.jsonl")
    calls = []
    real = D._tokenize
    monkeypatch.setattr(D, "_tokenize", lambda *a: calls.append(1) or real(*a))
    first = load_datasets(Cfg(path), tok, cache_dir=tmp_path / "c")
    assert first[1] == [] and len(first[0]) == 4
    with caplog.at_level("WARNING"):
        assert load_datasets(Cfg(path), tok, cache_dir=tmp_path / "c") == first
    assert len(calls) == 1 and "unreadable" not in caplog.text


def test_examples_to_dataset_round_trip(tok):
    exs = [encode_record(tok, r, "auto", 256, index=i) for i, r in enumerate(RECORDS["messages"])]
    ds = D.examples_to_dataset(exs)
    assert ds.column_names == ["input_ids", "labels", "index"] and len(ds) == 4
    assert D.dataset_to_examples(ds) == exs
    assert D.make_collator(0)([ds[0], ds[1]])["input_ids"].shape[0] == 2


# ---------------------------------------------------------------------------------------------------- collator
def test_padding_free_collator_matches_padded_loss(tok, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    exs = [encode_record(tok, {"instruction": f"say {i}" + " red" * i, "output": "blue " * (i + 1)}, "auto", 64, i)
           for i in range(3)] + [encode_record(tok, {"text": "the cat is red and blue"}, "auto", 64, 3)]
    flat = D.make_collator(tok.pad_token_id, padding_free=True)(exs)
    lens = [len(e.input_ids) for e in exs]
    assert set(flat) == {"input_ids", "labels", "position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k",
                         "max_length_q", "max_length_k"}  # the example boundaries: test_packed_attention.py
    assert flat["input_ids"].shape == flat["labels"].shape == (1, sum(lens))
    assert flat["attention_mask"].sum() == sum(lens)  # what the Trainer counts as tokens seen
    starts = [sum(lens[:k]) for k in range(len(exs))]
    assert flat["position_ids"][0].tolist() == [p for L in lens for p in range(L)]
    # No target at an example's first token (it would be predicted from the previous example's last token) ...
    assert all(flat["labels"][0, s].item() == IGNORE_INDEX for s in starts)
    # ... and every other label is ours.
    assert flat["labels"][0].tolist() == [IGNORE_INDEX if t == 0 else lab
                                          for e in exs for t, lab in enumerate(e.labels)]
    padded = D.make_collator(tok.pad_token_id)(exs)
    assert padded["input_ids"].shape == (4, max(lens))
    # The same loss both ways on a tiny Llama. transformers (5.x) derives the block-causal mask from position_ids
    # only without a KV cache (use_cache=False, as in training) and without an attention mask (the trainer drops
    # it); otherwise the examples see each other.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa",
                                                 dtype=torch.float32)
    model.train()
    with torch.no_grad():
        lp = model(**padded, use_cache=False).loss
        lf = model(**{k: v for k, v in flat.items() if k != "attention_mask"}, use_cache=False).loss
    torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-5)


def test_pad_multiple_rounds_the_batch_and_keeps_the_loss(tok, tiny_llama_dir):
    """``pad_multiple``: the padded batch's length (and each packed row's) is a multiple of it, the extra tokens are
    masked padding with no targets, and the loss is the unrounded batch's."""
    from transformers import AutoModelForCausalLM

    exs = [encode_record(tok, {"instruction": f"say {i}" + " red" * i, "output": "blue " * (i + 1)}, "auto", 64, i)
           for i in range(3)]
    longest = max(len(e.input_ids) for e in exs)
    plain, rounded = D.make_collator(tok.pad_token_id)(exs), D.make_collator(tok.pad_token_id, pad_multiple=16)(exs)
    width = rounded["input_ids"].shape[1]
    assert width % 16 == 0 and longest <= width < longest + 16 and width > longest  # this data is not a multiple
    assert rounded["attention_mask"].sum() == plain["attention_mask"].sum()
    assert rounded["labels"][:, longest:].eq(IGNORE_INDEX).all()
    packed = D.make_collator(tok.pad_token_id, padding_free=True, row_tokens=8, pad_multiple=16)(exs)
    assert packed["input_ids"].shape[1] % 16 == 0 and packed["attention_mask"].sum() == plain["attention_mask"].sum()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation="sdpa",
                                                 dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(**rounded, use_cache=False).loss, model(**plain, use_cache=False).loss,
                                   rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_give_each_example_its_own_logits(tok, tiny_llama_dir, attn):
    """Rows of at most max(longest, row_tokens) tokens: every example lands in exactly one row, rows are no longer
    than the cap, a row's padding tail is a segment of its own, and each example's logits in its row equal those of
    the example run alone (no attention across examples or into the tail)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(3)
    lens = [int(n) for n in torch.randint(2, 30, (9,), generator=g)]
    exs = [D.Example(input_ids=torch.randint(3, 200, (n,), generator=g).tolist(), labels=list(range(n)), index=i)
           for i, n in enumerate(lens)]
    batch = D.make_collator(0, padding_free=True, row_tokens=40)(exs)
    cap = max(max(lens), 40)
    rows, width = batch["input_ids"].shape
    assert 1 < rows < len(exs) and width <= cap
    assert batch["attention_mask"].sum() == sum(lens)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), attn_implementation=attn, dtype=torch.float64)
    model.config.use_cache = False
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        found = []
        for r in range(rows):
            pos = batch["position_ids"][r].tolist()
            starts = [t for t in range(width) if pos[t] == 0]
            for a, b in zip(starts, starts[1:] + [width]):
                if batch["attention_mask"][r, a] == 0:  # the padding tail
                    assert batch["labels"][r, a:b].eq(IGNORE_INDEX).all() and a > 0
                    continue
                ids = batch["input_ids"][r, a:b].tolist()
                i = next(i for i, e in enumerate(exs) if e.input_ids == ids and i not in found)
                found.append(i)
                assert batch["labels"][r, a:b].tolist() == [IGNORE_INDEX] + exs[i].labels[1:]
                alone = model(input_ids=torch.tensor([ids])).logits[0]
                # eager takes its softmax in float32: float32's rounding there
                tol = 1e-9 if attn == "sdpa" else 1e-5
                torch.testing.assert_close(packed[r, a:b], alone, rtol=tol, atol=tol)
    assert sorted(found) == list(range(len(exs)))


# ---------------------------------------------------------------------------------------------------- engine
def test_engine_reads_every_format(tok, tmp_path):
    from bdlora.train.engine.config import JobConfig
    from bdlora.train.engine.data import tokenize_records
    from bdlora.train.engine.jobs import load_job_data

    def job(name, path, **kw):
        return JobConfig.from_dict({"name": name, "model": "tiny-random", "train_file": str(path), "eval_fraction": 0.2,
                                    **kw})

    recs = [r for rs in RECORDS.values() for r in rs]
    path = _write(recs, tmp_path / "all.jsonl")
    split = load_job_data(job("mix", path, max_length=128), tok)
    assert len(split.train) + len(split.val) == len(recs)
    assert all(s.n_targets > 0 for s in split.train + split.val)
    text = tokenize_records(RECORDS["text"], tok, 128)
    assert all(all(s.loss_mask) for s in text)
    bad = _write(RECORDS["text"] + [{"foo": 1}], tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match=r"job 'broken' .*bad.jsonl record 5: neither"):
        load_job_data(job("broken", bad, eval_fraction=0.0, max_length=128), tok)
    with pytest.raises(DataError, match=r"job 'tiny'.*no usable"):
        load_job_data(job("tiny", _write(RECORDS["alpaca"], tmp_path / "a.jsonl"), eval_fraction=0.0,
                          max_length=8), tok)

