"""Property tests: malformed shapes of real gpt-oss output (junk in a header, unknown channels, a doubled
`<|start|>assistant`, text between messages, bare refusals, `<|return|>` after an analysis, text after the
end, an answer cut without an end token) inserted at random into valid Harmony output. On the token path
and on the text path: no control-token text in any client field, the final text that was produced is kept,
misplaced text is never answer text, and the result is the same under any chunking."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_gateway.errors import UpstreamBadOutput
from harmony_gateway.harmony import token_parser as tp
from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.harmony.text_events import ContentDelta, ReasoningDelta
from harmony_gateway.harmony.text_parser import HarmonyTextParser

MISPLACED = "Hidden notes"
_WORDS = st.sampled_from(["alpha", "beta", "gamma", "delta", "sky", "tree", "42", "ok", "über", "猫"])
_TEXT = st.lists(_WORDS, min_size=1, max_size=4).map(" ".join)

# Shapes inserted before a message (`{start}` is that message's opener, empty for the first one).
_BEFORE = {
    "bad_header": "<|start|>assistant<|channel|>––commentary<|message|>" + MISPLACED + " a<|end|>",
    "unknown_channel": "<|start|>assistant<|channel|>thoughts<|message|>" + MISPLACED + " b<|end|>",
    "stray_text": MISPLACED + " c",
    "doubled_start": "<|start|>assistant",
    "bare_refusal": "<|start|>assistant I cannot do that<|end|>",
}
_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def malformed_outputs(draw: st.DrawFn) -> tuple[str, list[str]]:
    """(output text with literal special tokens, the final texts it carries)."""
    n = draw(st.integers(1, 4))
    channels = [draw(st.sampled_from(["analysis", "commentary", "final"])) for _ in range(n - 1)] + ["final"]
    texts = [draw(_TEXT) for _ in range(n)]
    out = ""
    for i, (channel, text) in enumerate(zip(channels, texts, strict=True)):
        if i > 0:
            shape = draw(st.sampled_from([None, *_BEFORE]))
            if shape is not None:
                out += _BEFORE[shape]
        opener = "<|start|>assistant" if i > 0 else ""
        out += f"{opener}<|channel|>{channel}<|message|>{text}"
        last = i == n - 1
        out += draw(st.sampled_from(["<|return|>", ""])) if last else "<|end|>"
    if out.endswith("<|return|>") and draw(st.booleans()):
        out += draw(st.sampled_from(["junk after the end", "<|start|>assistant<|channel|>final<|message|>x"]))
    finals = [text for channel, text in zip(channels, texts, strict=True) if channel == "final"]
    return out, finals


def _chunks(data: st.DataObject, items: list, label: str) -> list[list]:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(items) - 1)), max_size=6), label=label))
    bounds = [0, *[c for c in cuts if c < len(items)], len(items)]
    return [items[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _token_result(ids: list[int], chunks: list[list[int]]) -> tuple[list[tuple[int, str]], list[str]]:
    p = tp.HarmonyOutputParser(get_encoding())
    deltas: list[str] = []
    for chunk in chunks:
        deltas += [text for kind, _, text in p.feed(chunk) if kind == tp.DELTA and text]
    deltas += [text for kind, _, text in p.finish() if kind == tp.DELTA and text]
    assert sum(len(c) for c in chunks) == len(ids)
    return [(m.kind, m.text) for m in p.messages], deltas


@_SETTINGS
@given(case=malformed_outputs(), data=st.data())
def test_token_parser_recovers_from_malformed_shapes(
    case: tuple[str, list[str]], data: st.DataObject
) -> None:
    text, finals = case
    ids = get_encoding().encode(text, allowed_special="all")
    whole, deltas = _token_result(ids, [ids])
    assert not any("<|" in d for d in deltas)
    answer = "".join(t for kind, t in whole if kind == tp.ANSWER)
    for final in finals:
        assert final in answer
    assert MISPLACED not in answer
    assert _token_result(ids, _chunks(data, ids, "cuts"))[0] == whole
    token_by_token = _token_result(ids, [[t] for t in ids])[0]
    assert token_by_token == whole


@_SETTINGS
@given(case=malformed_outputs(), data=st.data())
def test_text_parser_recovers_from_malformed_shapes(case: tuple[str, list[str]], data: st.DataObject) -> None:
    text, finals = case

    def run(pieces: list[str]) -> tuple[str, str]:
        parser = HarmonyTextParser()
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        return content, reasoning

    content, reasoning = run([text])
    assert "<|" not in content and "<|" not in reasoning
    for final in finals:
        assert final in content
    assert MISPLACED not in content
    pieces = ["".join(c) for c in _chunks(data, list(text), "text cuts")]
    assert run(pieces) == (content, reasoning)


def test_nothing_usable_is_still_an_error() -> None:
    ids = get_encoding().encode("<|message|><|channel|><|start|><|start|><|end|>", allowed_special="all")
    p = tp.HarmonyOutputParser(get_encoding())
    with pytest.raises(UpstreamBadOutput):
        p.feed(ids)
        p.finish()
