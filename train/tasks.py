"""Small synthetic instruction tasks, generated deterministically from a seed (quickstart, tests, examples).

``color_code``: a made-up code book maps eight colors to invented code words; the prompt mentions an object of some
color in one of many phrasings and asks for the code, and the answer must be exactly ``CODE: <word>``. A base
model cannot know the code book (it scores 0%), the answer is checkable by exact match, and a 135M model learns the
eight associations plus the format in a few dozen steps. Held-out examples use phrasings and objects never seen in
training (the colors are necessarily shared: the code book is arbitrary).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Iterable

CODE_BOOK = {
    "red": "zorvik", "blue": "melquar", "green": "tasbeno", "yellow": "frindle",
    "purple": "okkumo", "orange": "plivvet", "black": "dranoth", "white": "sulvane",
}

_TRAIN_OBJECTS = ["car", "hat", "door", "cup", "kite", "shirt", "bike", "lamp", "boat", "chair", "scarf", "ball",
                  "bottle", "fence", "pillow", "umbrella"]
_EVAL_OBJECTS = ["balloon", "jacket", "mug", "tent", "sofa", "backpack", "bucket", "curtain"]

_TRAIN_TEMPLATES = [
    "My {obj} is {color}. What is the secret code for its color?",
    "The {obj} is painted {color}. Give me the color code.",
    "Look at this {color} {obj}. Which code word belongs to its color?",
    "I bought a {color} {obj}. Tell me the code of that color.",
    "What code word does the color of a {color} {obj} map to?",
    "A {obj} in {color}: what's the code?",
    "Color code lookup for a {color} {obj}, please.",
    "Someone handed me a {color} {obj}. What is the code for the color?",
]
_EVAL_TEMPLATES = [
    "Here is a {color} {obj}. Reply with the code for its color.",
    "Which secret code matches the color of my {color} {obj}?",
    "The color of the {obj} is {color}. What is its code word?",
    "Code for the color of a {color} {obj}?",
]


def color_code_answer(color: str) -> str:
    return f"CODE: {CODE_BOOK[color]}"


def color_code_task(n: int, seed: int = 0, split: str = "train") -> list[dict]:
    """``n`` alpaca records (``instruction``, ``output``, plus ``color`` for scoring) of the given split."""
    if split not in ("train", "eval"):
        raise ValueError("split must be 'train' or 'eval'")
    rng = random.Random(f"color_code/{split}/{seed}")
    objects = _TRAIN_OBJECTS if split == "train" else _EVAL_OBJECTS
    templates = _TRAIN_TEMPLATES if split == "train" else _EVAL_TEMPLATES
    colors = sorted(CODE_BOOK)
    out = []
    for i in range(n):
        color = colors[i % len(colors)] if i < len(colors) else rng.choice(colors)
        rec = {"instruction": rng.choice(templates).format(obj=rng.choice(objects), color=color),
               "input": "", "output": color_code_answer(color), "color": color}
        out.append(rec)
    rng.shuffle(out)
    return out


def write_jsonl(records: Iterable[dict], path: str | os.PathLike) -> Path:
    """Writes records as JSONL (atomically: a temp file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def toy_chat_records(n: int, seed: int = 0) -> list[dict]:
    """Mixed alpaca/chat records over short word lists (copy / reverse), for tests and smoke runs."""
    rng = random.Random(f"toy/{seed}")
    words = ["red", "blue", "green", "cat", "dog", "bird", "fish", "tree", "house", "river", "moon", "sun", "star"]
    out = []
    for i in range(n):
        w = [rng.choice(words) for _ in range(rng.randint(2, 4))]
        if i % 2:
            out.append({"instruction": "Reverse the words.", "input": " ".join(w), "output": " ".join(w[::-1])})
        else:
            out.append({"messages": [{"role": "user", "content": "Copy: " + " ".join(w)},
                                     {"role": "assistant", "content": " ".join(w)}]})
    return out


__all__ = ["CODE_BOOK", "color_code_answer", "color_code_task", "toy_chat_records", "write_jsonl"]
