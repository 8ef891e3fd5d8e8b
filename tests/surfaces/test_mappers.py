"""Each surface's mapper as data: a request in, its Harmony turn (instructions, history messages with
their channels and recipients, tools, effort) or its prompt ids out. No server, no engine.

tests/pipeline/test_harmony_turn.py checks the fields the Chat and Messages mappers own and that both
render as openai-harmony does; tests/harmony/test_render.py renders the Chat matrix. Here a reader sees
one whole conversation per surface mapped, message by message."""

from __future__ import annotations

from typing import Any

import pytest
from openai_harmony import ReasoningEffort

from harmony_gateway.engines.base import SamplingOptions
from harmony_gateway.errors import InvalidRequest
from harmony_gateway.harmony.encoding import CALL, MESSAGE, RETURN, START, VOCAB_SIZE
from harmony_gateway.harmony.messages import JSON_CONTENT_TYPE, Msg
from harmony_gateway.pipeline.raw_prompt import encode_prompt, raw_prepared
from harmony_gateway.surfaces.chat.mapper import chat_turn
from harmony_gateway.surfaces.chat.types import ChatCompletionRequest
from harmony_gateway.surfaces.messages.mapper import anthropic_tools, messages_turn
from harmony_gateway.surfaces.messages.types import MessagesRequest
from harmony_gateway.surfaces.responses.mapper import call_names_of, items_to_messages, normalize_items
from harmony_gateway.surfaces.responses.plan import prepare_responses
from harmony_gateway.surfaces.responses.types import ResponsesRequest
from tests.harmony.test_render import (
    WEATHER_PARAMS,
    WEATHER_TOOL,
    assert_same,
    call,
    developer,
    expected,
    model_group,
    system,
    tool_output,
    user,
    weather_description,
)
from tests.surfaces._support import MODEL, harmony_ids, openai_context, serving_state

CALL_ARGUMENTS = '{"city":"Paris"}'


def weather_call(arguments: str = CALL_ARGUMENTS) -> Msg:
    """The assistant's call of `get_weather`, as every surface maps it."""
    return Msg(
        "assistant",
        arguments,
        channel="commentary",
        recipient="functions.get_weather",
        content_type=JSON_CONTENT_TYPE,
    )


def weather_result(text: str) -> Msg:
    """The tool's answer to that call, authored by the function and addressed to the assistant."""
    return Msg("tool", text, channel="commentary", recipient="assistant", name="functions.get_weather")


# -- Chat Completions ---------------------------------------------------------------------------------
def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, **body})


CHAT_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "developer", "content": [{"type": "text", "text": "Use metric units."}]},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "reasoning_content": "I need the weather tool.",
        "content": "Checking.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": CALL_ARGUMENTS},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
    {"role": "assistant", "content": "18C and sunny."},
    {"role": "system", "content": "Answer in French from now on."},
    {"role": "user", "content": "And tomorrow?"},
]


def test_chat_maps_a_conversation_message_by_message() -> None:
    turn = chat_turn(
        chat(messages=CHAT_CONVERSATION, tools=[WEATHER_TOOL], reasoning_effort="low"), model_group(), {}
    )
    assert turn.effort == "low"
    assert turn.instructions == "Be brief.\n\nUse metric units."  # leading system and developer messages
    assert turn.history == [
        Msg("user", "Weather in Paris?"),
        # The call turn's analysis is before the last final answer: Harmony drops it.
        Msg("assistant", "Checking.", channel="commentary"),  # a preamble before the call
        weather_call(),
        weather_result("18C, sunny"),
        Msg("assistant", "18C and sunny.", channel="final"),
        Msg(
            "developer", "# Instructions\n\nAnswer in French from now on."
        ),  # a later system message, in place
        Msg("user", "And tomorrow?"),
    ]
    assert [(tool.name, tool.parameters) for tool in turn.tools] == [("get_weather", WEATHER_PARAMS)]
    assert not turn.forces_call


def test_chat_keeps_the_analysis_of_a_call_still_being_answered() -> None:
    turn = chat_turn(chat(messages=CHAT_CONVERSATION[2:5], tools=[WEATHER_TOOL]), model_group(), {})
    assert turn.instructions is None
    assert turn.effort == "medium"
    assert turn.history == [
        Msg("user", "Weather in Paris?"),
        Msg("assistant", "I need the weather tool.", channel="analysis"),
        Msg("assistant", "Checking.", channel="commentary"),
        weather_call(),
        weather_result("18C, sunny"),
    ]


def test_chat_renders_an_analysis_restored_for_a_call_turn_without_its_own() -> None:
    """`restored` (recalled by the call ids the gateway issued) stands in for reasoning the client did
    not send back."""
    messages = [
        {**message, "reasoning_content": None} if message["role"] == "assistant" else message
        for message in CHAT_CONVERSATION[2:5]
    ]
    turn = chat_turn(chat(messages=messages), model_group(), {1: "the kept analysis"})
    assert turn.history[1] == Msg("assistant", "the kept analysis", channel="analysis")


# -- Anthropic Messages -------------------------------------------------------------------------------
WEATHER = {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_PARAMS}


def messages(**body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": MODEL, "max_tokens": 256, **body})


def test_messages_maps_a_conversation_block_by_block() -> None:
    request = messages(
        system=[{"type": "text", "text": "Be brief."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I need the weather tool.", "signature": "client-sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C, sunny"},
                    {"type": "text", "text": "And in Lyon?"},
                ],
            },
        ],
        tools=[WEATHER],
        thinking={"type": "enabled", "budget_tokens": 2048},
    )
    turn = messages_turn(request, model_group(), anthropic_tools(request, unbacked="drop", metrics=None), {})
    assert turn.instructions == "Be brief."
    assert turn.history == [
        Msg("user", "Weather in Paris?"),
        Msg("assistant", "I need the weather tool.", channel="analysis"),  # no final after it: kept
        Msg("assistant", "Checking.", channel="commentary"),
        weather_call(),
        weather_result("18C, sunny"),
        Msg("user", "And in Lyon?"),
    ]
    assert [tool.name for tool in turn.tools] == ["get_weather"]
    assert turn.max_reasoning_tokens == 2048
    assert (turn.max_tokens, turn.stop_strings, turn.forces_call) == (256, (), False)


def test_messages_maps_a_final_answer_and_drops_the_analysis_before_it() -> None:
    request = messages(
        messages=[
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "greet", "signature": "s"},
                    {"type": "text", "text": "Hello!"},
                ],
            },
            {"role": "user", "content": "Bye"},
        ]
    )
    turn = messages_turn(request, model_group(), [], {})
    assert turn.instructions is None
    assert turn.history == [
        Msg("user", "Hi"),
        Msg("assistant", "Hello!", channel="final"),
        Msg("user", "Bye"),
    ]


@pytest.mark.parametrize(
    ("thinking", "effort", "budget"),
    [
        (None, "low", None),  # thinking off: gpt-oss still reasons, as little as it can
        ({"type": "adaptive"}, "medium", None),
        ({"type": "enabled", "budget_tokens": 1024}, "low", 1024),
        ({"type": "enabled", "budget_tokens": 8000}, "medium", 8000),
        ({"type": "enabled", "budget_tokens": 32000}, "high", 32000),
    ],
)
def test_messages_thinking_sets_the_effort_and_the_reasoning_budget(
    thinking: dict[str, Any] | None, effort: str, budget: int | None
) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
    if thinking is not None:
        body["thinking"] = thinking
    turn = messages_turn(messages(**body), model_group(), [], {})
    assert (turn.effort, turn.max_reasoning_tokens) == (effort, budget)


# -- Responses ----------------------------------------------------------------------------------------
RESPONSES_INPUT: list[dict[str, Any]] = [
    {"role": "developer", "content": "Use metric units."},
    {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "I need the weather tool."}],
    },
    {
        "type": "message",
        "role": "assistant",
        "phase": "commentary",
        "content": [{"type": "output_text", "text": "Checking."}],
    },
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": CALL_ARGUMENTS},
    {"type": "function_call_output", "call_id": "call_1", "output": "18C, sunny"},
]


def test_responses_maps_input_items_to_harmony_messages() -> None:
    items = normalize_items(RESPONSES_INPUT)
    leading: list[str] = []
    turn = items_to_messages(items, call_names_of(items), leading_instructions=leading)
    assert leading == ["Use metric units."]  # joined to the request's `instructions`
    assert turn == [
        Msg("user", "Weather in Paris?"),
        Msg("assistant", "I need the weather tool.", channel="analysis"),
        Msg("assistant", "Checking.", channel="commentary"),
        weather_call(),
        weather_result("18C, sunny"),
    ]


def test_responses_maps_text_input_and_a_final_answer() -> None:
    (item,) = normalize_items("Hi")
    assert (item["type"], item["role"], item["content"]) == (
        "message",
        "user",
        [{"type": "input_text", "text": "Hi"}],
    )
    answered = [{"role": "assistant", "content": "Hello!"}, {"role": "system", "content": "Be brief."}]
    assert items_to_messages(normalize_items(answered), {}) == [
        Msg("assistant", "Hello!", channel="final"),
        Msg("developer", "# Instructions\n\nBe brief."),  # not leading: in place
    ]


def test_responses_refuses_an_output_for_an_unknown_call() -> None:
    items = normalize_items([{"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    with pytest.raises(InvalidRequest) as caught:
        items_to_messages(items, call_names_of(items))
    assert caught.value.param == "input[0].call_id"


async def test_responses_render_the_request_as_openai_harmony_does() -> None:
    request = ResponsesRequest.model_validate(
        {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": RESPONSES_INPUT[1:2] + RESPONSES_INPUT[4:],
            "tools": [
                {
                    "type": "function",
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": WEATHER_PARAMS,
                }
            ],
            "reasoning": {"effort": "high"},
            "store": False,
        }
    )
    plan = await prepare_responses(serving_state(), request, openai_context("responses"))
    want = expected(
        system(ReasoningEffort.HIGH),
        developer("Be brief.", [weather_description()]),
        user("Weather in Paris?"),
        call("get_weather", CALL_ARGUMENTS),
        tool_output("get_weather", "18C, sunny"),
    )
    assert_same(plan.prepared.input_ids, want)
    assert plan.prepared.effort == "high"
    assert plan.prepared.function_names == frozenset({"get_weather"})
    assert plan.prepared.sampling.stop_token_ids == [RETURN, CALL]


# -- /generate and /v1/completions: raw prompts -------------------------------------------------------
def test_a_text_prompt_encodes_special_token_text_as_special_tokens() -> None:
    prompt = "<|start|>user<|message|>Hi<|end|><|start|>assistant"
    ids = encode_prompt(serving_state(), model_group(), prompt, param="prompt")
    assert ids == harmony_ids(prompt)
    assert ids[0] == START and MESSAGE in ids


def test_a_token_prompt_passes_through_and_must_fit_the_vocabulary() -> None:
    assert encode_prompt(serving_state(), model_group(), [1, 2, 3], param="prompt") == [1, 2, 3]
    with pytest.raises(InvalidRequest) as caught:
        encode_prompt(serving_state(), model_group(), [1, VOCAB_SIZE], param="prompt[1]")
    assert caught.value.param == "prompt[1]"
    empty_prompts: tuple[str | list[int], ...] = ("", [])
    for empty in empty_prompts:
        with pytest.raises(InvalidRequest):
            encode_prompt(serving_state(), model_group(), empty, param="prompt")


def test_a_raw_prompt_stops_at_the_assistant_stop_tokens_too() -> None:
    prepared = raw_prepared(
        serving_state(),
        model_group(),
        [1, 2, 3],
        SamplingOptions(stop_token_ids=[CALL, 42]),  # the client's own, one of them a Harmony stop
        requested_tokens=16,
        stream=True,
        return_logprob=False,
        top_logprobs=0,
        original_text="abc",
        param="prompt",
    )
    assert prepared.sampling.stop_token_ids == [CALL, 42, RETURN]
    assert prepared.sampling.max_new_tokens == 16
    assert (prepared.input_ids, prepared.harmony, prepared.stream) == ([1, 2, 3], True, True)
    assert prepared.history == [] and prepared.prefix is None  # no conversation is built
