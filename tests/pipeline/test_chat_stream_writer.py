"""`ChatStreamWriter.deltas`: one chunk per run of same-kind deltas, reasoning under each configured key."""

from __future__ import annotations

import orjson
import pytest

from harmony_gateway.pipeline.parse_output import CONTENT, REASONING_TEXT, TOOL_ARGS, TOOL_OPEN
from harmony_gateway.surfaces.chat.framer import ChatStreamWriter


def _chunks(raw: bytes) -> list[dict]:
    frames = [f for f in raw.split(b"\n\n") if f]
    assert all(f.startswith(b"data: ") for f in frames)
    return [orjson.loads(f[6:]) for f in frames]


def _delta_list(mode: str, deltas: list[tuple]) -> list[dict]:
    writer = ChatStreamWriter("chatcmpl-1", 1, "m", include_usage=False, reasoning_mode=mode)
    return [c["choices"][0]["delta"] for c in _chunks(writer.deltas(0, deltas))]


@pytest.mark.parametrize(
    ("mode", "keys"),
    [
        ("reasoning_content", ["reasoning_content"]),
        ("reasoning", ["reasoning"]),
        ("both", ["reasoning_content", "reasoning"]),
    ],
)
def test_reasoning_keys(mode: str, keys: list[str]) -> None:
    assert _delta_list(mode, [(REASONING_TEXT, 'a "b"')]) == [dict.fromkeys(keys, 'a "b"')]
    # A run of reasoning is joined; a following run of another kind gets its own chunk.
    assert _delta_list(mode, [(REASONING_TEXT, "x"), (REASONING_TEXT, "y"), (CONTENT, "z")]) == [
        dict.fromkeys(keys, "xy"),
        {"content": "z"},
    ]
    assert _delta_list(mode, [(CONTENT, "z"), (REASONING_TEXT, "x")]) == [
        {"content": "z"},
        dict.fromkeys(keys, "x"),
    ]


def test_reasoning_then_tool_call() -> None:
    deltas = [(REASONING_TEXT, "r"), (TOOL_OPEN, 0, "call_1", "f"), (TOOL_ARGS, 0, "{}")]
    assert _delta_list("reasoning_content", deltas) == [
        {"reasoning_content": "r"},
        {
            "tool_calls": [
                {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ]
        },
    ]
