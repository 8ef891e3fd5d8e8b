"""`HarmonyOutputParser` is linear in its output: a degenerate run of control tokens (20,000 `<|start|>` took
8.7 s on openai-harmony's parser, 65k took 150 s) costs a bounded amount of work per token, a header longer
than `MAX_HEADER_TOKENS` is a counted recovery, and on any token sequence the parser gives exactly the events,
messages, counts and errors it gives on top of openai-harmony's own `StreamableParser` (the reference)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyEncoding, Role, StreamableParser

from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.errors import UpstreamBadOutput
from harmony_gateway.harmony import stream_parser
from harmony_gateway.harmony import token_parser as tp
from harmony_gateway.harmony.encoding import CALL, END, RETURN, START, get_encoding
from harmony_gateway.pipeline.parse_output import CONTENT, ChoiceOutput

from .test_stream_parser import CONTROL, sequences
from .test_token_parser import ids, ordinary, summary
from .test_token_parser_stream_fast_path import split

_props = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
UNCAPPED = 10**9


class _ReferenceMessage:
    def __init__(self, message: Any) -> None:
        self.text = "".join(getattr(part, "text", "") for part in message.content)


class ReferenceStreamParser:
    """openai-harmony's StreamableParser with the few attributes HarmonyOutputParser reads."""

    def __init__(self, encoding: HarmonyEncoding, role: Role | None) -> None:
        self._inner = StreamableParser(encoding, role, strict=False)
        self.process = self._inner.process
        self.process_eos = self._inner.process_eos

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def messages(self) -> list[_ReferenceMessage]:
        return [_ReferenceMessage(m) for m in self._inner.messages]


class ReferenceOutputParser(tp.HarmonyOutputParser):
    stream_parser = ReferenceStreamParser  # type: ignore[assignment]


def trace(parser: tp.HarmonyOutputParser, chunks: list[list[int]]) -> list[Any]:
    events: list[tp.Event] = []
    outcome: Any = None
    try:
        for chunk in chunks:
            events += parser.feed(chunk)
        events += parser.finish()
    except UpstreamBadOutput as exc:
        outcome = str(exc)
    return [summary(parser, events), outcome, parser.recoveries, parser.parse_error, parser.unexpected_order]


def parse_both(chunks: list[list[int]], max_header_tokens: int = UNCAPPED) -> tuple[list[Any], list[Any]]:
    encoding = get_encoding()
    args = (encoding, frozenset(["f"]), frozenset(["browser"]))
    linear = tp.HarmonyOutputParser(*args, max_header_tokens=max_header_tokens)
    reference = ReferenceOutputParser(*args, max_header_tokens=max_header_tokens)
    return trace(linear, chunks), trace(reference, chunks)


@_props
@given(tokens=sequences, data=st.data())
def test_same_as_on_openai_harmony_for_any_tokens(tokens: list[int], data: st.DataObject) -> None:
    linear, reference = parse_both(split(tokens, data))
    assert linear == reference


@_props
@given(tokens=sequences, data=st.data())
def test_same_as_on_openai_harmony_with_the_header_cap(tokens: list[int], data: st.DataObject) -> None:
    """The cap is applied by HarmonyOutputParser itself: over either parser, the same recoveries."""
    linear, reference = parse_both(split(tokens, data), max_header_tokens=data.draw(st.integers(1, 40)))
    assert linear == reference


@pytest.fixture
def header_work(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts header tokens decoded (StreamParser) and header or message tokens serialised by reading
    openai-harmony's `StreamableParser.state`: the work that grew with the header before."""
    work = [0]
    decode_header = stream_parser.StreamParser._decode_header
    state_data = StreamableParser.state_data

    def counted_decode(self: stream_parser.StreamParser) -> str:
        work[0] += len(self._header_tokens)
        return decode_header(self)

    def counted_state(self: StreamableParser) -> dict[str, Any]:
        data: dict[str, Any] = state_data.fget(self)  # type: ignore[attr-defined]
        work[0] += len(data.get("header_tokens", ())) + len(data.get("content_tokens", ()))
        return data

    monkeypatch.setattr(stream_parser.StreamParser, "_decode_header", counted_decode)
    monkeypatch.setattr(StreamableParser, "state_data", property(counted_state))
    return work


@pytest.mark.parametrize(
    "unit", [[START], *[[t] for t in CONTROL], ids("<|start|><|channel|><|constrain|>a")]
)
def test_work_per_token_is_bounded(unit: list[int], header_work: list[int]) -> None:
    """Deterministic cost: within a constant per token fed; openai-harmony's read of its state after every
    control token made it n²/2 for a run of `<|start|>`."""
    for n in (2_000, 8_000):
        header_work[0] = 0
        tokens = (unit * n)[:n] + ids("<|start|>assistant<|channel|>final<|message|>ok<|return|>")
        parser = tp.HarmonyOutputParser(get_encoding())
        parser.feed(tokens)
        parser.finish()
        if unit[0] not in (RETURN, CALL):  # those end the reply: what follows is ignored
            assert parser.messages[-1].text == "ok"
        assert header_work[0] <= 2 * len(tokens)


@pytest.mark.parametrize("chunk_size", [1, 16, None])
def test_a_degenerate_engine_stream_costs_linear_work(chunk_size: int | None, header_work: list[int]) -> None:
    """The engine path (`ChoiceOutput.feed`, streamed or whole): a model stuck writing `<|start|>` 65,536
    times, then answering, gives the answer at bounded work per token."""
    tokens = [START] * 65_536 + ids("<|start|>assistant<|channel|>final<|message|>ok<|return|>")
    size = chunk_size or len(tokens)
    state = SimpleNamespace(encoding=get_encoding())
    prepared = SimpleNamespace(function_names=frozenset(), tool_namespaces=frozenset(), stop_strings=())
    choice = ChoiceOutput(state, prepared, 0)  # type: ignore[arg-type]
    deltas = []
    for at in range(0, len(tokens), size):
        last = at + size >= len(tokens)
        chunk = tokens[at : at + size]
        deltas += choice.feed(EngineChunk(0, chunk, 0, 0, 0, None, last, "stop" if last else None))
    assert deltas == [(CONTENT, "ok")]
    assert choice.parser.recoveries == {tp.RECOVERED_LONG_HEADER: 65_536 // tp.MAX_HEADER_TOKENS}
    assert header_work[0] <= 2 * len(tokens)


def test_a_run_of_start_tokens_is_skipped_in_bounded_headers() -> None:
    """The finding: 20,000 `<|start|>`. Each 256 make a header too long, dropped and counted."""
    parser = tp.HarmonyOutputParser(get_encoding())
    parser.feed([START] * 20_000)
    with pytest.raises(UpstreamBadOutput):
        parser.finish()  # nothing usable: not Harmony
    assert parser.recoveries[tp.RECOVERED_LONG_HEADER] == 20_000 // tp.MAX_HEADER_TOKENS
    assert parser.messages == []


@pytest.mark.parametrize("field", ["recipient", "channel", "content_type"])
def test_an_overlong_header_field_is_a_recovery(field: str) -> None:
    long_word = ordinary("a" * 4000)
    assert len(long_word) > tp.MAX_HEADER_TOKENS
    header = {
        "recipient": ids("<|channel|>commentary to=functions.") + long_word + ids(" <|constrain|>json"),
        "channel": ids("<|channel|>") + long_word,
        "content_type": ids("<|channel|>commentary to=functions.f <|constrain|>") + long_word,
    }[field]
    tokens = header + ids("<|message|>{}<|call|><|start|>assistant<|channel|>final<|message|>ok<|return|>")
    parser = tp.HarmonyOutputParser(get_encoding(), frozenset(["f"]))
    for cut in range(0, len(tokens), 7):
        parser.feed(tokens[cut : cut + 7])
    parser.finish()
    assert [(m.kind, m.text) for m in parser.messages] == [(tp.ANSWER, "ok")]
    assert parser.recoveries == {tp.RECOVERED_LONG_HEADER: 1}
    assert parser.calls == 0


@pytest.mark.parametrize("field", ["recipient", "channel", "content_type"])
def test_a_header_field_of_too_many_characters_is_a_recovery(field: str) -> None:
    """Few tokens can spell many characters: fields are capped in characters too."""
    word = "a" * (tp.MAX_HEADER_FIELD_CHARS + 1)
    header = {
        "recipient": f"<|channel|>commentary to=functions.{word} <|constrain|>json",
        "channel": f"<|channel|>{word}",
        "content_type": f"<|channel|>commentary to=functions.f <|constrain|>{word}",
    }[field]
    tail = "<|start|>assistant<|channel|>final<|message|>ok<|return|>"
    for end in ("<|message|>{}<|call|>", "<|end|>"):
        parser = tp.HarmonyOutputParser(get_encoding(), frozenset(["f"]))
        parser.feed(ids(header + end + tail))
        parser.finish()
        assert [(m.kind, m.text) for m in parser.messages] == [(tp.ANSWER, "ok")]
        assert parser.recoveries == {tp.RECOVERED_LONG_HEADER: 1}


def test_headers_up_to_the_cap_parse() -> None:
    recipient = "functions." + "x" * 60
    tokens = ids(f"<|channel|>commentary to={recipient} <|constrain|>json<|message|>{{}}<|call|>")
    parser = tp.HarmonyOutputParser(get_encoding())
    parser.feed(tokens)
    parser.finish()
    [call] = parser.messages
    assert (call.kind, call.recipient, call.terminator) == (tp.FUNCTION_CALL, recipient, CALL)
    assert not parser.recoveries


def test_stop_tokens_still_end_a_header_at_the_cap() -> None:
    """A header of exactly MAX_HEADER_TOKENS is still read (a refusal's text after its channel, harmony#80)."""
    prefix = ids("<|channel|>final")
    [word] = ordinary(" b")
    tokens = prefix + [word] * (tp.MAX_HEADER_TOKENS - len(prefix))
    for stop in (END, RETURN):
        parser = tp.HarmonyOutputParser(get_encoding())
        parser.feed(tokens + [stop])
        parser.finish()
        assert not parser.recoveries
        assert parser.messages[0].text.startswith("b b")
        parser = tp.HarmonyOutputParser(get_encoding())
        parser.feed(tokens + [word, stop])
        with pytest.raises(UpstreamBadOutput):
            parser.finish()
        assert parser.recoveries == {tp.RECOVERED_LONG_HEADER: 1}
