"""Text-level output parsers: Harmony text (literal and stripped tokens), think tags, marker, fallbacks."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmony_gateway.harmony.text_events import (
    ContentDelta,
    ReasoningDelta,
    Terminated,
    TextEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from harmony_gateway.harmony.text_parser import (
    MARKERS,
    MISSING_CHANNEL,
    UNKNOWN_CHANNEL,
    HarmonyTextParser,
    MarkerParser,
    ParserState,
    PassThroughParser,
    TextOutputParser,
    ThinkTagParser,
    create_text_parser,
)

KINDS = ("harmony", "think", "marker", "passthrough")


def feed_all(parser: TextOutputParser, chunks: list[str]) -> list[TextEvent]:
    events: list[TextEvent] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    return events


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def parse(
    text: str, kind: str = "harmony", chunk_size: int | None = None, **options: object
) -> list[TextEvent]:
    parser = create_text_parser(kind, **options)
    if chunk_size is None:
        return feed_all(parser, [text])
    return feed_all(parser, [text[i : i + chunk_size] for i in range(0, len(text), chunk_size)])


def coalesce(events: list[TextEvent]) -> list[TextEvent]:
    """Merge adjacent deltas of the same kind (and call index): what a client accumulates."""
    out: list[TextEvent] = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + ev.text)
        elif isinstance(ev, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
        elif (
            isinstance(ev, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and last.index == ev.index
        ):
            out[-1] = ToolCallArgumentsDelta(ev.index, last.text + ev.text)
        else:
            out.append(ev)
    return out


def check_stream_shape(events: list[TextEvent]) -> None:
    """Invariants every parser's output satisfies, whatever the input."""
    assert events and events[-1] in (Terminated("return"), Terminated("call"), Terminated("eos"))
    assert sum(isinstance(e, Terminated) for e in events) == 1
    open_call: int | None = None
    next_index = 0
    for ev in events:
        if isinstance(ev, ReasoningDelta | ContentDelta | ToolCallArgumentsDelta):
            assert ev.text
        if isinstance(ev, ToolCallStart):
            assert open_call is None and ev.index == next_index and ev.name
            open_call, next_index = ev.index, next_index + 1
        elif isinstance(ev, ToolCallArgumentsDelta):
            assert ev.index == open_call
        elif isinstance(ev, ToolCallEnd):
            assert ev.index == open_call
            open_call = None
    assert open_call is None


ANALYSIS_FINAL = (
    "<|start|>assistant<|channel|>analysis<|message|>User asks capital of France. Easy.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>"
)
TOOL_CALL = (
    "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Paris"}<|call|>'
)
PREAMBLE_AND_CALL = (
    "<|channel|>analysis<|message|>Check weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Paris"}<|call|>'
)


# -- Harmony text ------------------------------------------------------------------------------------


def test_analysis_then_final() -> None:
    parser = HarmonyTextParser()
    events = feed_all(parser, [ANALYSIS_FINAL])
    assert events == [
        ReasoningDelta("User asks capital of France. Easy."),
        ContentDelta("The capital of France is Paris."),
        Terminated("return"),
    ]
    assert parser.stats.channel_messages == {"analysis": 1, "final": 1}
    assert parser.stats.reasoning_chars == len("User asks capital of France. Easy.")
    assert parser.stats.content_chars == len("The capital of France is Paris.")
    assert parser.stats.parse_errors == 0
    assert parser.mode == "harmony"
    assert parser.state is ParserState.Terminated


def test_tool_call_with_constrain_json() -> None:
    assert parse(TOOL_CALL) == [
        ReasoningDelta("Need the weather."),
        ToolCallStart(0, "get_weather"),
        ToolCallArgumentsDelta(0, '{"location":"Paris"}'),
        ToolCallEnd(0),
        Terminated("call"),
    ]


def test_preamble_then_call_starting_at_channel() -> None:
    """The prompt ended in `<|start|>assistant`, so the completion starts at `<|channel|>`."""
    assert parse(PREAMBLE_AND_CALL) == [
        ReasoningDelta("Check weather."),
        ContentDelta("Let me look that up."),
        ToolCallStart(0, "get_weather"),
        ToolCallArgumentsDelta(0, '{"location":"Paris"}'),
        ToolCallEnd(0),
        Terminated("call"),
    ]


def test_recipient_in_role_header_and_consecutive_calls() -> None:
    text = (
        "<|start|>assistant to=functions.x<|channel|>commentary json<|message|>{}<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search<|message|>{"q":"a"}<|call|>'
    )
    assert parse(text) == [
        ToolCallStart(0, "x"),
        ToolCallArgumentsDelta(0, "{}"),
        ToolCallEnd(0),
        ToolCallStart(1, "browser.search"),
        ToolCallArgumentsDelta(1, '{"q":"a"}'),
        ToolCallEnd(1),
        Terminated("call"),
    ]


def test_completion_continuing_a_channel_prompt() -> None:
    """The prompt ended in `<|channel|>`: the output starts with the channel name."""
    text = "analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    assert coalesce(parse(text, chunk_size=3)) == [
        ReasoningDelta("Think."),
        ContentDelta("Done."),
        Terminated("return"),
    ]
    call = "commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"
    assert coalesce(parse(call, chunk_size=2)) == [
        ToolCallStart(0, "f"),
        ToolCallArgumentsDelta(0, "{}"),
        ToolCallEnd(0),
        Terminated("call"),
    ]


@pytest.mark.parametrize("text", [ANALYSIS_FINAL, TOOL_CALL, PREAMBLE_AND_CALL])
def test_markers_split_at_every_position(text: str) -> None:
    expected = coalesce(parse(text))
    for i in range(len(text) + 1):
        assert coalesce(feed_all(HarmonyTextParser(), [text[:i], text[i:]])) == expected, i
    assert coalesce(parse(text, chunk_size=1)) == expected


def test_hold_back_is_released_as_soon_as_it_cannot_be_a_marker() -> None:
    parser = HarmonyTextParser()
    assert parser.feed("<|channel|>final<|message|>a<") == [ContentDelta("a")]
    assert parser.feed("b <|en") == [ContentDelta("<b ")]
    assert parser.feed("x") == [ContentDelta("<|enx")]
    assert parser.feed("<|end") == []
    assert parser.feed("|>") == []
    assert parser.state is ParserState.AwaitStart


def test_plain_content_is_emitted_in_the_same_feed() -> None:
    parser = HarmonyTextParser()
    parser.feed("<|channel|>final<|message|>")
    assert parser.feed("Hello ") == [ContentDelta("Hello ")]
    assert parser.feed("a | b > c") == [ContentDelta("a | b > c")]


def test_unknown_channel_is_reasoning_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    parser = HarmonyTextParser()
    with caplog.at_level(logging.WARNING, logger="harmony_gateway.harmony.text_parser"):
        events = feed_all(parser, ["<|channel|>thoughts<|message|>hmm<|end|>"])
    assert events == [ReasoningDelta("hmm"), Terminated("eos")]
    assert parser.stats.unknown_channels == 1
    assert parser.stats.channel_messages == {UNKNOWN_CHANNEL: 1}
    assert "thoughts" in caplog.text


def test_missing_channel_is_content() -> None:
    parser = HarmonyTextParser()
    events = feed_all(parser, ["<|start|>assistant<|message|>Hello<|end|>"])
    assert events == [ContentDelta("Hello"), Terminated("eos")]
    assert parser.stats.channel_messages == {MISSING_CHANNEL: 1}


def test_missing_end_is_flushed_by_finish() -> None:
    parser = HarmonyTextParser()
    assert parser.feed("<|channel|>final<|message|>Partial answer <") == [ContentDelta("Partial answer ")]
    assert parser.finish() == [ContentDelta("<"), Terminated("eos")]
    assert parser.finish() == []

    call = HarmonyTextParser()
    assert call.feed("<|channel|>commentary to=functions.f<|message|>{") == [
        ToolCallStart(0, "f"),
        ToolCallArgumentsDelta(0, "{"),
    ]
    assert call.finish() == [ToolCallEnd(0), Terminated("eos")]


def test_text_after_return_is_ignored_and_counted() -> None:
    parser = HarmonyTextParser()
    events = feed_all(parser, ["<|channel|>final<|message|>Hi<|return|>junk", "<|start|>more"])
    assert events == [ContentDelta("Hi"), Terminated("return")]
    assert parser.stats.trailing_ignored_chars == len("junk<|start|>more")
    assert parser.feed("after finish") == []
    assert parser.stats.trailing_ignored_chars == len("junk<|start|>more") + len("after finish")


def test_end_then_return_is_a_normal_ending() -> None:
    """vllm#50690: `<|end|><|return|>` after a complete final."""
    parser = HarmonyTextParser()
    assert feed_all(parser, ["<|channel|>final<|message|>Hi<|end|><|return|>"]) == [
        ContentDelta("Hi"),
        Terminated("return"),
    ]
    assert parser.stats.parse_errors == 0


def test_call_terminated_by_return_is_still_a_call() -> None:
    """sglang PR #10576: a recipient makes it a call whatever the terminator."""
    assert parse("<|channel|>commentary to=functions.f<|message|>{}<|return|>") == [
        ToolCallStart(0, "f"),
        ToolCallArgumentsDelta(0, "{}"),
        ToolCallEnd(0),
        Terminated("return"),
    ]


def test_refusal_without_message_marker_is_salvaged() -> None:
    """openai/harmony#80: refusals skip `<|message|>`."""
    parser = HarmonyTextParser()
    events = feed_all(
        parser, ["<|channel|>analysis<|message|>No.<|end|><|channel|>finalI can't help.<|return|>"]
    )
    assert events == [ReasoningDelta("No."), ContentDelta("I can't help."), Terminated("return")]
    assert parser.stats.parse_errors == 1


def test_overlong_header_is_salvaged_as_content() -> None:
    parser = HarmonyTextParser()
    events = coalesce(feed_all(parser, ["<|channel|>final" + "x" * 1000]))
    assert events == [ContentDelta("x" * 1000), Terminated("eos")]


def test_leaked_special_tokens_never_reach_content() -> None:
    parser = HarmonyTextParser()
    events = feed_all(
        parser, ["<|channel|>final<|message|>a<|message|>b<|constrain|>c<|channel|>final<|message|>d"]
    )
    assert coalesce(events) == [ContentDelta("abcd"), Terminated("eos")]
    assert parser.stats.parse_errors == 3


def test_hallucinated_tool_message_is_dropped() -> None:
    parser = HarmonyTextParser()
    text = (
        "<|channel|>commentary to=functions.f<|message|>{}<|end|>"
        '<|start|>functions.f to=assistant<|channel|>commentary<|message|>{"t":20}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>20 degrees<|return|>"
    )
    assert feed_all(parser, [text]) == [
        ToolCallStart(0, "f"),
        ToolCallArgumentsDelta(0, "{}"),
        ToolCallEnd(0),
        ContentDelta("20 degrees"),
        Terminated("return"),
    ]
    assert parser.stats.parse_errors == 1


def test_leaked_control_text_in_recipient_is_cut() -> None:
    events = parse("<|channel|>commentary to=<|x<|message|>{}<|call|>")
    assert events[0] == ToolCallStart(0, "__invalid_tool__")


def test_unexpected_order_is_counted() -> None:
    parser = HarmonyTextParser()
    feed_all(
        parser,
        ["<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|>"],
    )
    assert parser.stats.unexpected_order == 1


# -- stripped special tokens -------------------------------------------------------------------------


def test_stripped_form_with_final() -> None:
    text = "analysisThe user asks for the capital. assistant means me.assistantfinalThe capital is Paris."
    parser = HarmonyTextParser()
    events = coalesce(feed_all(parser, [text[i : i + 4] for i in range(0, len(text), 4)]))
    assert events == [
        ReasoningDelta("The user asks for the capital. assistant means me."),
        ContentDelta("The capital is Paris."),
        Terminated("eos"),
    ]
    assert parser.mode == "stripped"
    assert parser.stats.channel_messages == {"analysis": 1, "final": 1}


@pytest.mark.parametrize("constrain", [" json", " <|constrain|>json", "<|constrain|>json", ""])
def test_stripped_form_with_tool_call(constrain: str) -> None:
    text = f'analysisThe user wants weather.assistantcommentary to=functions.get_weather{constrain}{{"location":"Paris"}}'
    expected = [
        ReasoningDelta("The user wants weather."),
        ToolCallStart(0, "get_weather"),
        ToolCallArgumentsDelta(0, '{"location":"Paris"}'),
        ToolCallEnd(0),
        Terminated("eos"),
    ]
    assert coalesce(parse(text)) == expected
    for i in range(len(text) + 1):
        assert coalesce(feed_all(HarmonyTextParser(), [text[:i], text[i:]])) == expected, i


def test_stripped_form_starting_with_a_call() -> None:
    assert coalesce(parse('commentary to=functions.f json{"a":1}', chunk_size=3)) == [
        ToolCallStart(0, "f"),
        ToolCallArgumentsDelta(0, '{"a":1}'),
        ToolCallEnd(0),
        Terminated("eos"),
    ]


@pytest.mark.parametrize("text", ["finally, the answer is 4.", "analysis of the data shows growth", "final"])
def test_plain_text_starting_with_a_channel_name_is_not_stripped_form(text: str) -> None:
    parser = HarmonyTextParser()
    assert coalesce(feed_all(parser, [text])) == [ContentDelta(text), Terminated("eos")]
    assert parser.mode == "passthrough"


# -- fallbacks ---------------------------------------------------------------------------------------


def test_fallback_to_marker_mode() -> None:
    text = "Thinking about it... ===FINAL=== The answer is 4." + " More." * 60
    parser = HarmonyTextParser()
    events = coalesce(feed_all(parser, [text[i : i + 5] for i in range(0, len(text), 5)]))
    assert events == [
        ReasoningDelta("Thinking about it... "),
        ContentDelta(" The answer is 4." + " More." * 60),
        Terminated("eos"),
    ]
    assert parser.mode == "marker"
    assert parser.stats.marker_fallbacks == 1
    assert parser.stats.passthrough_fallbacks == 0


def test_fallback_to_passthrough_after_the_window() -> None:
    parser = HarmonyTextParser(marker_window_chars=64)
    assert parser.feed("x" * 63) == []  # still undecided
    assert parser.feed("y") == [ContentDelta("x" * 63 + "y")]
    assert parser.mode == "passthrough"
    # Never hold back in pass-through, even what looks like a marker.
    assert parser.feed("a<|chan") == [ContentDelta("a<|chan")]
    assert parser.feed("nel|>b") == [ContentDelta("nel|>b")]
    assert parser.finish() == [Terminated("eos")]
    assert parser.stats.passthrough_fallbacks == 1
    assert parser.stats.marker_fallbacks == 0


def test_harmony_marker_after_the_window_is_passed_through() -> None:
    text = "z" * 300 + "<|channel|>final<|message|>x"
    assert coalesce(parse(text)) == [ContentDelta(text), Terminated("eos")]


def test_fallback_by_time_window() -> None:
    now = [100.0]
    parser = HarmonyTextParser(marker_window_seconds=2.0, clock=lambda: now[0])
    assert parser.feed("Hello") == []
    now[0] += 2.5
    assert parser.feed(" world") == [ContentDelta("Hello world")]
    assert parser.stats.passthrough_fallbacks == 1


def test_short_plain_stream_passes_through_at_finish() -> None:
    assert parse("Hi there") == [ContentDelta("Hi there"), Terminated("eos")]


def test_leading_plain_text_before_harmony_is_content() -> None:
    parser = HarmonyTextParser()
    events = feed_all(parser, ["Note: <|start|>assistant<|channel|>final<|message|>ok<|return|>"])
    assert coalesce(events) == [ContentDelta("Note: ok"), Terminated("return")]


# -- think tags, marker, pass-through ----------------------------------------------------------------


def test_think_tags_split_at_every_position() -> None:
    text = "<think>Let me see.</think>The answer is 4."
    expected = [ReasoningDelta("Let me see."), ContentDelta("The answer is 4."), Terminated("eos")]
    for i in range(len(text) + 1):
        assert coalesce(feed_all(ThinkTagParser(), [text[:i], text[i:]])) == expected, i
    assert coalesce(parse(text, "think", chunk_size=1)) == expected


def test_think_implicit_start() -> None:
    text = "Let me see.</think>\n\nThe answer."
    assert coalesce(parse(text, "think", chunk_size=3, think_implicit_start=True)) == [
        ReasoningDelta("Let me see."),
        ContentDelta("\n\nThe answer."),
        Terminated("eos"),
    ]
    # Without the option a stray </think> is dropped and the text stays content.
    parser = ThinkTagParser()
    assert coalesce(feed_all(parser, [text])) == [
        ContentDelta("Let me see.\n\nThe answer."),
        Terminated("eos"),
    ]
    assert parser.stats.parse_errors == 1
    # A leading <think> is accepted with the option too.
    assert coalesce(parse("<think>a</think>b", "think", think_implicit_start=True)) == [
        ReasoningDelta("a"),
        ContentDelta("b"),
        Terminated("eos"),
    ]


def test_think_text_with_angle_brackets_is_released() -> None:
    parser = ThinkTagParser()
    assert parser.feed("a < b <th") == [ContentDelta("a < b ")]
    assert parser.feed("ere") == [ContentDelta("<there")]


def test_marker_parser_streams_reasoning_and_holds_only_a_marker_prefix() -> None:
    parser = MarkerParser()
    assert parser.feed("abc ==") == [ReasoningDelta("abc ")]
    assert parser.feed("=FINAL") == []
    assert parser.feed("=== ok") == [ContentDelta(" ok")]
    assert parser.finish() == [Terminated("eos")]


def test_passthrough_parser() -> None:
    parser = PassThroughParser()
    assert parser.feed("<|start|>") == [ContentDelta("<|start|>")]
    assert parser.feed("") == []
    assert parser.finish() == [Terminated("eos")]


def test_factory() -> None:
    assert isinstance(create_text_parser("harmony", marker_window_chars=10), HarmonyTextParser)
    assert isinstance(create_text_parser("think", think_implicit_start=True), ThinkTagParser)
    assert isinstance(create_text_parser("marker", marker="###"), MarkerParser)
    assert isinstance(create_text_parser("passthrough"), PassThroughParser)
    with pytest.raises(ValueError, match="unknown text parser kind"):
        create_text_parser("regex")
    with pytest.raises(TypeError):
        create_text_parser("passthrough", marker="x")


# -- properties --------------------------------------------------------------------------------------

FRAGMENTS = [
    *MARKERS,
    "assistant",
    "analysis",
    "commentary",
    "final",
    "assistantfinal",
    "assistantanalysis",
    "assistantcommentary",
    " to=functions.f",
    " json",
    "<think>",
    "</think>",
    "===FINAL===",
    "<|",
    "|>",
    "<",
    "|",
    ">",
    "=",
    " ",
    "\n",
    "{",
    "}",
    "The",
    "x",
]
noisy_text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=5), max_size=40).map("".join)
body_text = st.text(alphabet=st.sampled_from('ab <|>{}"\n=T'), max_size=25).filter(
    lambda s: not any(m in s for m in MARKERS)
)
message = st.tuples(
    st.sampled_from(["analysis", "commentary", "final"]),
    st.sampled_from([None, "functions.get_weather", "browser.search"]),
    st.sampled_from(["", " <|constrain|>json", " json"]),
    body_text,
)


def render(messages: list[tuple[str, str | None, str, str]], terminator: str, first: str) -> str:
    parts = []
    for n, (channel, recipient, ctype, body) in enumerate(messages):
        head = first if n == 0 else "<|start|>assistant<|channel|>"
        to = f" to={recipient}" if recipient else ""
        end = terminator if n == len(messages) - 1 else "<|end|>"
        parts.append(f"{head}{channel}{to}{ctype if recipient else ''}<|message|>{body}{end}")
    return "".join(parts)


def expected_events(messages: list[tuple[str, str | None, str, str]], terminator: str) -> list[TextEvent]:
    events: list[TextEvent] = []
    index = 0
    for channel, recipient, _, body in messages:
        if recipient:
            events.append(ToolCallStart(index, recipient.removeprefix("functions.")))
            if body:
                events.append(ToolCallArgumentsDelta(index, body))
            events.append(ToolCallEnd(index))
            index += 1
        elif body:
            events.append(ReasoningDelta(body) if channel == "analysis" else ContentDelta(body))
    reason = {"<|return|>": "return", "<|call|>": "call"}.get(terminator, "eos")
    events.append(Terminated(reason))  # type: ignore[arg-type]
    return coalesce(events)


harmony_case = st.tuples(
    st.lists(message, min_size=1, max_size=5),
    st.sampled_from(["<|return|>", "<|call|>", "<|end|>", ""]),
    st.sampled_from(["<|start|>assistant<|channel|>", "<|channel|>"]),
)


@settings(max_examples=150, deadline=None)
@given(case=harmony_case, data=st.data())
def test_property_well_formed_harmony_parses_exactly_under_any_chunking(case, data) -> None:
    messages, terminator, first = case
    text = render(messages, terminator, first)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    events = feed_all(HarmonyTextParser(), split_at(text, cuts))
    check_stream_shape(events)
    assert coalesce(events) == expected_events(messages, terminator)
    for ev in events:
        if isinstance(ev, ReasoningDelta | ContentDelta | ToolCallArgumentsDelta):
            assert not any(m in ev.text for m in MARKERS)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(KINDS), text=noisy_text, data=st.data())
def test_property_any_chunking_gives_the_same_events(kind: str, text: str, data) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=25))
    # A small window makes the harmony parser decide on its fallback mid-stream, not only at finish.
    options = {"marker_window_chars": data.draw(st.integers(0, 60))} if kind == "harmony" else {}
    whole = create_text_parser(kind, **options)
    chunked = create_text_parser(kind, **options)
    expected = coalesce(feed_all(whole, [text]))
    assert coalesce(feed_all(chunked, split_at(text, cuts))) == expected
    assert chunked.stats == whole.stats


@settings(max_examples=100, deadline=None)
@given(
    case=harmony_case,
    noise=noisy_text,
    data=st.data(),
)
def test_property_noise_never_changes_completed_messages(case, noise: str, data) -> None:
    messages, terminator, first = case
    if len(messages) < 2:
        messages = [*messages, ("final", None, "", "tail")]
    k = data.draw(st.integers(1, len(messages) - 1))
    channel, recipient, ctype, body = messages[k]
    at = data.draw(st.integers(0, len(body)))
    noisy = [*messages[:k], (channel, recipient, ctype, body[:at] + noise + body[at:]), *messages[k + 1 :]]
    prefix_text = render(messages[:k], "<|end|>", first)
    before = coalesce(HarmonyTextParser().feed(prefix_text))
    if not before:
        return
    text = render(noisy, terminator, first)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    after = coalesce(feed_all(HarmonyTextParser(), split_at(text, cuts)))
    assert after[: len(before) - 1] == before[:-1]
    last, same = before[-1], after[len(before) - 1]
    if isinstance(last, ReasoningDelta | ContentDelta | ToolCallArgumentsDelta):
        assert type(same) is type(last) and same.text.startswith(last.text)  # type: ignore[union-attr]
    else:
        assert same == last


stripped_message = st.tuples(
    st.sampled_from(["analysis", "final", "commentary"]),
    st.sampled_from([None, "functions.f"]),
    st.text(alphabet=st.sampled_from("abT {}:\"'"), min_size=1, max_size=20),
)


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(stripped_message, min_size=1, max_size=4), data=st.data())
def test_property_stripped_form_under_any_chunking(messages, data) -> None:
    first_channel, first_recipient, first_body = messages[0]
    # The stream-start heuristic needs an uppercase letter (or a recipient) after the channel name.
    messages[0] = (first_channel, first_recipient, "T" + first_body)
    parts = []
    for n, (channel, recipient, body) in enumerate(messages):
        head = "" if n == 0 else "assistant"
        header = f" to={recipient} json" if recipient else ""
        parts.append(f"{head}{channel}{header}{body}")
    text = "".join(parts)
    whole = coalesce(feed_all(HarmonyTextParser(), [text]))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=20))
    events = feed_all(HarmonyTextParser(), split_at(text, cuts))
    check_stream_shape(events)
    assert coalesce(events) == whole
    calls = [m for m in messages if m[1]]
    assert sum(isinstance(e, ToolCallStart) for e in events) == len(calls)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    implicit=st.booleans(),
    text=noisy_text | st.text(max_size=80),
    data=st.data(),
)
def test_property_never_raises(kind: str, implicit: bool, text: str, data) -> None:
    options: dict[str, object] = {"think_implicit_start": implicit} if kind == "think" else {}
    if kind == "harmony":
        options["marker_window_chars"] = data.draw(st.integers(0, 40))
    parser = create_text_parser(kind, **options)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    events = feed_all(parser, split_at(text, cuts))
    check_stream_shape(events)
    assert parser.feed(text) == []
    assert parser.finish() == []
