"""The surface table: one row per API surface, the only place that lists them.

A row names the surface's route, request type and wire, and points at its plan (request -> a
`pipeline.drive.Generation` the driver answers) and, when the inspector can show it, its inspection
(request -> the prepared prompt, not dispatched). The edge builds the routes, the OpenAPI request
bodies, traffic control's generating routes and the inspector's choices from these rows, and the
driver's contract tests walk them: a new surface is a folder and a row here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..pipeline.context import GatewayState, PreparedRequest, RequestContext
from ..pipeline.drive import Planned
from ..traffic.routes import RouteMap
from ..wire import ANTHROPIC, OPENAI, RESPONSES, Wire
from .chat.run import inspect_chat, plan_chat
from .chat.types import ChatCompletionRequest
from .completions.run import plan_completions
from .completions.types import CompletionRequest
from .generate.run import plan_generate
from .generate.types import GenerateRequest
from .messages.run import inspect_messages, plan_messages
from .messages.types import MessagesRequest
from .responses.service.compact import plan_compact
from .responses.service.service import inspect_responses, plan_responses
from .responses.types import CompactRequest, ResponsesRequest

Plan = Callable[[GatewayState, Any, RequestContext], Awaitable[Planned]]
Inspect = Callable[[GatewayState, dict[str, Any], RequestContext, list[str]], Awaitable[PreparedRequest]]


@dataclass(frozen=True, slots=True)
class Surface:
    #: The route's name in logs, metrics and the inspector's `api`.
    name: str
    #: The generating route: `POST path`.
    path: str
    #: The request body's type (validated before `plan` sees it; documented in the OpenAPI spec).
    request: type[BaseModel]
    plan: Plan
    #: Fields logged (and traced) with `--log-prompts`.
    prompt_fields: tuple[str, ...]
    #: One line for the OpenAPI operation.
    summary: str
    #: What its errors look like, before the first byte and at the end of a stream.
    wire: Wire
    inspect: Inspect | None = None
    #: Other routes (method, path) of the surface that answer on its wire.
    also: tuple[tuple[str, str], ...] = ()
    #: Whether it answers with a stream when asked (`stream: true`); else always with a JSON body.
    streams: bool = True


SURFACES: tuple[Surface, ...] = (
    Surface(
        "chat",
        "/v1/chat/completions",
        ChatCompletionRequest,
        plan_chat,
        ("messages",),
        "Create a chat completion (OpenAI Chat Completions)",
        OPENAI,
        inspect_chat,
    ),
    Surface(
        "responses",
        "/v1/responses",
        ResponsesRequest,
        plan_responses,
        ("instructions", "input"),
        "Create a response (OpenAI Responses API)",
        RESPONSES,
        inspect_responses,
        also=(("POST", "/v1/responses/input_tokens"),),
    ),
    Surface(
        "responses_compact",
        "/v1/responses/compact",
        CompactRequest,
        plan_compact,
        ("instructions", "input"),
        "Compact a conversation into a summary the model wrote (OpenAI Responses API)",
        RESPONSES,
        streams=False,
    ),
    Surface(
        "messages",
        "/v1/messages",
        MessagesRequest,
        plan_messages,
        ("messages",),
        "Create a message (Anthropic Messages API)",
        ANTHROPIC,
        inspect_messages,
        also=(("POST", "/v1/messages/count_tokens"),),
    ),
    Surface(
        "completions",
        "/v1/completions",
        CompletionRequest,
        plan_completions,
        ("prompt",),
        "Create a completion (OpenAI legacy completions)",
        OPENAI,
    ),
    Surface(
        "generate",
        "/generate",
        GenerateRequest,
        plan_generate,
        ("text", "input_ids"),
        "Generate from a raw prompt or token ids (SGLang native)",
        OPENAI,
    ),
)

#: The surfaces by their route path.
BY_PATH = {surface.path: surface for surface in SURFACES}


def route_map() -> RouteMap:
    """What traffic control and the error handlers know of the routes: the generating ones and the wire
    each answers on."""
    return RouteMap(
        generating={surface.path: surface.wire for surface in SURFACES},
        wires={route: surface.wire for surface in SURFACES for route in surface.also},
    )


__all__ = ["BY_PATH", "SURFACES", "Surface", "route_map"]
