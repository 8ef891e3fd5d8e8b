"""Runs a Messages request: the mapper's Harmony turn (or the chat-template path) through the shared
driver, framed as Anthropic's JSON body or stream; and `count_tokens`, the same prompt counted."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from ...errors import InvalidRequest
from ...pipeline.context import GatewayState, RequestContext
from ...pipeline.drive import collect, drive, open_generation
from ...pipeline.parse_output import ChoiceOutput
from ...pipeline.text_output import TextChoiceOutput, text_parser_stats
from ..chat.upstream import is_text_group
from .framer import MessagesFramer, anthropic_usage, stop_reason
from .mapper import prepare_messages, resolve_group
from .types import CountTokensRequest, MessagesRequest


async def count_message_tokens(
    state: GatewayState, request: CountTokensRequest, *, owner: str
) -> dict[str, int]:
    group = resolve_group(state, request.model)
    if not group.harmony and is_text_group(group):
        raise InvalidRequest(
            f"POST /v1/messages/count_tokens is not available for model {group.name!r}: it is served by an "
            "HTTP upstream, whose chat template the gateway does not render",
            param="model",
        )
    plan = await prepare_messages(state, request, group, owner=owner)
    return {"input_tokens": len(plan.prepared.input_ids)}


async def run_messages(
    state: GatewayState, request: MessagesRequest, ctx: RequestContext
) -> dict[str, Any] | AsyncGenerator[bytes, None]:
    """A Message body, or the SSE byte stream; raises GatewayError before any output."""
    group = resolve_group(state, request.model)
    ctx.model = group.name
    plan = await prepare_messages(state, request, group, owner=ctx.owner)
    prepared = plan.prepared
    ctx.prompt_tokens = len(prepared.input_ids)
    choice: ChoiceOutput | TextChoiceOutput
    if prepared.output_adapter is not None:  # other models, HTTP upstreams: text output
        choice = TextChoiceOutput(state, prepared, 0)
        ctx.text_stats = text_parser_stats([choice])
    else:
        choice = ChoiceOutput(state, prepared, 0)
        ctx.parsers = [choice.parser]
    choice.include_reasoning = plan.show_thinking
    # Streaming from the engine lets the gateway stop early on a client stop sequence.
    engine_stream = request.stream or bool(prepared.stop_strings)
    source = await open_generation(state, prepared, ctx, stream=engine_stream)
    message_id = "msg_" + ctx.request_id
    framer = MessagesFramer(
        message_id, group.name, prepared, ctx, choice, stream=request.stream, sign=plan.sign
    )
    if request.stream:
        return drive(ctx, source, framer)
    await collect(ctx, source, framer)
    blocks = framer.blocks
    blocks.push(choice.close())
    blocks.close()
    if prepared.after_turn is not None:
        await prepared.after_turn(choice)  # hook: restorable analysis of tool-call turns
    reason, sequence = stop_reason(choice, prepared.stop_strings)
    usage = anthropic_usage(choice, prepared, ctx)
    ctx.completion_tokens = usage["output_tokens"]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": group.name,
        "content": blocks.blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage,
    }
