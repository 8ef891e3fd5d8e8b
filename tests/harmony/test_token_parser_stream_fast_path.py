"""The pure-Python streaming path of `HarmonyOutputParser.feed` (canonical output parsed token by token, falling
back to openai-harmony's StreamableParser, replaying the tokens seen so far, at the first token it does not
handle) is identical to feeding every token through StreamableParser: the same events per `feed` call (not
merged), the same messages, counts and errors, and the same chat deltas, for any chunking of generated,
perturbed and arbitrary token sequences, including tokens that split or break UTF-8 characters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.errors import UpstreamBadOutput
from harmony_gateway.harmony import token_parser as tp
from harmony_gateway.harmony.encoding import ASSISTANT_STOP_IDS, CALL, END, RETURN, get_encoding
from harmony_gateway.pipeline.parse_output import TOOL_OPEN, ChoiceOutput

from .test_token_parser import SPECIAL_IDS, ids, ordinary, outputs
from .test_token_parser_fast_path import canonical_outputs, parser_state, stop_tokens

_props = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _broken_utf8_tokens() -> list[int]:
    """Ordinary tokens whose bytes are not whole UTF-8 characters (lead bytes, continuation bytes, splits)."""
    found = []
    token_bytes = tp._token_bytes()
    for rank in range(199998):
        try:
            token_bytes(rank).decode("utf-8")
        except UnicodeDecodeError:
            found.append(rank)
            if len(found) >= 200:
                break
    return found


BROKEN_UTF8 = _broken_utf8_tokens()
token_items = st.one_of(
    st.sampled_from(SPECIAL_IDS),
    st.integers(0, 199997),
    st.sampled_from(ids("analysis final commentary assistant")),
    st.sampled_from(BROKEN_UTF8),
    st.sampled_from(ordinary("🌍 漢字 é ✓")),
)


AFTER_FINISH = ids("<|start|>assistant<|channel|>final<|message|>more<|end|>")


def _slow(parser: tp.HarmonyOutputParser) -> tp.HarmonyOutputParser:
    parser._fast = False  # every token through openai-harmony's StreamableParser
    return parser


def _events(parser: tp.HarmonyOutputParser, events: list[tp.Event]) -> list[Any]:
    index = {id(m): i for i, m in enumerate(parser.messages)}
    return [(etype, index.get(id(msg)), msg.kind, text) for etype, msg, text in events]


def _state(parser: tp.HarmonyOutputParser) -> tuple[Any, ...]:
    messages, counts = parser_state(parser)
    return messages, (*counts, parser.fresh)


def run_parser(chunks: list[list[int]], stop: int | None, *, fast: bool) -> list[Any]:
    """Feed the chunks, then close as `feed_chunk` does; record every call's events and the state after it."""
    parser = tp.HarmonyOutputParser(get_encoding(), frozenset(["f"]), frozenset(["browser"]))
    if not fast:
        _slow(parser)
    trace: list[Any] = []
    try:
        for chunk in chunks:
            trace.append(_events(parser, parser.feed(chunk)))
            trace.append(_state(parser))
        if stop in ASSISTANT_STOP_IDS and not parser.halted and parser.in_message:
            trace.append(_events(parser, parser.feed([stop])))
        trace.append(_events(parser, parser.finish()))
        trace.append(_state(parser))
        trace.append(_events(parser, parser.finish()))  # a second finish is harmless either way
        trace.append(_events(parser, parser.feed(AFTER_FINISH)))  # nothing feeds after finish, but alike
        trace.append(_state(parser))
    except UpstreamBadOutput as exc:
        trace.append(("error", str(exc), _state(parser)))
    return trace


def run_choice(chunks: list[list[int]], stop: int | None, *, fast: bool) -> list[Any]:
    """The same through `ChoiceOutput.feed` (engine chunks → chat deltas), with a client stop string."""
    state = SimpleNamespace(encoding=get_encoding())
    prepared = SimpleNamespace(
        function_names=frozenset(["f"]), tool_namespaces=frozenset(["browser"]), stop_strings=("e.",)
    )
    choice = ChoiceOutput(state, prepared, 0)  # type: ignore[arg-type]
    if not fast:
        _slow(choice.parser)
    trace: list[Any] = []
    try:
        for i, tokens in enumerate(chunks):
            last = i == len(chunks) - 1
            chunk = EngineChunk(
                0, list(tokens), 0, 0, 0, None, last, "stop" if last else None, stop if last else None
            )
            deltas = choice.feed(chunk)
            trace.append([d[:2] + d[3:] if d[0] == TOOL_OPEN else d for d in deltas])  # call ids are random
        trace.append(choice.close())
    except UpstreamBadOutput as exc:
        trace.append(("error", str(exc)))
    trace.append((choice.finish_reason, choice.stop_hit, _state(choice.parser)))
    return trace


def split(tokens: list[int], data: st.DataObject) -> list[list[int]]:
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(tokens)), max_size=6), label="cuts")))
    if data.draw(st.booleans(), label="per token"):
        return [[t] for t in tokens]
    chunks, at = [], 0
    for cut in [*cuts, len(tokens)]:
        chunks.append(tokens[at:cut])
        at = cut
    return chunks


def assert_same(tokens: list[int], data: st.DataObject) -> None:
    chunks = split(tokens, data)
    stop = data.draw(stop_tokens, label="stop")
    assert run_parser(chunks, stop, fast=True) == run_parser(chunks, stop, fast=False)
    assert run_choice(chunks, stop, fast=True) == run_choice(chunks, stop, fast=False)


@_props
@given(tokens=canonical_outputs, data=st.data())
def test_canonical_streams_parse_identically(tokens: list[int], data: st.DataObject) -> None:
    tokens = tokens[: data.draw(st.integers(0, len(tokens)), label="end")]  # cut by length anywhere
    assert_same(tokens, data)


def test_canonical_streams_stay_on_the_fast_path() -> None:
    tokens = ids("<|channel|>analysis<|message|>Think 🌍.<|end|><|start|>assistant<|channel|>final")
    tokens += ids("<|message|>漢字 é<|return|>")
    parser = tp.HarmonyOutputParser(get_encoding())
    for token in tokens:
        parser.feed([token])
    parser.finish()
    assert parser._fast and parser._streamable is None  # openai-harmony's parser was never built
    assert [m.text for m in parser.messages] == ["Think 🌍.", "漢字 é"]


@_props
@given(tokens=canonical_outputs, data=st.data())
def test_perturbed_streams_parse_identically(tokens: list[int], data: st.DataObject) -> None:
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        at = data.draw(st.integers(0, len(tokens)), label="at")
        edit = data.draw(st.sampled_from(["token", "delete", "split word", "utf8"]), label="edit")
        if edit == "token":
            tokens.insert(at, data.draw(token_items, label="token"))
        elif edit == "delete" and at < len(tokens):
            del tokens[at]
        elif edit == "utf8":
            tokens.insert(at, data.draw(st.sampled_from(BROKEN_UTF8), label="broken"))
        else:  # a header word written with other tokens: same text, other ids
            word = data.draw(st.sampled_from(["assistant", "analysis", "final", "commentary"]), label="w")
            tokens[at:at] = ordinary(word[:2]) + ordinary(word[2:])
    assert_same(tokens, data)


@_props
@given(tokens=outputs, data=st.data())
def test_streams_with_calls_and_recipients_parse_identically(tokens: list[int], data: st.DataObject) -> None:
    assert_same(tokens, data)


@_props
@given(tokens=st.lists(token_items, max_size=40), data=st.data())
def test_arbitrary_token_streams_parse_identically(tokens: list[int], data: st.DataObject) -> None:
    assert_same(tokens, data)


def test_split_and_invalid_characters_parse_identically() -> None:
    head = ids("<|channel|>final<|message|>")
    for body in (ordinary("🌍")[:-1], [BROKEN_UTF8[0]], ordinary("a") + BROKEN_UTF8[:3] + ordinary("b")):
        for tail in ([], [END], [RETURN], [CALL]):
            tokens = head + body + tail
            for chunks in ([tokens], [[t] for t in tokens]):
                for stop in (None, RETURN):
                    assert run_parser(chunks, stop, fast=True) == run_parser(chunks, stop, fast=False)
