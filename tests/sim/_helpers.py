"""Prompt rendering, request building and stream collection for the simulated-engine tests."""

from __future__ import annotations

from collections.abc import Sequence

from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    Role,
    SystemContent,
    ToolDescription,
)
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import vllm_engine_pb2 as vl

from harmony_gateway.harmony.encoding import get_encoding

HARMONY_STOPS = [200002, 200012]

WEATHER_TOOL = ToolDescription.new(
    "get_weather",
    "Get weather",
    parameters={
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City"},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "days": {"type": "integer"},
        },
        "required": ["location"],
    },
)


def render(*messages: Message) -> list[int]:
    return get_encoding().render_conversation_for_completion(
        Conversation.from_messages(
            [Message.from_role_and_content(Role.SYSTEM, SystemContent.new()), *messages]
        ),
        Role.ASSISTANT,
    )


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def developer_with_tools(*tools: ToolDescription) -> Message:
    return Message.from_role_and_content(
        Role.DEVELOPER, DeveloperContent.new().with_function_tools(list(tools))
    )


def tool_result(name: str, text: str) -> Message:
    return (
        Message.from_author_and_content(Author.new(Role.TOOL, name), text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def parse(ids: Sequence[int]) -> list[Message]:
    return get_encoding().parse_messages_from_completion_tokens(list(ids), Role.ASSISTANT, strict=False)


def sg_request(
    ids: Sequence[int],
    *,
    request_id: str = "req-1",
    stream: bool = False,
    **sampling: object,
) -> sg.GenerateRequest:
    params = sg.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, n=1, stop_token_ids=HARMONY_STOPS)
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(params, name)[:] = value
        else:
            setattr(params, name, value)
    return sg.GenerateRequest(
        request_id=request_id,
        tokenized=sg.TokenizedInput(input_ids=list(ids)),
        sampling_params=params,
        stream=stream,
    )


def vl_request(
    ids: Sequence[int],
    *,
    request_id: str = "req-1",
    stream: bool = False,
    **sampling: object,
) -> vl.GenerateRequest:
    params = vl.SamplingParams(temperature=1.0, top_p=1.0, n=1, stop_token_ids=HARMONY_STOPS)
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(params, name)[:] = value
        else:
            setattr(params, name, value)
    return vl.GenerateRequest(
        request_id=request_id,
        tokenized=vl.TokenizedInput(input_ids=list(ids)),
        sampling_params=params,
        stream=stream,
    )


async def collect(call: object) -> list:
    return [response async for response in call]  # type: ignore[attr-defined]


async def drain(call: object, into: list) -> None:
    """Append responses as they arrive, so a caller still sees them when the call ends in an error."""
    async for response in call:  # type: ignore[attr-defined]
        into.append(response)  # one by one: a comprehension would lose what arrived before an error
