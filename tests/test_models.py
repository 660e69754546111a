"""The offline SmolLM2 shortcut: converted from the packaged GGUF with HuggingFaceTB's special tokens whatever the
transformers release reads from the GGUF (a chat turn ends on <|im_end|>), and a cached conversion with other
tokens converted again."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_smollm2_ends_turns_on_im_end_and_fixes_a_bad_cache(tmp_path):
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from bdlora.models import SMOLLM2_SPECIAL, smollm2_path

    folder = smollm2_path(tmp_path)
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert (tok.eos_token, tok.eos_token_id) == SMOLLM2_SPECIAL["eos"] == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.pad_token_id) == ("<|im_start|>", 2)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    # a conversion by a transformers release that took <|im_start|> as the end token is made again
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "eos_token": "<|im_start|>"}))
    again = smollm2_path(tmp_path)
    assert json.loads((again / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
