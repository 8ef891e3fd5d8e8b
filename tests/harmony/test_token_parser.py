"""HarmonyOutputParser: the recoverable quirks of real gpt-oss output (REFERENCE §9), and properties over
generated outputs: any split of a token stream parses like the whole, what was rendered parses back, no
special-token text reaches reasoning, answer or arguments, and nothing but UpstreamBadOutput is raised."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import Message, Role

from harmony_gateway.errors import UpstreamBadOutput
from harmony_gateway.harmony import token_parser as tp
from harmony_gateway.harmony.encoding import END, RETURN, START, get_encoding

SPECIAL_IDS = [199998, 199999, 200002, 200003, 200005, 200006, 200007, 200008, 200012, 200014, 200017]


def ids(text: str) -> list[int]:
    """Tokens of a text in which special-token strings are the special tokens."""
    return get_encoding().encode(text, allowed_special="all")


def ordinary(text: str) -> list[int]:
    """Tokens of a text in which special-token strings stay ordinary text."""
    return get_encoding().encode(text, disallowed_special=())


def parser(functions: Sequence[str] = ()) -> tp.HarmonyOutputParser:
    return tp.HarmonyOutputParser(get_encoding(), frozenset(functions))


def parse(
    tokens: Sequence[int], functions: Sequence[str] = (), splits: Sequence[int] = ()
) -> tuple[tp.HarmonyOutputParser, list[tp.Event]]:
    p = parser(functions)
    events: list[tp.Event] = []
    start = 0
    for cut in sorted(splits):
        events += p.feed(tokens[start:cut])
        start = max(start, cut)
    events += p.feed(tokens[start:])
    events += p.finish()
    return p, events


def summary(p: tp.HarmonyOutputParser, events: list[tp.Event]) -> dict[str, Any]:
    """Everything observable except the random call ids."""
    return {
        "events": [(etype, msg.kind, text) for etype, msg, text in events],
        "messages": [
            (m.kind, m.channel, m.recipient, m.name, m.content_type, m.text, m.terminated, m.terminator)
            + (m.call_index, m.tokens)
            for m in p.messages
        ],
        "counts": (p.calls, p.reasoning_tokens, p.output_tokens, p.ignored_tokens, p.halted),
    }


def kinds(p: tp.HarmonyOutputParser) -> list[tuple[int, str]]:
    return [(m.kind, m.text) for m in p.messages]


ANALYSIS = "<|channel|>analysis<|message|>Thinking it over.<|end|>"


# -- examples: REFERENCE §9 traps that concern token-level parsing --------------------------------------


def test_reasoning_then_final() -> None:
    p, events = parse(ids(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"))
    assert kinds(p) == [(tp.REASONING, "Thinking it over."), (tp.ANSWER, "Hello!")]
    assert [m.terminator for m in p.messages] == [END, RETURN]
    assert p.reasoning_tokens == len(ids(ANALYSIS))
    answer_events = [(e, t) for e, m, t in events if m is p.messages[1]]
    assert answer_events[0] == (tp.START, None) and answer_events[-1] == (tp.DONE, None)
    assert "".join(t for e, t in answer_events[1:-1] if e == tp.DELTA) == "Hello!"


@pytest.mark.parametrize("prefix", ["", ANALYSIS + "<|start|>assistant"])
@pytest.mark.parametrize("terminator", ["<|return|>", "<|end|>", ""])
def test_refusal_without_message_token(prefix: str, terminator: str) -> None:
    """Trap 1 (harmony#80): `<|channel|>final I'm sorry...` with no `<|message|>`. openai-harmony drops such
    a message when it is not the first; a stripped stop token leaves it open at the end of output."""
    p, events = parse(ids(prefix + "<|channel|>final I'm sorry, but I can't help with that." + terminator))
    answer = [m for m in p.messages if m.kind == tp.ANSWER]
    assert [m.text for m in answer] == ["I'm sorry, but I can't help with that."]
    assert answer[0].channel == "final"
    assert answer[0].terminated == bool(terminator)
    assert len(p.messages) == (2 if prefix else 1)
    assert not p.halted
    assert "".join(t for e, m, t in events if e == tp.DELTA and m.kind == tp.ANSWER) == answer[0].text


@pytest.mark.parametrize(
    "output",
    [
        "I'm sorry, but I can't help with that.<|end|>",  # no header at all
        "I'm sorry, but I can't help with that.",  # ... and no end token either
        ANALYSIS + "<|start|>assistant I'm sorry, but I can't help with that.<|end|>",  # a bare refusal
        ANALYSIS + "<|start|>assistant<|message|>I'm sorry, but I can't help with that.<|end|>",
    ],
)
def test_answer_text_without_a_header_is_kept_and_counted(output: str) -> None:
    """Text on no channel is still the answer (a refusal, most often), but it is not valid Harmony: it
    is a recovery like the other malformed shapes, so the inspector and the metrics report it."""
    p, _ = parse(ids(output))
    assert [m.text for m in p.messages if m.kind == tp.ANSWER] == ["I'm sorry, but I can't help with that."]
    assert p.recoveries == {tp.RECOVERED_NO_HEADER: 1}
    assert p.parse_error is not None and not p.halted


def test_a_refusal_with_its_channel_is_no_recovery() -> None:
    p, _ = parse(ids(ANALYSIS + "<|start|>assistant<|channel|>final I'm sorry.<|end|>"))
    assert kinds(p) == [(tp.REASONING, "Thinking it over."), (tp.ANSWER, "I'm sorry.")]
    assert p.recoveries == {}


def test_trailing_return_after_a_completed_final() -> None:
    """Trap 3 (vllm#50690): `<|end|><|return|>` is ignored, not a failure."""
    p, _ = parse(ids(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done.<|end|><|return|>"))
    assert kinds(p) == [(tp.REASONING, "Thinking it over."), (tp.ANSWER, "Done.")]
    assert p.messages[-1].terminated
    assert p.ignored_tokens == 1
    assert p.parse_error is not None


def test_bare_recipient_is_a_call_only_when_declared() -> None:
    """Trap 8 (vllm PR #42454)."""
    output = ids("<|channel|>commentary to=get_weather <|constrain|>json<|message|>{}<|call|>")
    p, _ = parse(output, functions=["get_weather"])
    assert [(m.kind, m.name) for m in p.messages] == [(tp.FUNCTION_CALL, "get_weather")]
    p, _ = parse(output)
    assert [m.kind for m in p.messages] == [tp.REASONING]


def test_call_on_the_analysis_channel() -> None:
    p, _ = parse(ids('<|channel|>analysis to=functions.lookup <|constrain|>json<|message|>{"q":1}<|call|>'))
    [call] = p.messages
    assert (call.kind, call.name, call.text, call.channel) == (
        tp.FUNCTION_CALL,
        "lookup",
        '{"q":1}',
        "analysis",
    )
    assert p.reasoning_tokens == 0


def test_call_ended_by_return() -> None:
    """Trap 11 (sglang PR #10576): the recipient makes the call, whatever the terminator."""
    p, _ = parse(ids('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a":1}<|return|>'))
    [call] = p.messages
    assert (call.kind, call.terminated, call.terminator) == (tp.FUNCTION_CALL, True, RETURN)


def test_call_without_constrain_keeps_raw_arguments() -> None:
    """Trap 12: no `<|constrain|>json`, arguments that are not JSON: still a call, arguments verbatim."""
    p, _ = parse(ids("<|channel|>commentary to=functions.f json<|message|>{not json<|call|>"))
    [call] = p.messages
    assert (call.kind, call.name, call.text) == (tp.FUNCTION_CALL, "f", "{not json")


def test_recipient_with_leaked_control_text() -> None:
    """Trap 9: a recipient carrying `<|...` text written as ordinary tokens."""
    output = (
        ids("<|channel|>commentary")
        + ordinary(" to=functions.lookup<|channel|>")
        + ids("<|message|>{}<|call|>")
    )
    p, _ = parse(output)
    assert [(m.kind, m.name) for m in p.messages] == [(tp.FUNCTION_CALL, "lookup")]
    p = parser()
    assert p.classify("commentary", "functions.get_weather<|channel|>x", "assistant").name == "get_weather"
    assert p.classify("commentary", "functions. <|call|>", "assistant").name == tp.INVALID_TOOL_NAME
    assert tp.clean_recipient("<|constrain|>") is None


@pytest.mark.parametrize(
    "junk",
    [
        "<|message|><|message|>this is not harmony<|start|><|start|><|end|><|end|><|return|>",
        "<|start|><|start|><|end|>junk<|message|>",
    ],
)
def test_junk_is_upstream_bad_output(junk: str) -> None:
    tokens = ids(junk)
    with pytest.raises(UpstreamBadOutput):
        parse(tokens)
    # Token by token: it fails before any delta carrying special-token text is handed out.
    p = parser()
    seen: list[str] = []
    with pytest.raises(UpstreamBadOutput):
        for token in tokens:
            seen += [t for e, _, t in p.feed([token]) if e == tp.DELTA and t]
        p.finish()
    assert not any("<|" in text for text in seen)


@pytest.mark.parametrize(
    ("junk", "answer"),
    [
        ("<|channel|>final<|message|>half<|message|>more<|return|>", "half"),
        ("<|channel|>final<|message|>x<|start|>assistant<|return|>", "x"),
    ],
)
def test_control_token_inside_an_answer_keeps_the_text_before_it(junk: str, answer: str) -> None:
    p, events = parse(ids(junk))
    assert [m.text for m in p.messages if m.kind == tp.ANSWER and m.text] == [answer]
    assert p.recoveries == {tp.RECOVERED_CONTROL_IN_CONTENT: 1}
    assert not any(t and "<|" in t for _, _, t in events)


def test_junk_after_a_completed_message_is_skipped() -> None:
    p, _ = parse(ids(ANALYSIS + "<|message|><|message|>junk<|end|>"))
    assert kinds(p) == [(tp.REASONING, "Thinking it over.")]
    assert p.parse_error and p.recoveries


def test_unterminated_message_at_end_of_output() -> None:
    p, events = parse(ids(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>The answer is"))
    assert kinds(p) == [(tp.REASONING, "Thinking it over."), (tp.ANSWER, "The answer is")]
    assert not p.messages[-1].terminated
    assert events[-1][0] == tp.DONE


def test_header_cut_by_length_is_an_empty_reply() -> None:
    for text in ["<|channel|>anal", ANALYSIS + "<|start|>assistant<|channel|>fin"]:
        p, _ = parse(ids(text))
        assert all(m.kind == tp.REASONING for m in p.messages)
        assert not p.halted


def test_two_consecutive_calls_to_the_same_function() -> None:
    """Trap 44: a new call per call message, not per recipient change."""
    call = "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}"
    p, events = parse(ids(ANALYSIS + call + "<|end|>" + call + "<|call|>"))
    calls = [m for m in p.messages if m.kind == tp.FUNCTION_CALL]
    assert [(m.call_index, m.name, m.text, m.terminated) for m in calls] == [
        (0, "f", "{}", True),
        (1, "f", "{}", True),
    ]
    assert calls[0].call_id != calls[1].call_id
    assert all(m.call_id.startswith("call_") for m in calls)  # type: ignore[union-attr]
    assert sum(1 for e, m, _ in events if e == tp.START and m.kind == tp.FUNCTION_CALL) == 2


def test_preamble_is_its_own_kind() -> None:
    p, _ = parse(
        ids(
            ANALYSIS
            + "<|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
            + "<|start|>assistant<|channel|>final<|message|>Checked.<|return|>"
        )
    )
    assert kinds(p) == [
        (tp.REASONING, "Thinking it over."),
        (tp.PREAMBLE, "Let me check."),
        (tp.ANSWER, "Checked."),
    ]


def test_message_written_as_another_role_is_dropped() -> None:
    p, _ = parse(
        ids(
            ANALYSIS
            + "<|start|>functions.f to=assistant<|channel|>commentary<|message|>made up<|end|>"
            + "<|start|>assistant<|channel|>final<|message|>ok<|return|>"
        )
    )
    assert [m.kind for m in p.messages] == [tp.REASONING, tp.DROPPED, tp.ANSWER]


def test_any_number_of_messages() -> None:
    """Trap 10: no assumption of exactly analysis + final."""
    p, _ = parse(ids("<|channel|>final<|message|>Only an answer.<|return|>"))
    assert kinds(p) == [(tp.ANSWER, "Only an answer.")]
    again = "<|start|>assistant" + ANALYSIS
    p, _ = parse(ids(ANALYSIS + again + again + "<|start|>assistant<|channel|>final<|message|>x<|return|>"))
    assert [m.kind for m in p.messages] == [tp.REASONING] * 3 + [tp.ANSWER]


def test_special_token_text_written_with_ordinary_tokens_is_text() -> None:
    """The model may quote the format; only special token ids are control tokens."""
    quoted = "A message ends with <|end|> and a call with <|call|>."
    p, _ = parse(ids("<|channel|>final<|message|>") + ordinary(quoted) + [RETURN])
    assert kinds(p) == [(tp.ANSWER, quoted)]
    assert not p.halted


def test_multibyte_text_split_across_tokens() -> None:
    text = "你好，世界 🌍🚀 — naïve café ✓ 漢字テスト"
    p, events = parse(ids("<|channel|>final<|message|>") + ordinary(text) + [RETURN])
    assert kinds(p) == [(tp.ANSWER, text)]
    assert "".join(t for e, _, t in events if e == tp.DELTA) == text


# -- properties -----------------------------------------------------------------------------------------

_TRICKY = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|",
    "|>",
    "🌍🚀",
    "你好",
    "  \n\n ",
    "\t",
    '{"a": 1}',
    "é",
]
texts = st.lists(st.one_of(st.text(max_size=10), st.sampled_from(_TRICKY)), max_size=5).map("".join)
clean_texts = texts.map(lambda s: s.replace("<|", "< |"))
names = st.from_regex(r"[a-z][a-z0-9_]{0,9}", fullmatch=True)


@st.composite
def assistant_messages(draw: st.DrawFn, text: st.SearchStrategy[str] = texts) -> Message:
    body = draw(text)
    kind = draw(st.sampled_from(["analysis", "preamble", "final", "call"]))
    if kind == "call":
        message = Message.from_role_and_content(Role.ASSISTANT, body)
        message = message.with_channel(draw(st.sampled_from(["commentary", "analysis"])))
        message = message.with_recipient("functions." + draw(names))
        return message.with_content_type(draw(st.sampled_from(["<|constrain|>json", "json"])))
    channel = "commentary" if kind == "preamble" else kind
    return Message.from_role_and_content(Role.ASSISTANT, body).with_channel(channel)


@functools.cache
def _assistant_prefix() -> tuple[int, ...]:
    return (START, *ids("assistant"))


def render_output(messages: list[Message]) -> list[int]:
    """What the model generates after the prompt's `<|start|>assistant`: rendered messages, the first
    without its `<|start|>assistant`, the last final closed with `<|return|>`."""
    tokens: list[int] = []
    for message in messages:
        tokens += get_encoding().render(message)
    prefix = _assistant_prefix()
    assert tuple(tokens[: len(prefix)]) == prefix
    tokens = tokens[len(prefix) :]
    if tokens and tokens[-1] == END and messages[-1].channel == "final":
        tokens[-1] = RETURN
    return tokens


outputs = st.lists(assistant_messages(), min_size=1, max_size=5).map(render_output)
_props = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_props
@given(messages=st.lists(assistant_messages(), min_size=1, max_size=5))
def test_rendered_messages_parse_back(messages: list[Message]) -> None:
    p, events = parse(render_output(messages))
    assert not p.halted
    got = [(m.channel, m.recipient, m.text, m.terminated) for m in p.messages]
    want = [(m.channel, m.recipient, m.content[0].text, True) for m in messages]  # type: ignore[union-attr]
    assert got == want
    for m, original in zip(p.messages, messages, strict=True):
        if original.recipient:
            assert (m.kind, m.name) == (tp.FUNCTION_CALL, original.recipient[len("functions.") :])
        elif original.channel == "analysis":
            assert m.kind == tp.REASONING
        else:
            assert m.kind == (tp.PREAMBLE if original.channel == "commentary" else tp.ANSWER)
        assert "".join(t for e, msg, t in events if e == tp.DELTA and msg is m) == m.text
    assert p.calls == sum(1 for m in messages if m.recipient)


@_props
@given(tokens=outputs, data=st.data())
def test_any_split_parses_like_the_whole(tokens: list[int], data: st.DataObject) -> None:
    end = data.draw(st.integers(len(tokens) // 2, len(tokens)), label="end")  # also cut by length
    tokens = tokens[:end]
    whole = summary(*parse(tokens))
    splits = data.draw(st.lists(st.integers(0, len(tokens)), max_size=6), label="splits")
    assert summary(*parse(tokens, splits=splits)) == whole
    assert summary(*parse(tokens, splits=range(len(tokens)))) == whole  # token by token


@_props
@given(messages=st.lists(assistant_messages(clean_texts), min_size=1, max_size=4), data=st.data())
def test_special_tokens_never_become_text(messages: list[Message], data: st.DataObject) -> None:
    tokens = render_output(messages)
    for _ in range(data.draw(st.integers(0, 3), label="insertions")):
        at = data.draw(st.integers(0, len(tokens)), label="at")
        tokens.insert(at, data.draw(st.sampled_from(SPECIAL_IDS), label="special"))
    try:
        p, events = parse(tokens, functions=["f"])
    except UpstreamBadOutput:
        return
    for _, msg, text in events:
        assert text is None or "<|" not in text
        assert "<|" not in msg.text
        assert msg.name is None or "<|" not in msg.name


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.sampled_from(SPECIAL_IDS), st.integers(0, 199997), st.sampled_from(ids("analysis final"))
        ),
        max_size=40,
    ),
    splits=st.lists(st.integers(0, 40), max_size=4),
)
def test_arbitrary_tokens_raise_only_upstream_bad_output(tokens: list[int], splits: list[int]) -> None:
    try:
        p, events = parse(tokens, functions=["f"], splits=splits)
    except UpstreamBadOutput:
        return
    for _, msg, text in events:
        assert text is None or not tp.has_special_text(text)
        assert not tp.has_special_text(msg.text)
