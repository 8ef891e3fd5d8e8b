"""Responses output: parser events → output items, and → the OpenAI Responses stream events (REFERENCE §3.6,
§4). Item ids are minted once, when an item starts, so the terminal event carries exactly the ids that
were streamed; `content_index` restarts at 0 for every item; every part and item opened is closed before
the terminal event, so the pairing/stack invariant holds on every path, failures included."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from ...harmony import token_parser as tp
from ...mcp.tool_loop import error_text
from ...pipeline.text_output import logprob_entry
from ...sse import encoded_event_frame
from .client_tools import LOCAL_SHELL, arguments_object, client_tool_kinds, local_shell_action
from .mapper import new_id
from .objects import IncompleteReason, response_snapshot

_dumps = orjson.dumps


def frame(event: dict[str, Any]) -> bytes:
    """An event as an SSE frame (a stream's body)."""
    return encoded_event_frame(event["type"], _dumps(event))


def json_line(event: dict[str, Any]) -> bytes:
    """An event as one line of JSON (a WebSocket turn: one message per line). JSON as orjson writes it
    never holds a raw newline, so a line is always one whole event."""
    return _dumps(event) + b"\n"


_NOT_COMPLETED = {"type": "http_error", "code": 499, "message": "the call was not completed"}
_CUT = {"type": "mcp_protocol_error", "code": -32602, "message": "generation stopped inside the call"}

#: Call items whose input streams as the model writes it: item type -> (the field that grows, its delta
#: event). A local_shell_call's action is built from the whole call when it is done.
_STREAMED_INPUT = {
    "function_call": ("arguments", "response.function_call_arguments.delta"),
    "custom_tool_call": ("input", "response.custom_tool_call_input.delta"),
    "mcp_call": ("arguments", "response.mcp_call_arguments.delta"),
    "code_interpreter_call": ("code", "response.code_interpreter_call_code.delta"),
}


def _empty_part(part_type: str) -> dict[str, Any]:
    """A content part before its first delta; a new one each call, so items and events never share it."""
    if part_type == "reasoning_text":
        return {"type": "reasoning_text", "text": ""}
    return {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


@dataclass(eq=False, slots=True)
class ToolSlot:
    """A gateway-executed tool call of the model and its output item (None until the item is reported).

    `decision` comes from the tool loop (`mcp.tool_loop.Decision`); `outcome` is set once it ran."""

    msg: Any
    decision: Any
    item: dict[str, Any] | None = None
    index: int = -1
    outcome: Any = None
    cut: bool = False  # generation stopped inside the call: never executed


def browser_action(recipient: str, arguments: str) -> dict[str, Any]:
    """The `action` of a web_search_call item, from the browser call's JSON arguments."""
    args = arguments_object(arguments)
    tool = recipient.partition(".")[2]
    if tool == "open":
        target = args.get("id")
        return {"type": "open_page", "url": target if isinstance(target, str) else None}
    if tool == "find":
        return {"type": "find_in_page", "pattern": str(args.get("pattern", "")), "url": ""}
    query = args.get("query")
    return {"type": "search", "query": query if isinstance(query, str) else ""}


class ResponseBuilder:
    """Accumulates one response's output items and, when streaming, its frames (`encode`)."""

    def __init__(
        self, envelope: dict[str, Any], *, stream: bool, sequence_start: int = 0, record: bool = False
    ) -> None:
        self.envelope = envelope  # the Response object without output/status/usage
        #: How a streamed event becomes bytes: an SSE frame, or a line of JSON on a WebSocket.
        self.encode: Callable[[dict[str, Any]], bytes] = frame
        self.output: list[dict[str, Any]] = []
        self.stream = stream or record
        self.sequence = sequence_start
        self._open: dict[int, tuple[dict[str, Any], int]] = {}  # id(msg) -> (item, output_index)
        self.frames: list[bytes] = []
        #: Recording (background responses): each event with its frame, kept for the event log and
        #: live subscribers instead of `frames`. Framed at emit time, so later item updates never leak in.
        self.events: list[tuple[dict[str, Any], bytes]] | None = [] if record else None
        #: The final Response once `finish` ran (its terminal event emitted).
        self.final: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        #: The request's tool loop (`mcp.tool_loop.ToolLoop`), which decides how tool calls are reported.
        self.tools: Any = None
        #: Tool calls of the current model turn, in order; the pipeline drains them after each turn.
        self.tool_slots: list[ToolSlot] = []
        #: A call whose item stays open until the gateway has run it. Parser events that arrive meanwhile
        #: are held and replayed when it completes, so items never interleave on the stream.
        self.awaiting: ToolSlot | None = None
        self._held: list[tp.Event] = []
        self._slots: dict[int, ToolSlot] = {}
        #: With `include: ["message.output_text.logprobs"]`: a token id's text, for logprob entries.
        self.token_text: Callable[[int], str] | None = None
        #: Logprob entries of answer tokens not yet reported, by id(msg): they ride on that message's
        #: next `output_text.delta` (a token that ends inside a character has no text of its own).
        self._logprobs: dict[int, list[dict[str, Any]]] = {}
        #: With `include: ["reasoning.encrypted_content"]`: seals a finished reasoning item's text into its
        #: `encrypted_content` (`reasoning_store.ReasoningVault.seal`).
        self.seal_reasoning: Callable[[str], str] | None = None
        #: Custom (freeform) and local_shell tools of the request, read from the echoed `tools`.
        self.client_tools = client_tool_kinds(envelope.get("tools"))
        self._shell_calls: dict[int, tp.ParsedMessage] = {}

    # -- framing ----------------------------------------------------------------------------------
    def emit(self, event: dict[str, Any]) -> None:
        if self.stream:
            event["sequence_number"] = self.sequence
            self.sequence += 1
            if self.events is not None:
                self.events.append((event, frame(event)))
            else:
                self.frames.append(self.encode(event))

    def ready(self) -> bool:
        """True when events were emitted since the last `take` / `take_events`."""
        return bool(self.frames or self.events)

    def take(self) -> bytes:
        out = b"".join(self.frames)
        self.frames.clear()
        return out

    def take_events(self) -> list[tuple[dict[str, Any], bytes]]:
        """The recorded events since the last call (recording builders only)."""
        out = self.events or []
        self.events = []
        return out

    def snapshot(
        self,
        status: str,
        *,
        error: dict[str, Any] | None = None,
        incomplete_reason: IncompleteReason | None = None,
        completed_at: int | None = None,
    ) -> dict[str, Any]:
        """The Response now (`objects.response_snapshot`), its output list a copy."""
        return response_snapshot(
            self.envelope,
            status,
            list(self.output),
            self.usage,
            error=error,
            incomplete_reason=incomplete_reason,
            completed_at=completed_at,
        )

    def _item_event(self, event_type: str, item: dict[str, Any], index: int, **fields: Any) -> None:
        """Emit an event about output item `item` at `index`, with `fields` after its id and index."""
        self.emit({"type": event_type, "item_id": item["id"], "output_index": index, **fields})

    def start(self, status: str = "in_progress") -> None:
        """`response.created` with `status` (queued for background), then `response.in_progress`."""
        self.announce_created(status)
        self.announce_in_progress()

    def announce_created(self, status: str) -> None:
        self.emit({"type": "response.created", "response": self.snapshot(status)})

    def announce_in_progress(self) -> None:
        self.emit({"type": "response.in_progress", "response": self.snapshot("in_progress")})

    # -- items ------------------------------------------------------------------------------------
    def add_item(self, item: dict[str, Any]) -> int:
        """Append a finished item (e.g. an MCP list) with its added/done events; returns its index."""
        index = len(self.output)
        self.output.append(item)
        self.emit({"type": "response.output_item.added", "output_index": index, "item": item})
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})
        return index

    def open_item(self, item: dict[str, Any]) -> int:
        index = len(self.output)
        self.output.append(item)
        self.emit(
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": dict(item, content=[]) if "content" in item else dict(item),
            }
        )
        return index

    def on_events(self, events: list[tp.Event]) -> None:
        for n, event in enumerate(events):
            if self.awaiting is not None:
                self._held.extend(events[n:])
                return
            etype, msg, text = event
            kind = msg.kind
            if kind == tp.DROPPED:
                continue
            if kind == tp.TOOL_CALL:
                self._tool_event(etype, msg, text)
                continue
            key = id(msg)
            if etype == tp.START:
                self._start(key, msg)
            elif etype == tp.DELTA:
                item, index = self._open[key]
                if kind == tp.FUNCTION_CALL:
                    self._input_delta(item, index, text)  # type: ignore[arg-type]
                # Text deltas are the per-token path: their events are built here, not by `_item_event`.
                elif kind == tp.REASONING:
                    item["content"][0]["text"] += text
                    self.emit(
                        {
                            "type": "response.reasoning_text.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "content_index": 0,
                            "delta": text,
                        }
                    )
                else:
                    part = item["content"][0]
                    part["text"] += text
                    logprobs = self._logprobs.pop(key, []) if self._logprobs else []
                    if logprobs:
                        part["logprobs"].extend(logprobs)
                    self.emit(
                        {
                            "type": "response.output_text.delta",
                            "item_id": item["id"],
                            "output_index": index,
                            "content_index": 0,
                            "delta": text,
                            "logprobs": logprobs,
                        }
                    )
            else:
                self._done(key, "completed" if msg.terminated else "incomplete")

    def add_logprob(self, msg: tp.ParsedMessage, logprob: Any) -> None:
        """Record the logprob (`engines.base.TokenLogprob`) of one answer token of `msg`, in the
        SDK's `Logprob` shape; reported with the message's next text delta."""
        assert self.token_text is not None
        self._logprobs.setdefault(id(msg), []).append(logprob_entry(self.token_text, logprob))

    def _input_delta(self, item: dict[str, Any], index: int, text: str) -> None:
        """A call item's input grows by `text`, told by the item type's delta event (`_STREAMED_INPUT`)."""
        streamed = _STREAMED_INPUT.get(item["type"])
        if streamed is not None:
            field, event_type = streamed
            item[field] += text
            self._item_event(event_type, item, index, delta=text)

    def _start(self, key: int, msg: tp.ParsedMessage) -> None:
        kind = msg.kind
        item: dict[str, Any]
        if kind == tp.FUNCTION_CALL and msg.name in self.client_tools.custom:
            item = {
                "type": "custom_tool_call",
                "id": new_id("ctc"),
                "call_id": msg.call_id,
                "name": msg.name,
                "input": "",
                "status": "in_progress",
            }
            index = self.open_item(item)
        elif kind == tp.FUNCTION_CALL and msg.name == LOCAL_SHELL and self.client_tools.local_shell:
            item = {
                "type": "local_shell_call",
                "id": new_id("lsh"),
                "call_id": msg.call_id,
                "action": local_shell_action(""),
                "status": "in_progress",
            }
            self._shell_calls[key] = msg
            index = self.open_item(item)
        elif kind == tp.FUNCTION_CALL:
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": msg.call_id,
                "name": msg.name,
                "arguments": "",
                "status": "in_progress",
            }
            if msg.recipient and not msg.recipient.startswith("functions.") and "." in (msg.name or ""):
                # A tool of a client-declared namespace: OpenAI reports it as name + namespace.
                item["namespace"], item["name"] = msg.name.split(".", 1)  # type: ignore[union-attr]
            index = self.open_item(item)
        elif kind == tp.REASONING:
            item = {
                "type": "reasoning",
                "id": new_id("rs"),
                "summary": [],
                "content": [_empty_part("reasoning_text")],
                "status": "in_progress",
            }
            index = self._open_with_part(item)
        else:
            item = {
                "type": "message",
                "id": new_id("msg"),
                "role": "assistant",
                "status": "in_progress",
                "phase": "commentary" if kind == tp.PREAMBLE else "final_answer",
                "content": [_empty_part("output_text")],
            }
            index = self._open_with_part(item)
        msg.item_id = item["id"]
        self._open[key] = (item, index)

    def _open_with_part(self, item: dict[str, Any]) -> int:
        """Open a reasoning or message item and its one content part."""
        index = self.open_item(item)
        part = _empty_part(item["content"][0]["type"])
        self._item_event("response.content_part.added", item, index, content_index=0, part=part)
        return index

    def _done(self, key: int, status: str) -> None:
        entry = self._open.pop(key, None)
        if entry is None:
            return
        item, index = entry
        item["status"] = status
        kind = item["type"]
        if kind == "custom_tool_call":
            self._item_event("response.custom_tool_call_input.done", item, index, input=item["input"])
        elif kind == "local_shell_call":
            msg = self._shell_calls.pop(key, None)
            item["action"] = local_shell_action(msg.text if msg is not None else "")
        elif kind == "function_call":
            self._item_event(
                "response.function_call_arguments.done",
                item,
                index,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:  # reasoning or message: the text, then its part
            part = item["content"][0]
            if kind == "reasoning":
                if self.seal_reasoning is not None:
                    item["encrypted_content"] = self.seal_reasoning(part["text"])
                self._item_event(
                    "response.reasoning_text.done", item, index, content_index=0, text=part["text"]
                )
            else:
                part["logprobs"].extend(self._logprobs.pop(key, ()))
                self._item_event(
                    "response.output_text.done",
                    item,
                    index,
                    content_index=0,
                    text=part["text"],
                    logprobs=list(part["logprobs"]),
                )
            self._item_event("response.content_part.done", item, index, content_index=0, part=part)
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})

    def close_open(self, status: str = "incomplete") -> None:
        """Close every open item (failure or cut): keeps the event stack balanced."""
        self._held.clear()
        if self.awaiting is not None:
            slot, self.awaiting = self.awaiting, None
            self._close_tool(slot, None, _NOT_COMPLETED, "incomplete")
        for slot in list(self._slots.values()):
            if slot.item is not None and slot.item.get("status") in (
                "in_progress",
                "interpreting",
                "searching",
            ):
                self._close_tool(slot, None, _NOT_COMPLETED, "incomplete")
        self._slots.clear()
        for key in list(self._open):
            self._done(key, status)

    # -- gateway-executed tool calls --------------------------------------------------------------
    def add_list_tools(self, item: dict[str, Any]) -> int:
        """Report an `mcp_list_tools` item with its in_progress/completed (or failed) events."""
        index = len(self.output)
        self.output.append(item)
        self.emit({"type": "response.output_item.added", "output_index": index, "item": dict(item, tools=[])})
        self._item_event("response.mcp_list_tools.in_progress", item, index)
        ending = "failed" if item.get("error") else "completed"
        self._item_event(f"response.mcp_list_tools.{ending}", item, index)
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})
        return index

    def _tool_event(self, etype: int, msg: tp.ParsedMessage, text: str | None) -> None:
        key = id(msg)
        slot: ToolSlot | None
        if etype == tp.START:
            decision = self.tools.decide(msg.name or "") if self.tools is not None else None
            slot = ToolSlot(msg, decision)
            self._slots[key] = slot
            self.tool_slots.append(slot)
            if decision is not None and decision.kind == "execute":
                if decision.item == "mcp_call":
                    self._open_mcp_call(slot, decision.server.label if decision.server else "", decision.tool)
                elif decision.item == "code_interpreter_call":
                    self._open_code_call(slot)
            return
        slot = self._slots.get(key)
        if slot is None:
            return
        item = slot.item
        if etype == tp.DELTA:
            if item is not None and text:
                self._input_delta(item, slot.index, text)
            return
        # DONE
        decision = slot.decision
        if not msg.terminated:
            slot.cut = True
            if item is not None:
                self._end_arguments(slot)
                self._close_tool(slot, None, _CUT, "incomplete")
            self._slots.pop(key, None)
            return
        if decision is None:
            self._slots.pop(key, None)
            return
        if decision.kind == "approval":
            slot.item = self.tools.approval_request(decision, msg.text)
            slot.index = self.add_item(slot.item)
            self._slots.pop(key, None)
            return
        if decision.kind != "execute":
            self._slots.pop(key, None)
            return
        if decision.item == "web_search_call":
            slot.item = {
                "type": "web_search_call",
                "id": new_id("ws"),
                "status": "in_progress",
                "action": browser_action(msg.name or "", msg.text),
            }
            slot.index = self.open_item(slot.item)
            self._item_event("response.web_search_call.in_progress", slot.item, slot.index)
            self._item_event("response.web_search_call.searching", slot.item, slot.index)
        else:
            self._end_arguments(slot)
        self.awaiting = slot

    def _open_mcp_call(
        self, slot: ToolSlot, server_label: str, name: str, approval_request_id: str | None = None
    ) -> None:
        item: dict[str, Any] = {
            "type": "mcp_call",
            "id": new_id("mcp"),
            "server_label": server_label,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        if approval_request_id is not None:
            item["approval_request_id"] = approval_request_id
        slot.item = item
        slot.index = self.open_item(item)
        self._item_event("response.mcp_call.in_progress", item, slot.index)

    def _open_code_call(self, slot: ToolSlot) -> None:
        server = slot.decision.server
        item = {
            "type": "code_interpreter_call",
            "id": new_id("ci"),
            "container_id": f"mcp:{server.label}" if server is not None else "mcp",
            "code": "",
            "outputs": None,
            "status": "in_progress",
        }
        slot.item = item
        slot.index = self.open_item(item)
        self._item_event("response.code_interpreter_call.in_progress", item, slot.index)

    def _end_arguments(self, slot: ToolSlot) -> None:
        item = slot.item
        assert item is not None
        if item["type"] == "mcp_call":
            self._item_event(
                "response.mcp_call_arguments.done", item, slot.index, arguments=item["arguments"]
            )
        elif item["type"] == "code_interpreter_call":
            self._item_event("response.code_interpreter_call_code.done", item, slot.index, code=item["code"])
            self._item_event("response.code_interpreter_call.interpreting", item, slot.index)
            item["status"] = "interpreting"

    def open_approved_call(
        self, server_label: str, name: str, arguments: str, approval_request_id: str
    ) -> ToolSlot:
        """Report a call the user approved in this request (it runs before the model's next turn)."""
        slot = ToolSlot(None, None)
        self._open_mcp_call(slot, server_label, name, approval_request_id)
        assert slot.item is not None
        self._input_delta(slot.item, slot.index, arguments)
        self._end_arguments(slot)
        return slot

    def complete_tool(self, slot: ToolSlot, output: str | None, error: dict[str, Any] | None) -> None:
        """Close the call's item with its result, then replay parser events held while it ran."""
        if self.awaiting is slot:
            self.awaiting = None
        if slot.msg is not None:
            self._slots.pop(id(slot.msg), None)
        self._close_tool(slot, output, error, "failed" if error is not None else "completed")
        held, self._held = self._held, []
        if held:
            self.on_events(held)

    def _close_tool(
        self, slot: ToolSlot, output: str | None, error: dict[str, Any] | None, status: str
    ) -> None:
        item = slot.item
        if item is None or item.get("status") not in ("in_progress", "interpreting", "searching"):
            return
        index = slot.index
        kind = item["type"]
        if kind == "mcp_call":
            item["output"] = output
            item["error"] = dict(error) if error is not None else None
            item["status"] = status
            ending = "completed" if status == "completed" else "failed"
            self._item_event(f"response.mcp_call.{ending}", item, index)
        elif kind == "web_search_call":
            item["status"] = status
            self._item_event("response.web_search_call.completed", item, index)
        elif kind == "code_interpreter_call":
            text = output if output is not None else error_text(error)
            item["outputs"] = [{"type": "logs", "logs": text}] if text else []
            item["status"] = status
            self._item_event("response.code_interpreter_call.completed", item, index)
        self.emit({"type": "response.output_item.done", "output_index": index, "item": item})

    # -- terminal ---------------------------------------------------------------------------------
    def finish(
        self,
        status: str,
        *,
        incomplete_reason: IncompleteReason | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        self.close_open("incomplete" if status != "completed" else "completed")
        body = self.snapshot(
            status, error=error, incomplete_reason=incomplete_reason, completed_at=int(time.time())
        )
        terminal = {
            "completed": "response.completed",
            "incomplete": "response.incomplete",
            "failed": "response.failed",
            "cancelled": "response.failed",
        }[status]
        self.emit({"type": terminal, "response": body})
        self.final = body
        return body

    def retract_final(self) -> bool:
        """Take back the terminal event while it is still unsent (recording builders), so that another
        ending can replace it with the same sequence number; False when it was already taken."""
        if self.final is None or not self.events or self.events[-1][0].get("response") is not self.final:
            return False
        self.events.pop()
        self.sequence -= 1
        self.final = None
        return True
