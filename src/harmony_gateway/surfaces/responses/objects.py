"""The Responses API's Response object, built in one place: every Response the gateway sends (a JSON
body, `GET`, each streamed snapshot, a background one queued, cancelled or failed from outside its run,
a stored one) comes from these functions, so each carries every field the published schemas require
(OpenAI's OpenAPI document and Open Responses), with their types.

`response_envelope` fixes what a request echoes (sampling as applied, tools as the schema has them);
`response_snapshot` adds the state of a moment (status, output, usage, ending). A stored body is sent as
`complete_response` makes it, so a Response stored before a field existed still carries it.
"""

from __future__ import annotations

from typing import Any, Literal

from ...engines.base import SamplingOptions
from .types import ResponsesRequest

#: Why a response ended `incomplete`: the schema's `incomplete_details.reason` values.
IncompleteReason = Literal["max_output_tokens", "content_filter"]
#: The processing tier a response ran on: engines have one, OpenAI calls it `default`.
SERVICE_TIER = "default"

_SECRET_TOOL_KEYS = ("headers", "authorization")

#: Fields a tool of each type must carry in a Response (the schemas' `required`), with what an echo
#: says when the request left them out.
_TOOL_DEFAULTS: dict[str, dict[str, Any]] = {
    # `strict` is echoed as sent: the gateway does not itself enforce strict schemas.
    "function": {"description": None, "parameters": None, "strict": None},
    "namespace": {"description": ""},
    "code_interpreter": {"container": {"type": "auto"}},
}


def redacted_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools without MCP headers and authorization: echoed and stored, never secrets."""
    return [
        {k: v for k, v in tool.items() if k not in _SECRET_TOOL_KEYS} if tool.get("type") == "mcp" else tool
        for tool in tools or ()
    ]


def echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """One (redacted) request tool as a Response echoes it: the fields its type requires filled in, a
    namespace's member tools too."""
    kind = tool.get("type")
    defaults = _TOOL_DEFAULTS.get(kind) if isinstance(kind, str) else None
    if defaults is None:
        return tool
    out = {**defaults, **tool}
    members = out.get("tools")
    if kind == "namespace" and isinstance(members, list):
        out["tools"] = [echoed_tool(m) if isinstance(m, dict) else m for m in members]
    return out


def echoed_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The request's tools as a Response echoes them: redacted, then completed (`echoed_tool`)."""
    return [echoed_tool(tool) for tool in redacted_tools(tools)]


def empty_usage() -> dict[str, Any]:
    """The usage of a response before its end: nothing counted yet."""
    return usage_of(0, 0, 0, 0)


def usage_of(
    input_tokens: int, output_tokens: int, reasoning_tokens: int, cached_tokens: int
) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def response_envelope(
    req: ResponsesRequest,
    response_id: str,
    created_at: int,
    model: str,
    effort: str,
    sampling: SamplingOptions,
) -> dict[str, Any]:
    """What a Response says of its request, for every snapshot of it: echoed fields, and the sampling
    the engine is asked for (the request's values over the model's defaults)."""
    conversation_id = req.conversation_id()
    envelope: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "model": model,
        "background": req.background,
        "conversation": {"id": conversation_id} if conversation_id else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "metadata": req.metadata or {},
        "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {"effort": effort, "summary": None},
        "safety_identifier": req.safety_identifier,
        "service_tier": SERVICE_TIER,
        "store": req.store,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "top_logprobs": req.top_logprobs or 0,
        "text": {"format": {"type": "text"}, **(req.text or {})},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": echoed_tools(req.tools),
        "truncation": req.truncation or "disabled",
    }
    if req.user is not None:
        envelope["user"] = req.user  # a string when present: the schema has no null for it
    return envelope


def response_snapshot(
    envelope: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    *,
    error: dict[str, Any] | None = None,
    incomplete_reason: IncompleteReason | None = None,
    completed_at: int | None = None,
) -> dict[str, Any]:
    """The Response at one moment: `completed_at` only once `completed`, `usage` counted so far."""
    return {
        **envelope,
        "status": status,
        "completed_at": completed_at if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "output": output,
        "usage": usage if usage is not None else empty_usage(),
    }


def ended_response(body: dict[str, Any], status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A stored Response ended from outside its run (a cancel, a restart): `status`, with `error`."""
    return dict(
        complete_response(body), status=status, error=error, incomplete_details=None, completed_at=None
    )


#: Fields a Response stored by an earlier version may lack, with the value they had then.
_STORED_DEFAULTS: dict[str, Any] = {
    "completed_at": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "service_tier": SERVICE_TIER,
    "safety_identifier": None,
    "prompt_cache_key": None,
}


def complete_response(body: dict[str, Any]) -> dict[str, Any]:
    """A stored Response as it is sent (a new dict): a body stored before a field of the schema
    existed gets it, with what that field would have said then."""
    out = {**_STORED_DEFAULTS, **body}
    if out.get("top_logprobs") is None:
        out["top_logprobs"] = 0
    if out.get("usage") is None:
        out["usage"] = empty_usage()
    if "user" in out and out["user"] is None:
        del out["user"]
    out["tools"] = echoed_tools(out.get("tools"))
    return out


def complete_event(event: dict[str, Any]) -> dict[str, Any]:
    """A stored stream event as it is sent: the Response it carries, if any, completed."""
    body = event.get("response")
    if not isinstance(body, dict):
        return event
    return {**event, "response": complete_response(body)}


__all__ = [
    "IncompleteReason",
    "SERVICE_TIER",
    "complete_event",
    "complete_response",
    "echoed_tool",
    "echoed_tools",
    "empty_usage",
    "ended_response",
    "redacted_tools",
    "response_envelope",
    "response_snapshot",
    "usage_of",
]
