"""The incremental detokenizer never splits a UTF-8 character, for any split of the ids into chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from harmony_gateway.pipeline.detokenize import IncrementalDetokenizer
from tests.support.tiny_tokenizer import train_tokenizer

TOKENIZER = train_tokenizer()
TEXTS = st.text(alphabet=st.sampled_from(list("ab cdé你好世界🌍🚀<think>\n")), min_size=0, max_size=40)


def _run(tokenizer: Tokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    deltas, start = [], 0
    for cut in sorted(set(c % (len(ids) + 1) for c in cuts)) + [len(ids)]:
        deltas.append(detok.push(ids[start:cut]))
        start = max(start, cut)
    deltas.append(detok.flush())
    return deltas


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_any_chunking_gives_the_whole_text_without_split_characters(text: str, cuts: list[int]) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    deltas = _run(TOKENIZER, ids, cuts)
    assert "".join(deltas) == TOKENIZER.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_multibyte_character_is_held_until_complete() -> None:
    ids = TOKENIZER.encode("你", add_special_tokens=False).ids
    assert len(ids) > 1  # the test tokenizer splits CJK into byte tokens
    detok = IncrementalDetokenizer(TOKENIZER)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "你"


def test_flush_releases_an_invalid_tail() -> None:
    ids = TOKENIZER.encode("你", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped(tmp_path: Path) -> None:
    end = TOKENIZER.token_to_id("<|im_end|>")
    ids = TOKENIZER.encode("one two", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.push(ids) + detok.push([end]) + detok.flush() == "one two"


@pytest.mark.parametrize("text", ["x" * 500, "你好" * 100])
def test_long_outputs_keep_a_short_window(text: str) -> None:
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(TOKENIZER)
    out = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert out == text
    assert len(detok._ids) < 80
