"""The pure-Python path for whole outputs (`HarmonyOutputParser.parse_complete`, taken by `parse_chunk` for a
non-stream engine reply) is identical to feeding the same tokens through openai-harmony's StreamableParser:
same messages (kind, channel, recipient, text, terminator, token counts), same counts, same events once
consecutive deltas of one message are merged, and the same UpstreamBadOutput when the output is not Harmony.
Outputs are generated in the canonical shape the fast path accepts and perturbed out of it."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import Message, Role

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.errors import UpstreamBadOutput
from harmony_gateway.harmony import token_parser as tp
from harmony_gateway.harmony.encoding import CALL, END, RETURN, get_encoding
from harmony_gateway.pipeline.parse_output import feed_chunk, parse_chunk

from .test_token_parser import SPECIAL_IDS, ids, ordinary, outputs, render_output, texts

_props = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

multibyte = st.sampled_from(["你好", "🌍🚀", "naïve café", "漢字テスト", "é", " ✓"])
bodies = st.lists(st.one_of(texts, multibyte), max_size=4).map("".join)


@st.composite
def canonical_messages(draw: st.DrawFn) -> Message:
    channel = draw(st.sampled_from(["analysis", "commentary", "final"]))
    return Message.from_role_and_content(Role.ASSISTANT, draw(bodies)).with_channel(channel)


canonical_outputs = st.lists(canonical_messages(), min_size=1, max_size=5).map(render_output)
stop_tokens = st.sampled_from([None, RETURN, CALL, END])


def summarize(
    parser: tp.HarmonyOutputParser, events: list[tp.Event]
) -> tuple[list[Any], list[Any], tuple[Any, ...]]:
    merged: list[Any] = []
    for etype, msg, text in events:
        if etype == tp.DELTA and merged and merged[-1][0] == tp.DELTA and merged[-1][1] is msg:
            merged[-1] = (tp.DELTA, msg, merged[-1][2] + text)
        else:
            merged.append((etype, msg, text))
    index = {id(m): i for i, m in enumerate(parser.messages)}
    flat = [(etype, index.get(id(msg)), text) for etype, msg, text in merged]
    return (flat, *parser_state(parser))


def parser_state(parser: tp.HarmonyOutputParser) -> tuple[list[Any], tuple[Any, ...]]:
    """Everything a parser exposes after parsing: its messages and its counters."""
    messages = [
        (m.kind, m.channel, m.recipient, m.name, m.content_type, m.text, m.terminated, m.terminator)
        + (m.call_index, m.tokens)
        for m in parser.messages
    ]
    counts = (
        parser.calls,
        parser.reasoning_tokens,
        parser.output_tokens,
        parser.ignored_tokens,
        parser.halted,
        parser.parse_error,
        parser.open_message is None,
        parser.in_message,
    )
    return messages, counts


def run(tokens: list[int], stop: int | None, *, fast: bool) -> Any:
    parser = tp.HarmonyOutputParser(get_encoding(), frozenset(["f"]))
    chunk = EngineChunk(token_ids=list(tokens), finished=True, finish_reason="stop", matched_stop_token=stop)
    try:
        events = parse_chunk(parser, chunk) if fast else feed_chunk(parser, chunk)
    except UpstreamBadOutput as exc:
        return ("error", str(exc))
    return summarize(parser, events)


def assert_same(tokens: list[int], stop: int | None) -> None:
    assert run(tokens, stop, fast=True) == run(tokens, stop, fast=False)


@_props
@given(tokens=canonical_outputs, data=st.data())
def test_canonical_outputs_take_the_fast_path_and_parse_identically(
    tokens: list[int], data: st.DataObject
) -> None:
    end = data.draw(st.integers(0, len(tokens)), label="end")  # cut by length anywhere
    stop = data.draw(stop_tokens, label="stop")  # the engine's matched stop token, maybe stripped
    tokens = tokens[:end]
    assert_same(tokens, stop)
    if tokens and tokens[-1] in (END, RETURN):
        parser = tp.HarmonyOutputParser(get_encoding())
        assert parser.parse_complete(tokens, stop) is not None  # the fast path was taken


@_props
@given(tokens=canonical_outputs, data=st.data())
def test_perturbed_outputs_parse_identically(tokens: list[int], data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(tokens)), label="at")
        edit = data.draw(st.sampled_from(["special", "ordinary", "delete", "split word"]), label="edit")
        if edit == "special":
            tokens.insert(at, data.draw(st.sampled_from(SPECIAL_IDS), label="special"))
        elif edit == "ordinary":
            tokens.insert(at, data.draw(st.integers(0, 199997), label="ordinary"))
        elif edit == "delete" and at < len(tokens):
            del tokens[at]
        else:  # a header word written with other tokens: same text, other ids
            word = data.draw(st.sampled_from(["assistant", "analysis", "final", "commentary"]), label="w")
            tokens[at:at] = ordinary(word[:2]) + ordinary(word[2:])
    assert_same(tokens, data.draw(stop_tokens, label="stop"))


@_props
@given(tokens=outputs, stop=stop_tokens)
def test_outputs_with_calls_and_recipients_parse_identically(tokens: list[int], stop: int | None) -> None:
    assert_same(tokens, stop)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.sampled_from(SPECIAL_IDS),
            st.integers(0, 199997),
            st.sampled_from(ids("analysis final assistant")),
        ),
        max_size=40,
    ),
    stop=stop_tokens,
)
def test_arbitrary_tokens_parse_identically(tokens: list[int], stop: int | None) -> None:
    assert_same(tokens, stop)


def test_split_characters_fall_back_to_openai_harmony() -> None:
    text_ids = ordinary("🌍")
    assert len(text_ids) > 1 or get_encoding().decode_bytes(text_ids[:1]) == "🌍".encode()
    tokens = ids("<|channel|>final<|message|>") + text_ids[:-1]  # cut inside the character
    if len(text_ids) > 1:
        assert tp.HarmonyOutputParser(get_encoding()).parse_complete(tokens, None) is None
    assert_same(tokens, None)
    assert_same(tokens, RETURN)
