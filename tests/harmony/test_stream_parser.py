"""`StreamParser`, the linear-time parser under `HarmonyOutputParser`, is openai-harmony's `StreamableParser`
(non-strict): after every token of any token sequence (degenerate runs of control tokens, text, broken UTF-8,
ids outside the vocabulary) both are in the same state with the same header fields and content delta, have
completed the same messages, and reject the same tokens with the same error."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyError, Role, StreamableParser

from harmony_gateway.harmony.encoding import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    get_encoding,
)
from harmony_gateway.harmony.stream_parser import StreamParser

from .test_token_parser import SPECIAL_IDS, ids, ordinary
from .test_token_parser_stream_fast_path import BROKEN_UTF8

_props = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CONTROL = [START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL]
HEADER_WORDS = ids("assistant user tool analysis final commentary to=functions.f to=browser.search json")
token_items = st.one_of(
    st.sampled_from(CONTROL),
    st.sampled_from(SPECIAL_IDS),
    st.integers(0, 199997),
    st.sampled_from(HEADER_WORDS),
    st.sampled_from(ordinary(" \t\n<|constrain|> <|channel|>x to= é 🌍 \u00a0 \u3000 \x0b")),
    st.sampled_from(BROKEN_UTF8),
)
# Degenerate runs: one control token many times, possibly with text between.
runs = st.builds(
    lambda token, n, text: ([token] + text) * n,
    st.sampled_from(CONTROL),
    st.integers(1, 60),
    st.lists(st.sampled_from(HEADER_WORDS + BROKEN_UTF8[:5]), max_size=2),
)
sequences = st.lists(st.one_of(token_items.map(lambda t: [t]), runs), max_size=30).map(
    lambda parts: [t for part in parts for t in part]
)


def observe(parser: Any) -> tuple[Any, ...]:
    role = parser.current_role
    return (
        parser.state,
        role.value if role is not None else None,
        parser.current_channel,
        parser.current_recipient,
        parser.current_content_type,
        parser.last_content_delta,
    )


def reference_messages(parser: StreamableParser) -> list[tuple[Any, ...]]:
    return [
        (
            m.author.role.value,
            m.author.name,
            m.recipient,
            m.channel,
            m.content_type,
            "".join(getattr(part, "text", "") for part in m.content),
        )
        for m in parser.messages
    ]


def linear_messages(parser: StreamParser) -> list[tuple[Any, ...]]:
    return [(m.role.value, m.name, m.recipient, m.channel, m.content_type, m.text) for m in parser.messages]


def step(parser: Any, token: int | None) -> str | None:
    try:
        parser.process(token) if token is not None else parser.process_eos()
    except HarmonyError as exc:
        return str(exc)
    return None


def assert_same(tokens: list[int], role: Role | None) -> None:
    encoding = get_encoding()
    reference = StreamableParser(encoding, role, strict=False)
    linear = StreamParser(encoding, role)
    for token in [*tokens, None]:
        assert step(linear, token) == step(reference, token), (token, tokens)
        assert observe(linear) == observe(reference), (token, tokens)
    assert linear_messages(linear) == reference_messages(reference)


@_props
@given(tokens=sequences, role=st.sampled_from([Role.ASSISTANT, None]))
def test_same_as_openai_harmony_on_any_tokens(tokens: list[int], role: Role | None) -> None:
    assert_same(tokens, role)


@_props
@given(
    words=st.lists(
        st.sampled_from(HEADER_WORDS + ids("<|channel|><|constrain|>") + ordinary(" x")), max_size=8
    ),
    end=st.sampled_from([MESSAGE, END, CALL, RETURN]),
    role=st.sampled_from([Role.ASSISTANT, None]),
)
def test_same_headers_as_openai_harmony(words: list[int], end: int, role: Role | None) -> None:
    tokens = ([] if role else [START]) + words + [end] + ordinary("hi") + [END]
    assert_same(tokens, role)


def test_examples() -> None:
    for text in (
        "<|channel|>final<|message|>Hello<|return|>",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
        "<|channel|>final I'm sorry.<|end|>",
        "to=functions.f<|channel|>commentary json<|message|>{}<|call|><|start|>functions.f to=assistant<|message|>1",
        "<|start|><|start|><|channel|><|message|><|end|>",
        "<|channel|>analysis<|message|>a<|channel|>b<|end|><|start|>assistant x y z<|message|>",
    ):
        for role in (Role.ASSISTANT, None):
            assert_same(ids(text), role)
    assert_same([*ids("<|channel|>final<|message|>a"), 201090, 5, END], Role.ASSISTANT)
    assert_same([*ids("<|channel|>final<|message|>"), *BROKEN_UTF8[:6], END], Role.ASSISTANT)
