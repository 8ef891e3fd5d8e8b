"""The Responses stream invariant (REFERENCE §4.6): pairing, stack nesting, sequence numbers, indices,
and every event valid against the published schemas (`published_schemas`)."""

from __future__ import annotations

from typing import Any

from tests.support.published_schemas import assert_valid_events

PAIRS = {
    "response.output_item.added": "response.output_item.done",
    "response.content_part.added": "response.content_part.done",
    "response.mcp_call.in_progress": ("response.mcp_call.completed", "response.mcp_call.failed"),
    "response.mcp_list_tools.in_progress": (
        "response.mcp_list_tools.completed",
        "response.mcp_list_tools.failed",
    ),
    "response.web_search_call.in_progress": "response.web_search_call.completed",
    "response.code_interpreter_call.in_progress": "response.code_interpreter_call.completed",
}
DELTAS = {
    "response.output_text.delta": "response.output_text.done",
    "response.reasoning_text.delta": "response.reasoning_text.done",
    "response.function_call_arguments.delta": "response.function_call_arguments.done",
    "response.mcp_call_arguments.delta": "response.mcp_call_arguments.done",
    "response.code_interpreter_call_code.delta": "response.code_interpreter_call_code.done",
    "response.custom_tool_call_input.delta": "response.custom_tool_call_input.done",
}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "error"}


def validate_event_stream(events: list[dict[str, Any]]) -> None:
    """Events as sent (decoded JSON, or an SDK event's `model_dump(exclude_unset=True)`): the SDK fills
    the fields a wire event left out with None, which the schemas rightly refuse."""
    assert events, "empty stream"
    assert_valid_events(events)
    assert events[0]["type"] == "response.created"
    assert events[1]["type"] == "response.in_progress"
    assert events[-1]["type"] in TERMINAL
    assert sum(e["type"] in TERMINAL for e in events) == 1
    seqs = [e["sequence_number"] for e in events]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must increase by one"
    stack: list[tuple[str, Any]] = []
    open_delta: tuple[str, Any] | None = None
    done_items: list[str] = []
    last_index = -1
    for e in events[2:-1]:
        t = e["type"]
        if "output_index" in e:
            assert e["output_index"] >= last_index or t.endswith(".done"), "output_index went backwards"
        if t in DELTAS:
            key = (e.get("item_id"), e.get("content_index"))
            if open_delta is not None:
                assert open_delta == (DELTAS[t], key), f"interleaved deltas at {t}"
            open_delta = (DELTAS[t], key)
            assert stack and stack[-1][1] == e.get("item_id"), f"{t} outside its item"
            continue
        if t in DELTAS.values():
            if open_delta is not None:
                assert open_delta[0] == t, f"{t} closes {open_delta}"
            open_delta = None
            continue
        if t in PAIRS:
            ident = e["item"]["id"] if t == "response.output_item.added" else e.get("item_id")
            if t == "response.output_item.added":
                last_index = e["output_index"]
            stack.append((t, ident))
            continue
        closing = [k for k, v in PAIRS.items() if t == v or (isinstance(v, tuple) and t in v)]
        if closing:
            assert stack, f"{t} with nothing open"
            opened, ident = stack.pop()
            assert opened in closing, f"{t} closes {opened}"
            current = e["item"]["id"] if t == "response.output_item.done" else e.get("item_id")
            assert current == ident, f"{t} closes another item"
            if t == "response.output_item.done":
                done_items.append(ident)
                if e.get("item", {}).get("type") == "message":
                    assert e["item"]["content"], "a done message carries its content"
    assert not stack, f"unclosed: {stack}"
    final = events[-1].get("response") or {}
    if final:
        assert [item["id"] for item in final.get("output", [])] == done_items
    for e in events:
        if "content_index" in e:
            assert e["content_index"] == 0 or e["content_index"] < 8
