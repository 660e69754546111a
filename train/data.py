"""Instruction data: read records from local files, saved datasets or the Hugging Face cache; render them (chat
template, or raw text); mask everything but the response; cache the tokenized result once per run.

Sources (:func:`read_records`):

* a local ``.json`` (a list of records, or ``{"data": [...]}``) or ``.jsonl`` file (one record a line), read with
  Python's ``json``: exact records even when they mix formats (Arrow would unify their schemas), and an error names
  the 1-based line; a ``.parquet`` or ``.csv`` file, read with ``datasets.load_dataset("parquet"|"csv")``;
* a folder written by ``Dataset.save_to_disk``/``DatasetDict.save_to_disk`` (a ``DatasetDict`` takes the split,
  default ``train``), or a folder of such data files: all of them in name order, or with a split, the files
  ``datasets`` assigns to that split (``train-*.parquet``, ``test.jsonl``, ...);
* a hub dataset id, ``ORG/NAME`` or ``ORG/NAME:SPLIT`` (or the ``split`` argument; default ``train``): its snapshot
  in the hub cache (``$HF_HOME/hub``; downloaded there by :func:`bdlora.hub.download` unless ``HF_HUB_OFFLINE`` is
  set, as ``hf download --repo-type dataset ORG/NAME`` would), its data files for the split read by datasets' naming
  rules; a repository whose data those rules do not find is loaded by ``datasets.load_dataset``.

Records read through Arrow lose their null fields (a mixed file's schema gives every record every key, null where
it had none): a key whose value is None counts as absent everywhere below. Record numbers in messages are 1-based
("record 1" is the first record, line 1 of a JSONL file).

Formats (``data_format``; ``auto`` decides per record, in this order):

* ``messages`` (alias ``chat``): ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}]}``,
  at least one assistant message; ``tool_calls``/``tool_call_id``/``name`` keys are passed to the template;
* ``sharegpt``: ``{"conversations": [{"from": ..., "value": str}], "system"?: str}``; ``from`` is human/user,
  gpt/assistant/model/chatgpt, system, tool/function/observation/function_response (a tool turn) or function_call (an
  assistant turn);
* ``alpaca``: ``{"instruction", "input"?, "output", "system"?}`` becomes ``[system?], user = instruction (+ "\\n\\n"
  + input), assistant = output``;
* ``prompt_completion``: ``{"prompt": str, "completion": str}`` (TRL's standard form): the prompt as-is, no chat
  template, tokenized with the tokenizer's special tokens (BOS where it adds one) and loss on the completion and an
  EOS appended to it; or both lists of messages (TRL's conversational form): rendered with the chat template, loss
  on the completion's assistant turns;
* ``text``: ``{"text": str}``: ``tokenizer(text)`` with its special tokens plus EOS, loss on every token.

Chat formats are rendered with the tokenizer's chat template. Labels are the input ids on the assistant responses
(each assistant turn's content and the template's end-of-turn marker after it, so the model learns to stop) and -100
everywhere else: system, user and tool turns and the assistant headers are context. The response spans are found as
character ranges of the rendered text (the template renders the conversation up to a turn as a prefix of the
whole) and mapped to tokens with the fast tokenizer's offsets. ``text`` and string ``prompt_completion`` need no
chat template.

Tokenized once per run: :func:`load_datasets` stores the (train, eval) examples as an Arrow ``DatasetDict`` under
``cache_dir/<fingerprint>`` (default ``$BDLORA_CACHE_DIR`` or ``~/.cache/bdlora/tokenized``), keyed by the sources'
identity (path, size, mtime and content hash; a hub snapshot's commit; a prepared dataset's fingerprint), the
split parameters, format, max_length and the tokenizer (name, vocabulary, special tokens, chat template). The entry
is written to a temporary folder and renamed into place, so a reader never sees half of one; a process that finds
it (the trainer's other ranks, under ``main_process_first``) loads it instead of tokenizing.

Data order is a deterministic stream: epoch ``e`` is a permutation of the training set drawn from ``seed + e``,
epochs are concatenated, and optimizer step ``s`` consumes stream positions ``[s*G, (s+1)*G)`` with
``G = batch_size * grad_accum * num_processes``; micro-batch ``j`` of process ``p`` takes the ``batch_size``
positions starting at ``s*G + (j*num_processes + p)*batch_size``. The data position of a checkpoint is thus its
step, and resuming is exact.

Padding-free batches (:func:`make_collator` with ``padding_free=True``, :func:`pack_rows`): the examples packed into
rows (the engine's first-fit rows: at most the longest example or ``row_tokens``, whichever is larger), ``position_ids``
restarting at 0 per example and the first label of each example -100, so no target crosses an example boundary.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import torch

from .config import DATA_FORMATS, ConfigError

log = logging.getLogger(__name__)
IGNORE_INDEX = -100
FILE_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# Bump when the encoding of a record changes, so tokenized caches written by older code are not reused.
ENCODING_VERSION = 2


class DataError(ConfigError):
    """A data file or record that cannot be used; the message names the file and record."""


# ---------------------------------------------------------------------------------------------------- reading
def _drop_nulls(x):
    """Arrow gives every record every key of the schema (null where it had none): drop those keys."""
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


def _rows(ds) -> list[dict]:
    return [_drop_nulls(r) for r in ds.to_list()]


def _check_utf8(path: Path) -> None:
    """DataError naming the byte offset and line of the first byte sequence that is not UTF-8."""
    dec = codecs.getincrementaldecoder("utf-8")()
    done, lines = 0, 1
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:
                dec.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                line = lines + chunk[:max(e.start, 0)].count(b"\n")
                raise DataError(f"{path}: not UTF-8 text at byte {done + e.start} (line {line}): {e.reason}; "
                                f"re-encode the file as UTF-8") from None
            if not chunk:
                return
            done += len(chunk)
            lines += chunk.count(b"\n")


def _read_json(path: Path) -> list:
    _check_utf8(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if path.suffix == ".jsonl" or (stripped and stripped[0] == "{" and path.suffix != ".json"):
        records = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        return records
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}})")
    return data


def _read_table(path: Path, kind: str) -> list[dict]:
    """A parquet or CSV file through ``datasets`` (CSV columns are read as strings, empty cells as "")."""
    import datasets

    kwargs = {}
    if kind == "csv":
        _check_utf8(path)
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), None)
        if not header:
            raise DataError(f"{path}: empty CSV file (no header row)")
        kwargs = dict(features=datasets.Features({c: datasets.Value("string") for c in header}),
                      keep_default_na=False)
    try:
        ds = datasets.load_dataset(kind, data_files=[str(path)], split="train", **kwargs)
    except Exception as e:  # noqa: BLE001 - any reader failure is a data error naming the file
        raise DataError(f"{path}: cannot be read as {kind} ({type(e).__name__}: {e})") from None
    return _rows(ds)


def _read_file(path: Path) -> list:
    kind = FILE_SUFFIXES.get(path.suffix.lower())
    if kind is None:
        # Unknown suffix: JSON/JSONL as before (sniffed from the first character).
        kind = "json"
    return _read_json(path) if kind == "json" else _read_table(path, kind)


def _folder_files(folder: Path, split: Optional[str]) -> list[Path]:
    """The data files of a folder for ``split`` by ``datasets``' naming rules (a folder of arbitrarily named
    files is all ``train``)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    try:
        patterns = get_data_patterns(str(folder))
        files = DataFilesDict.from_patterns(patterns, base_path=str(folder),
                                            allowed_extensions=list(FILE_SUFFIXES))
    except Exception:  # noqa: BLE001 - datasets: EmptyDatasetError, FileNotFoundError
        raise DataError(f"{folder} is a directory, and neither a saved dataset (Dataset.save_to_disk) nor a folder "
                        f"of data files (.json, .jsonl, .parquet, .csv)") from None
    split = split or "train"
    if split not in files:
        raise DataError(f"{folder}: no split {split!r}; the folder's files make the splits {sorted(files)}")
    return sorted(Path(f) for f in files[split])


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def _file_identity(path: Path) -> dict:
    st = path.stat()
    ident = {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if st.st_size <= (64 << 20):
        h = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        ident["blake2b"] = h.hexdigest()
    return ident


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


def parse_source(source: str | os.PathLike, split: Optional[str] = None) -> tuple[str, Optional[str]]:
    """``(source, split)``: a string ``ORG/NAME:SPLIT`` that is not an existing path gives its split."""
    s = os.fspath(source)
    if not os.path.exists(s) and _HUB_ID.match(s) and ":" in s:
        s, sp = s.rsplit(":", 1)
        if split and split != sp:
            raise DataError(f"data source {source!r} names split {sp!r} but split={split!r} was given")
        split = sp
    return s, split


@dataclass
class Source:
    """A resolved data source: what it is, its identity (for cache keys) and how to read it."""

    name: str  # for messages
    kind: str  # file | folder | saved | hub
    split: Optional[str]
    identity: dict
    files: list[Path] = field(default_factory=list)
    dataset: Any = None  # a datasets.Dataset already opened (saved folder, hub)

    def read(self) -> list[dict]:
        if self.dataset is not None:
            records = _rows(self.dataset)
        else:
            records = [r for f in self.files for r in _read_file(f)]
        if not records:
            raise DataError(f"{self.name}: no records")
        return records


def _resolve_hub(repo_id: str, split: Optional[str]) -> Source:
    import datasets

    from bdlora.hub import HubError, download

    split = split or "train"
    where = f"{repo_id}:{split}"
    try:
        snap = download(repo_id, repo_type="dataset")
    except HubError as e:
        # offline or unreachable: a dataset that datasets.load_dataset prepared before ($HF_HOME/datasets) still loads
        try:
            ds = datasets.load_dataset(repo_id, split=split)
        except Exception:  # noqa: BLE001 - not prepared either: the hub's message says what to do
            raise DataError(str(e)) from None
        return Source(where, "hub", split, {"hub": repo_id, "fingerprint": ds._fingerprint, "split": split},
                      dataset=ds)
    try:
        # The snapshot's data files for the split by datasets' naming rules, each read on its own (so splits may
        # differ in schema; a README `configs:` section is not read).
        files = _folder_files(snap, split)
        return Source(where, "hub", split, {"hub": repo_id, "revision": snap.name, "split": split,
                                            "files": [f.relative_to(snap).as_posix() for f in files]}, files=files)
    except DataError as e:
        if "no split" in str(e):
            raise DataError(f"{where}: {e}") from None
        # no data files by the naming rules (e.g. a README `configs:` layout): datasets knows the repository
    try:
        ds = datasets.load_dataset(repo_id, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the message says which
        raise DataError(f"{where}: datasets could not load it ({type(e).__name__}: {e})") from None
    return Source(where, "hub", split, {"hub": repo_id, "fingerprint": ds._fingerprint, "split": split}, dataset=ds)


def resolve_source(source: str | os.PathLike, split: Optional[str] = None) -> Source:
    """What ``source`` is (module docstring: file, folder, saved dataset, hub id), without reading its records
    (a saved or hub dataset is opened, memory-mapped)."""
    s, split = parse_source(source, split)
    path = Path(s).expanduser()
    if path.is_file():
        return Source(str(path), "file", split, {"files": [_file_identity(path)]}, files=[path])
    if path.is_dir():
        if _is_saved_dataset(path):
            import datasets

            try:
                ds = datasets.load_from_disk(str(path))
            except Exception as e:  # noqa: BLE001
                raise DataError(f"{path}: a saved dataset folder that cannot be loaded ({e})") from None
            if isinstance(ds, datasets.DatasetDict):
                sp = split or "train"
                if sp not in ds:
                    raise DataError(f"{path}: saved DatasetDict has no split {sp!r}; it has {sorted(ds)}")
                ds = ds[sp]
            ident = {"saved": str(path.resolve()), "fingerprint": ds._fingerprint, "split": split,
                     "files": [_file_identity(Path(f["filename"])) for f in ds.cache_files]}
            return Source(str(path), "saved", split, ident, dataset=ds)
        files = _folder_files(path, split)
        return Source(f"{path}" + (f" ({split})" if split else ""), "folder", split,
                      {"files": [_file_identity(f) for f in files]}, files=files)
    if path.exists():
        raise DataError(f"data file {path} is not a regular file")
    if _HUB_ID.match(s) and path.suffix.lower() not in FILE_SUFFIXES and not s.startswith((".", "~")):
        return _resolve_hub(s, split)
    if path.parent.is_file():
        raise DataError(f"data file {path} does not exist ({path.parent} is a file)")
    raise DataError(f"data file {path} does not exist")


def read_records(source: str | os.PathLike, split: Optional[str] = None) -> list[dict]:
    """The records of a data source (module docstring): a file, folder, saved dataset or cached hub dataset id
    (``ORG/NAME`` or ``ORG/NAME:SPLIT``; ``split`` defaults to ``train`` for folders and datasets)."""
    return resolve_source(source, split).read()


# ---------------------------------------------------------------------------------------------------- formats
def canonical_format(fmt: str) -> str:
    fmt = (fmt or "auto").lower()
    if fmt == "chat":
        return "messages"
    if fmt not in DATA_FORMATS:
        raise DataError(f"unknown data format {fmt!r}; use one of {', '.join(DATA_FORMATS)}")
    return fmt


def _has(record: Mapping, key: str) -> bool:
    return record.get(key) is not None


def detect_format(record: Mapping, where: str = "record") -> str:
    """The format of one record (``auto``): messages, sharegpt, alpaca, prompt_completion or text."""
    if not isinstance(record, Mapping):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if _has(record, "messages"):
        return "messages"
    if _has(record, "conversations"):
        return "sharegpt"
    if _has(record, "instruction") and _has(record, "output"):
        return "alpaca"
    if _has(record, "prompt") and _has(record, "completion"):
        return "prompt_completion"
    if _has(record, "text"):
        return "text"
    raise DataError(f"{where}: neither a chat record (`messages`, or ShareGPT `conversations`) nor an alpaca "
                    f"(`instruction` + `output`), prompt/completion (`prompt` + `completion`) or `text` record; "
                    f"keys are {sorted(k for k in record if record[k] is not None)}")


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "model": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
                   "function_call": "assistant", "system": "system", "tool": "tool", "function": "tool",
                   "observation": "tool", "function_response": "tool", "tool_response": "tool"}
_ROLES = ("system", "user", "assistant", "tool")
_PASS_KEYS = ("tool_calls", "tool_call_id", "name")


def _check_messages(msgs, where: str, key: str = "messages") -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise DataError(f"{where}: chat record needs a non-empty list {key!r}")
    out = []
    for j, m in enumerate(msgs):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: {key}[{j}] must be {{'role': str, 'content': str}}")
        content = m.get("content")
        if content is None and m.get("tool_calls") is not None:
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: {key}[{j}] must be {{'role': str, 'content': str}}")
        if m["role"] not in _ROLES:
            raise DataError(f"{where}: {key}[{j}] has role {m['role']!r}; use system/user/assistant/tool")
        msg = {"role": m["role"], "content": content}
        msg.update({k: m[k] for k in _PASS_KEYS if m.get(k) is not None})
        out.append(msg)
    return out


def _sharegpt(record: Mapping, where: str) -> list[dict]:
    conv = record.get("conversations")
    if not isinstance(conv, list) or not conv:
        raise DataError(f"{where}: ShareGPT record needs a non-empty list 'conversations'")
    msgs = []
    if isinstance(record.get("system"), str) and record["system"]:
        msgs.append({"role": "system", "content": record["system"]})
    for j, turn in enumerate(conv):
        if not isinstance(turn, Mapping) or not isinstance(turn.get("from"), str) \
                or not isinstance(turn.get("value"), str):
            raise DataError(f"{where}: conversations[{j}] must be {{'from': str, 'value': str}}")
        role = _SHAREGPT_ROLES.get(turn["from"].lower())
        if role is None:
            raise DataError(f"{where}: conversations[{j}] is from {turn['from']!r}; use human/user, "
                            f"gpt/assistant/model, system, function_call, or tool/function/observation")
        msgs.append({"role": role, "content": turn["value"]})
    return msgs


def _alpaca(record: Mapping, where: str) -> list[dict]:
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise DataError(f"{where}: alpaca record needs a string {key!r}")
    user = record["instruction"]
    extra = record.get("input") or ""
    if not isinstance(extra, str):
        raise DataError(f"{where}: alpaca 'input' must be a string")
    if extra.strip():
        user = f"{user}\n\n{extra}"
    msgs = []
    if record.get("system"):
        msgs.append({"role": "system", "content": str(record["system"])})
    return msgs + [{"role": "user", "content": user}, {"role": "assistant", "content": record["output"]}]


@dataclass
class Parsed:
    """A record in one of two shapes: chat ``messages`` (loss on the assistant turns from ``train_from`` on), or
    raw ``prompt`` + ``completion`` text (no template; ``train_prompt``: loss on the prompt too, for ``text``)."""

    kind: str  # chat | raw
    messages: Optional[list[dict]] = None
    train_from: int = 0
    prompt: str = ""
    completion: str = ""
    train_prompt: bool = False


def parse_record(record: Mapping, fmt: str = "auto", where: str = "record") -> Parsed:
    kind = canonical_format(fmt)
    if kind == "auto" or not isinstance(record, Mapping):
        kind = detect_format(record, where)
    if kind == "alpaca":
        return Parsed("chat", _alpaca(record, where))
    if kind == "text":
        text = record.get("text")
        if not isinstance(text, str) or not text:
            raise DataError(f"{where}: text record needs a non-empty string 'text'")
        return Parsed("raw", prompt="", completion=text, train_prompt=True)
    if kind == "prompt_completion":
        p, c = record.get("prompt"), record.get("completion")
        if isinstance(p, str) and isinstance(c, str):
            if not c:
                raise DataError(f"{where}: empty 'completion', so nothing to learn")
            return Parsed("raw", prompt=p, completion=c)
        if isinstance(p, list) and isinstance(c, list):
            pm = _check_messages(p, where, "prompt")
            cm = _check_messages(c, where, "completion")
            if not any(m["role"] == "assistant" for m in cm):
                raise DataError(f"{where}: the completion has no assistant message, so nothing to learn")
            return Parsed("chat", pm + cm, train_from=len(pm))
        raise DataError(f"{where}: prompt/completion record needs 'prompt' and 'completion' both strings or both "
                        f"lists of messages")
    msgs = _sharegpt(record, where) if kind == "sharegpt" else _check_messages(record.get("messages"), where)
    if not any(m["role"] == "assistant" for m in msgs):
        raise DataError(f"{where}: no assistant message, so nothing to learn")
    return Parsed("chat", msgs)


def to_messages(record: dict, fmt: str = "auto", where: str = "record") -> list[dict]:
    """One record as chat messages ``[{role, content}]`` (a conversational prompt/completion: prompt + completion).

    ``text`` and string prompt/completion records have no messages (they are encoded without a chat template):
    DataError."""
    p = parse_record(record, fmt, where)
    if p.kind != "chat":
        raise DataError(f"{where}: a {'text' if p.train_prompt else 'prompt/completion'} record is raw text, not "
                        f"chat messages")
    return p.messages


# ---------------------------------------------------------------------------------------------------- encoding
@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    index: int  # position in the source file (after the train/eval split: the original record index)

    @property
    def num_target_tokens(self) -> int:
        return sum(1 for t in self.labels if t != IGNORE_INDEX)


def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja raise_exception(), missing keys: the template refuses
        roles = "/".join(dict.fromkeys(m["role"] for m in messages))
        raise DataError(f"the chat template cannot render this conversation (roles {roles}): "
                        f"{type(e).__name__}: {e}") from None


def response_spans(tokenizer, messages: list[dict], train_from: int = 0) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant responses (with end-of-turn), of the
    messages from ``train_from`` on."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; use an instruct/chat model or set one (raw `text` and "
                        "string `prompt`/`completion` records need none)")
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < train_from:
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = _render(tokenizer, messages[:i + 1])
        if not full.startswith(through) or not through.startswith(before):
            tools = " with its tool turns" if any(x["role"] == "tool" for x in messages[:i + 1]) else ""
            raise DataError(f"the chat template does not render conversations{tools} prefix-consistently (message "
                            f"{i}); cannot locate the assistant responses for response-only loss")
        # The span ends after the end-of-turn marker; trailing whitespace the template adds is not target.
        end = len(through.rstrip())
        spans.append((len(before), end))
    return full, spans


def encode(tokenizer, messages: list[dict], max_length: int, index: int = 0, train_from: int = 0
           ) -> Optional[Example]:
    """Tokens and response-only labels of one conversation; None when truncation leaves no response token."""
    text, spans = response_spans(tokenizer, messages, train_from)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        if e <= s:
            continue
        for a, b in spans:
            if s >= a and e <= b:
                labels[t] = ids[t]
                break
    ids, labels = ids[:max_length], labels[:max_length]
    if all(x == IGNORE_INDEX for x in labels):
        return None
    return Example(ids, labels, index)


def encode_text(tokenizer, prompt: str, completion: str, max_length: int, index: int = 0,
                train_prompt: bool = False) -> Optional[Example]:
    """Raw text, no chat template: ``tokenizer(prompt + completion)`` with the tokenizer's special tokens (BOS where
    it adds one), then EOS unless it already ends so. Labels: the completion's tokens (those starting at or after
    the prompt's end; a token straddling the boundary stays prompt) and the EOS; with ``train_prompt`` every token.
    None when truncation leaves no target."""
    text = prompt + completion
    enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if train_prompt:
        labels = list(ids)
    else:
        labels = [tid if (e > s and s >= len(prompt)) else IGNORE_INDEX
                  for tid, (s, e) in zip(ids, enc["offset_mapping"])]
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
        labels.append(eos)
    elif eos is not None:
        labels[-1] = eos
    ids, labels = ids[:max_length], labels[:max_length]
    if all(x == IGNORE_INDEX for x in labels):
        return None
    return Example(ids, labels, index)


def encode_record(tokenizer, record: Mapping, fmt: str, max_length: int, index: int = 0, where: str = "record"
                  ) -> Optional[Example]:
    """One record of any format (module docstring) as an Example; None when truncation leaves no target."""
    p = parse_record(record, fmt, where)
    try:
        if p.kind == "chat":
            return encode(tokenizer, p.messages, max_length, index, p.train_from)
        return encode_text(tokenizer, p.prompt, p.completion, max_length, index, p.train_prompt)
    except DataError as e:
        raise DataError(f"{where}: {e}") from None


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The generation prompt for the conversation without its last assistant message (evaluation)."""
    if messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return _render(tokenizer, messages, add_generation_prompt=True)


def encode_records(tokenizer, records: Iterable[tuple[int, dict]], fmt: str, max_length: int, source: str
                   ) -> list[Example]:
    """Examples of ``(index, record)`` pairs (index 0-based; messages say ``record index+1``)."""
    out, dropped = [], 0
    for idx, rec in records:
        ex = encode_record(tokenizer, rec, fmt, max_length, index=idx, where=f"{source} record {idx + 1}")
        if ex is None:
            dropped += 1
        else:
            out.append(ex)
    if dropped:
        log.warning("%s: dropped %d example(s) whose response lies beyond max_length=%d tokens",
                    source, dropped, max_length)
    if not out:
        raise DataError(f"{source}: no usable examples (max_length={max_length} may be too small)")
    return out


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Seeded (train, eval) split of ``range(n)``; eval gets round(fraction*n), at least 1 when fraction > 0."""
    if fraction <= 0:
        return list(range(n)), []
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    k = max(1, int(round(fraction * n)))
    if k >= n:
        raise DataError(f"eval_fraction={fraction} leaves no training example out of {n}")
    return sorted(perm[k:]), sorted(perm[:k])


# ---------------------------------------------------------------------------------------------------- datasets + cache
def _features():
    import datasets

    return datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                              "labels": datasets.List(datasets.Value("int32")),
                              "index": datasets.Value("int64")})


def examples_to_dataset(examples: list[Example]):
    """A ``datasets.Dataset`` with columns input_ids, labels, index."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                       "labels": [e.labels for e in examples],
                                       "index": [e.index for e in examples]}, features=_features())


def dataset_to_examples(ds) -> list[Example]:
    cols = ds.with_format(None)[:]
    return [Example(list(i), list(l), int(x)) for i, l, x in zip(cols["input_ids"], cols["labels"], cols["index"])]


def tokenizer_fingerprint(tokenizer) -> dict:
    """What of a tokenizer decides the encoding: its name, full fast-tokenizer definition (vocabulary, merges,
    normalizer, BOS/EOS post-processing) or vocabulary, special tokens and chat template."""
    h = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    tmpl = getattr(tokenizer, "chat_template", None)
    return {"name": getattr(tokenizer, "name_or_path", ""), "class": type(tokenizer).__name__,
            "definition": h.hexdigest(), "len": len(tokenizer),
            "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
            "bos_id": tokenizer.bos_token_id, "eos_id": tokenizer.eos_token_id,
            "add_bos": getattr(tokenizer, "add_bos_token", None), "add_eos": getattr(tokenizer, "add_eos_token", None),
            "chat_template": hashlib.blake2b(json.dumps(tmpl, sort_keys=True).encode(), digest_size=16).hexdigest()}


def default_cache_dir() -> Path:
    env = os.environ.get("BDLORA_CACHE_DIR")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bdlora"
    return base / "tokenized"


def tokenized_cache_key(cfg, tokenizer, train_src: Source, eval_src: Optional[Source]) -> str:
    key = {"version": ENCODING_VERSION, "train": train_src.identity,
           "eval": eval_src.identity if eval_src is not None else None,
           "eval_from_train": eval_src is not None and eval_src is train_src,
           "eval_fraction": float(getattr(cfg, "eval_fraction", 0.0) or 0.0), "seed": int(getattr(cfg, "seed", 0)),
           "format": canonical_format(getattr(cfg, "data_format", "auto")), "max_length": int(cfg.max_length),
           "tokenizer": tokenizer_fingerprint(tokenizer)}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _tokenize(cfg, tokenizer, train_src: Source, eval_src: Optional[Source]) -> tuple[list[Example], list[Example]]:
    fmt = canonical_format(getattr(cfg, "data_format", "auto"))
    records = train_src.read()
    if eval_src is not None:
        tr_idx = list(range(len(records)))
        ev_records = eval_src.read()
        ev = encode_records(tokenizer, enumerate(ev_records), fmt, cfg.max_length, eval_src.name)
    else:
        tr_idx, ev_idx = split_indices(len(records), cfg.eval_fraction, cfg.seed)
        ev = (encode_records(tokenizer, ((i, records[i]) for i in ev_idx), fmt, cfg.max_length, train_src.name)
              if ev_idx else [])
    tr = encode_records(tokenizer, ((i, records[i]) for i in tr_idx), fmt, cfg.max_length, train_src.name)
    return tr, ev


def _save_atomic(path: Path, train: list[Example], ev: list[Example]) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        # an empty split is left out: datasets cannot read back a split saved with no rows
        splits = {name: examples_to_dataset(rows) for name, rows in (("train", train), ("eval", ev)) if rows}
        datasets.DatasetDict(splits).save_to_disk(str(tmp))
        os.rename(tmp, path)  # atomic; fails if another process put its (identical) entry there first
    except OSError:
        if not path.exists():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def tokenized_cache_path(cfg, tokenizer, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Where :func:`load_datasets` keeps the tokenized examples of ``cfg`` and ``tokenizer``."""
    train_src, eval_src = _sources(cfg)
    return Path(cache_dir or default_cache_dir()) / tokenized_cache_key(cfg, tokenizer, train_src, eval_src)


def _sources(cfg) -> tuple[Source, Optional[Source]]:
    train_src = resolve_source(cfg.train_file, getattr(cfg, "train_split", None))
    eval_split = getattr(cfg, "eval_split", None)
    eval_src = None
    if getattr(cfg, "eval_file", None):
        eval_src = resolve_source(cfg.eval_file, eval_split)
    elif eval_split:
        eval_src = resolve_source(cfg.train_file, eval_split)
    return train_src, eval_src


def load_datasets(cfg, tokenizer, cache_dir: Optional[str | os.PathLike | bool] = None
                  ) -> tuple[list[Example], list[Example]]:
    """(train, eval) examples of a :class:`~bdlora.train.config.TrainConfig` (``train_file``, ``eval_file``,
    ``eval_fraction``, ``data_format``, ``max_length``, ``seed``; optional ``train_split``/``eval_split``).

    Eval comes from ``eval_file``, else the ``eval_split`` of ``train_file``, else a seeded ``eval_fraction`` of
    it. The tokenized result is cached under ``cache_dir`` (None: :func:`default_cache_dir`; False: no cache) and a
    later call with the same inputs loads it; safe to call from several processes (atomic entries) -- call it
    under ``accelerator.main_process_first()`` so only one tokenizes.
    """
    train_src, eval_src = _sources(cfg)
    if cache_dir is False:
        return _tokenize(cfg, tokenizer, train_src, eval_src)
    root = Path(cache_dir) if cache_dir not in (None, True) else default_cache_dir()
    path = root / tokenized_cache_key(cfg, tokenizer, train_src, eval_src)
    if path.is_dir():
        import datasets

        try:
            dd = datasets.load_from_disk(str(path))
            tr = dataset_to_examples(dd["train"])
            ev = dataset_to_examples(dd["eval"]) if "eval" in dd else []
            log.info("tokenized data: cache hit %s (%d train, %d eval examples)", path, len(tr), len(ev))
            return tr, ev
        except Exception as e:  # noqa: BLE001 - a broken entry is rebuilt
            log.warning("tokenized data: cache entry %s unreadable (%s); tokenizing again", path, e)
            shutil.rmtree(path, ignore_errors=True)
    tr, ev = _tokenize(cfg, tokenizer, train_src, eval_src)
    try:
        _save_atomic(path, tr, ev)
        log.info("tokenized data: cached %s (%d train, %d eval examples)", path, len(tr), len(ev))
    except OSError as e:
        log.warning("tokenized data: could not write the cache %s (%s)", path, e)
    return tr, ev


# ---------------------------------------------------------------------------------------------------- batching
def _features_of(e) -> dict:
    if isinstance(e, Example):
        return {"input_ids": e.input_ids, "labels": e.labels}
    return {"input_ids": list(e["input_ids"]), "labels": list(e["labels"])}


def collate(examples: list, pad_id: int, pad_multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, labels (-100 on padding), its length the longest example's
    rounded up to ``pad_multiple``. Takes Examples or mappings with input_ids and labels (rows of
    :func:`examples_to_dataset`)."""
    from .engine.packing import long_tensor, round_up

    feats = [_features_of(e) for e in examples]
    n = round_up(max(len(f["input_ids"]) for f in feats), pad_multiple)
    ids = torch.full((len(feats), n), pad_id, dtype=torch.long)
    labels = torch.full((len(feats), n), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(feats), n), dtype=torch.long)
    for i, f in enumerate(feats):
        L = len(f["input_ids"])
        ids[i, :L] = long_tensor(f["input_ids"])
        labels[i, :L] = long_tensor(f["labels"])
        mask[i, :L] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pack_rows(examples: list, pad_id: int, row_tokens: int | None = None, pad_multiple: int = 1
              ) -> dict[str, torch.Tensor]:
    """Padding-free batch: the examples packed first-fit decreasing into rows of at most ``max(longest example,
    row_tokens)`` tokens (``None``: all in one row), each row right-padded to the longest row rounded up to
    ``pad_multiple``. Per token:
    ``position_ids`` restarting at 0 with each example (the padding tail is a segment of its own), ``labels`` ours
    except each example's first token (-100: it would be predicted from the previous example's last token), and
    ``attention_mask`` 1 on example tokens, 0 on the tail. The mask only counts tokens (the Trainer's
    ``non_padding`` count): the model must run without it, so that transformers derives the block-causal mask from
    the position ids (:meth:`BDLoraTrainer.compute_loss` drops it). Also the examples' cumulative lengths and the
    longest (:func:`~bdlora.train.attention.packed_sequence_kwargs`), for attention that reads them."""
    from .attention import packed_sequence_kwargs
    from .engine.packing import fill_rows, long_tensor, round_up

    feats = [_features_of(e) for e in examples]
    lengths = [len(f["input_ids"]) for f in feats]
    cap = sum(lengths) if row_tokens is None else max(max(lengths), row_tokens)
    rows = fill_rows(lengths, cap)
    width = round_up(max(sum(lengths[i] for i in r) for r in rows), pad_multiple)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, members in enumerate(rows):
        t = 0
        for i in members:
            n = lengths[i]
            ids[r, t:t + n] = long_tensor(feats[i]["input_ids"])
            labels[r, t + 1:t + n] = long_tensor(feats[i]["labels"][1:])
            positions[r, t:t + n] = torch.arange(n)
            mask[r, t:t + n] = 1
            t += n
        positions[r, t:] = torch.arange(width - t)
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "attention_mask": mask,
            **packed_sequence_kwargs(positions)}


class Collator:
    """A picklable batch function (DataLoader workers): padded, or padding-free (:func:`pack_rows`) batches."""

    def __init__(self, pad_id: int, padding_free: bool = False, row_tokens: int | None = None,
                 pad_multiple: int = 1):
        self.pad_id, self.padding_free, self.row_tokens = pad_id, padding_free, row_tokens
        self.pad_multiple = pad_multiple

    def __call__(self, examples: list) -> dict[str, torch.Tensor]:
        if not self.padding_free:
            return collate(examples, self.pad_id, self.pad_multiple)
        return pack_rows(examples, self.pad_id, self.row_tokens, self.pad_multiple)


def make_collator(pad_id: int, padding_free: bool = False, row_tokens: int | None = None, pad_multiple: int = 1
                  ) -> Collator:
    """Batches of Examples (or dataset rows): right-padded ``{input_ids, attention_mask, labels}`` (B, T), or with
    ``padding_free`` rows of packed examples (:func:`pack_rows`: rows of at most ``max(longest, row_tokens)``
    tokens, ``None`` one row) for attention that reads the example boundaries from ``position_ids``: transformers'
    sdpa / eager / flex build a block-causal mask from them in every row, flash-attention only in a single row (give
    it ``row_tokens=None``). The forward must drop the batch's ``attention_mask`` (it only counts tokens) and run
    without a KV cache (``model.config.use_cache = False``): otherwise the examples silently attend to each other
    (transformers 5.19). ``pad_multiple``: the batch's length rounded up to a multiple of it (masked padding)."""
    return Collator(pad_id, padding_free, row_tokens, pad_multiple)


class DataStream:
    """The deterministic example order of a run (module docstring): position -> training-set index."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._epoch, self._perm = -1, None

    def _perm_of(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        return self._perm

    def at(self, position: int) -> int:
        return self._perm_of(position // self.n)[position % self.n]

    def micro_batch(self, step: int, micro: int, batch_size: int, grad_accum: int, world: int, rank: int
                    ) -> list[int]:
        g = batch_size * grad_accum * world
        start = step * g + (micro * world + rank) * batch_size
        return [self.at(p) for p in range(start, start + batch_size)]


__all__ = ["DATA_FORMATS", "Collator", "DataError", "DataStream", "Example", "IGNORE_INDEX", "Parsed", "Source",
           "canonical_format", "collate", "dataset_to_examples", "default_cache_dir", "detect_format", "encode",
           "encode_record", "encode_records", "encode_text", "examples_to_dataset", "load_datasets", "make_collator",
           "pack_rows", "parse_record", "parse_source", "prompt_text", "read_records", "resolve_source",
           "response_spans", "split_indices", "to_messages", "tokenized_cache_key", "tokenized_cache_path",
           "tokenizer_fingerprint"]
