"""The surface table: one row per API surface, the only place that lists them.

A row names the surface's route and request type and points at its plan (request -> a
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
from .chat.run import inspect_chat, plan_chat
from .chat.types import ChatCompletionRequest
from .completions.run import plan_completions
from .completions.types import CompletionRequest
from .generate.run import plan_generate
from .generate.types import GenerateRequest
from .messages.run import inspect_messages, plan_messages
from .messages.types import MessagesRequest
from .responses.service.service import inspect_responses, plan_responses
from .responses.types import ResponsesRequest

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
    inspect: Inspect | None = None


SURFACES: tuple[Surface, ...] = (
    Surface(
        "chat",
        "/v1/chat/completions",
        ChatCompletionRequest,
        plan_chat,
        ("messages",),
        "Create a chat completion (OpenAI Chat Completions)",
        inspect_chat,
    ),
    Surface(
        "responses",
        "/v1/responses",
        ResponsesRequest,
        plan_responses,
        ("instructions", "input"),
        "Create a response (OpenAI Responses API)",
        inspect_responses,
    ),
    Surface(
        "messages",
        "/v1/messages",
        MessagesRequest,
        plan_messages,
        ("messages",),
        "Create a message (Anthropic Messages API)",
        inspect_messages,
    ),
    Surface(
        "completions",
        "/v1/completions",
        CompletionRequest,
        plan_completions,
        ("prompt",),
        "Create a completion (OpenAI legacy completions)",
    ),
    Surface(
        "generate",
        "/generate",
        GenerateRequest,
        plan_generate,
        ("text", "input_ids"),
        "Generate from a raw prompt or token ids (SGLang native)",
    ),
)

#: The surfaces by their route path.
BY_PATH = {surface.path: surface for surface in SURFACES}


__all__ = ["BY_PATH", "SURFACES", "Surface"]
