"""Chat Completions mapped to a Harmony turn: messages (content parts, tool calls, tool results, restored
analysis) become the history, `tools` and `tool_choice` the developer message's function tools."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ...errors import InvalidRequest
from ...harmony.messages import Msg, parse_reasoning_effort, tool_result, user
from ...observability.tracing import traced
from ...pipeline.context import GatewayState, PreparedRequest
from ...pipeline.prepare import (
    HarmonyTurn,
    apply_tool_choice,
    forces_tool_call,
    prepare_harmony,
    request_sampling,
    response_format_of,
    stop_strings,
)
from ...pipeline.reasoning_store import AssistantTurn, recall_analyses, restorable_turns, turn_remembering
from ...routing.fleet import ModelGroup
from ..harmony_history import HarmonyHistory
from .content import chat_function_tools, text_of
from .template import prepare_chat_template
from .types import ChatCompletionRequest, ChatMessage


def chat_history(
    messages: Sequence[ChatMessage], restored: dict[int, str] | None = None
) -> tuple[str | None, list[Msg]]:
    """Chat messages → (instructions, Harmony history). REFERENCE §2.3: leading system/developer
    messages become the developer message's instructions; later ones a developer message in place.
    `restored` maps an assistant message's index to the analysis to render when it has none of its own
    (`restorable_turns`)."""
    call_names: dict[str, str] = {}
    for message in messages:
        for call in message.tool_calls or ():
            call_names[call.id] = call.function.name

    history = HarmonyHistory([])
    for i, message in enumerate(messages):
        role = message.role
        param = f"messages[{i}].content"
        if role in ("system", "developer"):
            history.system(text_of(message.content, param=param))
        elif role == "user":
            history.add(user(text_of(message.content, param=param)))
        elif role == "assistant":
            reasoning = message.reasoning_content or message.reasoning or (restored or {}).get(i)
            history.assistant_turn(
                [reasoning] if reasoning else [],
                text_of(message.content, param=param, allow_refusal=True),
                [(call.function.name, call.function.arguments or "") for call in message.tool_calls or ()],
            )
        else:  # tool, or the legacy function role
            name = call_names.get(message.tool_call_id or "") or message.name
            if not name:
                raise InvalidRequest(
                    "tool message refers to an unknown tool_call_id and has no name",
                    param=f"messages[{i}].tool_call_id",
                )
            history.add(tool_result("functions." + name, text_of(message.content, param=param)))
    return history.result()


def assistant_turns(messages: Sequence[ChatMessage]) -> Iterator[AssistantTurn]:
    """The assistant messages of a chat history, as reasoning restore reads them."""
    for i, message in enumerate(messages):
        if message.role != "assistant":
            continue
        calls = [call.id for call in message.tool_calls or ()]
        yield AssistantTurn(
            index=i,
            call_ids=calls,
            answers=not calls
            and bool(text_of(message.content, param=f"messages[{i}].content", allow_refusal=True)),
            has_reasoning=bool(message.reasoning_content or message.reasoning),
        )


def chat_turn(request: ChatCompletionRequest, group: ModelGroup, restored: dict[int, str]) -> HarmonyTurn:
    """Chat Completions → one Harmony turn (`restored`: analyses recalled for earlier tool-call turns)."""
    if request.logprobs or request.top_logprobs:
        raise InvalidRequest("logprobs are not supported for Harmony models", param="logprobs")
    if request.ignore_eos:
        raise InvalidRequest(
            "ignore_eos is not supported for Harmony models: stop tokens are the protocol", param="ignore_eos"
        )
    tools = apply_tool_choice(chat_function_tools(request), request.tool_choice)
    instructions, history = chat_history(request.messages, restored)
    return HarmonyTurn(
        effort=parse_reasoning_effort(request.reasoning_effort, param="reasoning_effort"),
        instructions=instructions,
        history=history,
        sampling=request_sampling(group, request, seed=request.seed),
        tools=tuple(tools),
        response_format=response_format_of(request.response_format, param="response_format", nested=True),
        forces_call=forces_tool_call(request.tool_choice),
        max_tokens=request.max_completion_tokens or request.max_tokens,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        stop_strings=stop_strings(request.stop),
        n=request.n,
        stream=request.stream,
        max_reasoning_tokens=request.max_reasoning_tokens,
    )


@traced("gateway.prepare")
async def prepare_chat(
    state: GatewayState, request: ChatCompletionRequest, group: ModelGroup, *, owner: str
) -> PreparedRequest:
    """Validate and render a chat request for tenant `owner` (`ctx.owner`), whose analyses of earlier
    tool-call turns are restored; raises InvalidRequest naming the field."""
    if not group.harmony:
        return await prepare_chat_template(state, request, group)
    restored = await recall_analyses(state, owner, restorable_turns(assistant_turns(request.messages)))
    prepared = await prepare_harmony(state, group, chat_turn(request, group, restored))
    prepared.after_turn = turn_remembering(state, owner)
    return prepared
