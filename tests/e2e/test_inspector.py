"""The prompt inspector over loopback: for the same request on each surface, the ids it renders are the
ids the engine then receives (read from the simulated engine), and openai-harmony's own rendering of the
same conversation; `/v1/harmony/parse` on the parser's known repairs; keys and stored responses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import TEST_DATE, RunningGateway, client_request_id, running_gateway, test_settings

# openai-harmony's HarmonyEncoding, loaded with the offline vocabulary the gateway provisions.
ENCODING = get_encoding()
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"location": {"type": "string", "description": "City name"}},
    "required": ["location"],
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather.", "parameters": WEATHER_PARAMS},
    }
]
RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": WEATHER_PARAMS,
    }
]
MESSAGES_TOOLS = [{"name": "get_weather", "description": "Current weather.", "input_schema": WEATHER_PARAMS}]


def reference(effort: str, instructions: str | None, tools: bool, history: list[Message]) -> list[int]:
    """openai-harmony's rendering of the conversation, built here without any gateway code."""
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort[effort.upper()])
    messages = [Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(TEST_DATE))]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [ToolDescription.new("get_weather", "Current weather.", parameters=WEATHER_PARAMS)]
            )
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    return ENCODING.render_conversation_for_completion(
        Conversation.from_messages([*messages, *history]), Role.ASSISTANT
    )


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


def call(arguments: str) -> Message:
    return (
        Message.from_role_and_content(Role.ASSISTANT, arguments)
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json")
    )


def result(text: str) -> Message:
    return (
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), text)
        .with_channel("commentary")
        .with_recipient("assistant")
    )


def final(text: str) -> Message:
    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final")


ARGS = '{"location":"Paris"}'
CASES: list[tuple[str, str, dict[str, Any], list[int]]] = [
    (
        "chat-plain",
        "chat",
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "reasoning_effort": "low"},
        reference("low", None, False, [user("What is 2+2?")]),
    ),
    (
        "chat-tool-round-trip",
        "chat",
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": ARGS},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
            ],
            "tools": CHAT_TOOLS,
        },
        reference("medium", "Be terse.", True, [user("Weather in Paris?"), call(ARGS), result("18C, sunny")]),
    ),
    (
        "chat-history",
        "chat",
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Tell me a joke [[unicode]] 你好"},
            ],
            "reasoning_effort": "high",
            "max_tokens": 50,
        },
        reference(
            "high", None, False, [user("Hi"), final("Hello!"), user("Tell me a joke [[unicode]] 你好")]
        ),
    ),
    (
        "responses-plain",
        "responses",
        {"input": "What is 2+2?", "instructions": "Answer briefly.", "reasoning": {"effort": "high"}},
        reference("high", "Answer briefly.", False, [user("What is 2+2?")]),
    ),
    (
        "responses-function-output",
        "responses",
        {
            "input": [
                {"role": "user", "content": "Weather in Paris?"},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "c1", "output": "18C, sunny"},
            ],
            "tools": RESPONSES_TOOLS,
            "store": False,
        },
        reference("medium", None, True, [user("Weather in Paris?"), call(ARGS), result("18C, sunny")]),
    ),
    (
        "messages-plain",
        "messages",
        {"max_tokens": 64, "system": "Be kind.", "messages": [{"role": "user", "content": "Hello there"}]},
        reference("low", "Be kind.", False, [user("Hello there")]),
    ),
    (
        "messages-tool-round-trip",
        "messages",
        {
            "max_tokens": 64,
            "tools": MESSAGES_TOOLS,
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": "t1",
                            "name": "get_weather",
                            "input": {"location": "Paris"},
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18C, sunny"}],
                },
            ],
        },
        reference("low", None, True, [user("Weather in Paris?"), call(ARGS), result("18C, sunny")]),
    ),
]
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        yield client


@pytest.mark.parametrize(("api", "body", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_rendered_ids_are_what_the_engine_receives(
    http: httpx.AsyncClient, sim: RunningSim, api: str, body: dict[str, Any], expected: list[int]
) -> None:
    body = {"model": MODEL, **body}
    rendered = await http.post("/v1/harmony/render", json={"api": api, "request": body})
    assert rendered.status_code == 200, rendered.text
    shown = rendered.json()
    assert shown["token_ids"] == expected
    assert shown["prompt_text"] == ENCODING.decode(expected)
    assert [piece[0] for piece in shown["tokens"]] == expected
    assert sum(m["token_count"] for m in shown["messages"]) == len(expected)
    assert shown["messages"][0]["role"] == "system" and shown["messages"][-1]["generation_header"]
    assert shown["stop_token_ids"][-2:] == [200002, 200012]
    assert shown["routing"]["model_group"] == MODEL
    assert "worker" not in shown["routing"] and sim.url not in rendered.text  # the fleet is for admins

    before = len(sim.requests)
    request_id = f"inspect-{api}-{len(expected)}-{before}"
    sent = await http.post(PATHS[api], json=body, headers={"x-request-id": request_id})
    assert sent.status_code == 200, sent.text
    received = [r for r in sim.requests[before:] if client_request_id(r.request_id) == request_id]
    assert received, "the engine never saw the request"
    assert received[0].input_ids == expected
    assert received[0].sampling.get("stop_token_ids", [])[-2:] == shown["stop_token_ids"][-2:]
    if "max_new_tokens" in received[0].sampling:
        assert received[0].sampling["max_new_tokens"] == shown["sampling"]["max_new_tokens"]


async def test_render_shows_the_constraint_and_sampling(http: httpx.AsyncClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": CHAT_TOOLS,
        "tool_choice": "required",
        "temperature": 0.3,
        "stop": ["END"],
    }
    shown = (await http.post("/v1/harmony/render", json={"api": "chat", "request": body})).json()
    assert shown["sampling"]["temperature"] == pytest.approx(0.3)
    assert shown["sampling"]["stop_strings"] == ["END"]
    constraint = shown["constraint"]
    assert constraint["type"] == "structural_tag"
    tag = json.loads(constraint["value"])
    assert tag["structures"][0]["begin"].startswith("<|channel|>commentary to=functions.get_weather")
    developer = [m for m in shown["messages"] if m["role"] == "developer"]
    assert "get_weather" in developer[0]["text"]


async def test_render_of_a_chained_response_uses_the_stored_history(
    http: httpx.AsyncClient, sim: RunningSim
) -> None:
    first = await http.post("/v1/responses", json={"model": MODEL, "input": "Remember the word kiwi."})
    assert first.status_code == 200
    answer = first.json()["output"][-1]["content"][0]["text"]
    body = {"model": MODEL, "input": "Which word?", "previous_response_id": first.json()["id"]}
    shown = (await http.post("/v1/harmony/render", json={"api": "responses", "request": body})).json()
    expected = reference(
        "medium", None, False, [user("Remember the word kiwi."), final(answer), user("Which word?")]
    )
    assert shown["token_ids"] == expected
    before = len(sim.requests)
    assert (await http.post("/v1/responses", json=body)).status_code == 200
    assert sim.requests[before].input_ids == expected


async def test_bodies_get_the_same_checks_as_every_route(http: httpx.AsyncClient) -> None:
    deep: dict[str, Any] = {}
    for _ in range(140):
        deep = {"x": deep}
    for path, body in (
        ("/v1/harmony/render", {"api": "chat", "request": deep}),
        ("/v1/harmony/parse", {"text": "x", "extra": deep}),
    ):
        response = await http.post(path, json=body)
        assert response.status_code == 400
        assert "nests deeper" in response.json()["error"]["message"]
    not_json = await http.post(
        "/v1/harmony/render", content=b"{", headers={"content-type": "application/json"}
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"api": "completions", "request": {}}, "api"),
        ({"api": "chat", "request": "hi"}, "request"),
        ({"api": "chat", "request": {"model": MODEL}}, "messages"),
        (
            {"api": "chat", "request": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}},
            "model",
        ),
    ],
)
async def test_bad_render_requests_are_named_400s(
    http: httpx.AsyncClient, payload: dict[str, Any], param: str
) -> None:
    response = await http.post("/v1/harmony/render", json=payload)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param


def _ids(text: str) -> list[int]:
    return ENCODING.encode(text, allowed_special="all")


async def test_parse_canonical_output(http: httpx.AsyncClient) -> None:
    output = (
        "<|channel|>analysis<|message|>Think.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"location":"Paris"}<|call|>'
    )
    for payload in ({"token_ids": _ids(output)}, {"text": output}):
        parsed = (await http.post("/v1/harmony/parse", json=payload)).json()
        assert parsed["recoveries"] == []
        assert [(m["channel"], m["recipient"], m["text"]) for m in parsed["messages"]] == [
            ("analysis", None, "Think."),
            ("commentary", "functions.get_weather", '{"location":"Paris"}'),
        ]
        assert parsed["messages"][1]["content_type"] == "<|constrain|>json"
        assert parsed["messages"][1]["kind"] == "function_call"


@pytest.mark.parametrize(
    ("output", "kind"),
    [
        ("<|channel|>final<|message|>cut short", "unterminated_message"),
        ("<|channel|>final<|message|>Hi<|end|><|end|><|return|>", "trailing_tokens_ignored"),
        ("<|message|><|message|>this is not harmony<|start|><|end|>", "not_harmony"),
        # Text with no Harmony header at all: still the answer, but reported as repaired.
        ("I can't help with that.<|end|>", "no_header"),
        ("I can't help with that.", "no_header"),
        ("<|channel|>analysis<|message|>No.<|end|><|start|>assistant I can't help.<|end|>", "no_header"),
        (
            "<|channel|>final<|message|>x<|end|><|start|>assistant<|channel|>junk<|message|>y<|end|>",
            "unknown_channel",
        ),
    ],
)
async def test_parse_reports_what_it_repaired(http: httpx.AsyncClient, output: str, kind: str) -> None:
    parsed = (await http.post("/v1/harmony/parse", json={"token_ids": _ids(output)})).json()
    assert kind in [r["kind"] for r in parsed["recoveries"]], parsed


async def test_parse_reports_a_bare_answer_as_a_recovery_not_a_plain_answer(http: httpx.AsyncClient) -> None:
    """A refusal with no Harmony header is kept as the answer, and reported as repaired, whether it
    arrives as ids or as text with its end token spelled out."""
    output = "I can't help with that.<|end|>"
    for payload in ({"token_ids": _ids(output)}, {"text": output}):
        parsed = (await http.post("/v1/harmony/parse", json=payload)).json()
        assert [(m["kind"], m["channel"], m["text"]) for m in parsed["messages"]] == [
            ("answer", None, "I can't help with that.")
        ]
        assert {"kind": "no_header", "count": 1, "fatal": False} in parsed["recoveries"], parsed


async def test_parse_text_without_markers_uses_the_text_parser(http: httpx.AsyncClient) -> None:
    parsed = (
        await http.post("/v1/harmony/parse", json={"text": "analysisThinking.assistantfinalHello!"})
    ).json()
    assert parsed["parser"].startswith("text")
    assert [m["text"] for m in parsed["messages"]] == ["Thinking.", "Hello!"]


@pytest.mark.parametrize(
    "payload",
    [{}, {"token_ids": [1], "text": "x"}, {"token_ids": [-1]}, {"token_ids": "12"}, {"text": 5}],
)
async def test_bad_parse_requests_are_400s(http: httpx.AsyncClient, payload: dict[str, Any]) -> None:
    response = await http.post("/v1/harmony/parse", json=payload)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_keys_are_required_and_stored_responses_stay_with_their_key(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({"key-a", "key-b"}))
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        render = {"api": "chat", "request": {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}}
        for path, payload in (("/v1/harmony/render", render), ("/v1/harmony/parse", {"token_ids": [1]})):
            for headers in ({}, {"authorization": "Bearer wrong"}):
                denied = await http.post(path, json=payload, headers=headers)
                assert denied.status_code == 401
                assert denied.json()["error"]["type"] == "authentication_error"
        a = {"authorization": "Bearer key-a"}
        b = {"authorization": "Bearer key-b"}
        stored = await http.post("/v1/responses", json={"model": MODEL, "input": "secret"}, headers=a)
        follow = {
            "api": "responses",
            "request": {"model": MODEL, "input": "more", "previous_response_id": stored.json()["id"]},
        }
        assert (await http.post("/v1/harmony/render", json=follow, headers=a)).status_code == 200
        # Another key's response is answered as the real route answers an id that does not exist.
        other = await http.post("/v1/harmony/render", json=follow, headers=b)
        real = await http.post("/v1/responses", json=follow["request"], headers=b)
        missing = {**follow, "request": {**follow["request"], "previous_response_id": "resp_nope"}}
        absent = await http.post("/v1/harmony/render", json=missing, headers=b)
        assert other.status_code == real.status_code == absent.status_code == 400
        assert other.json()["error"]["code"] == real.json()["error"]["code"] == "previous_response_not_found"
        assert "secret" not in other.text
        conversation = await http.post(
            "/v1/conversations", json={"items": [{"role": "user", "content": "secret"}]}, headers=a
        )
        in_conversation = {
            "api": "responses",
            "request": {"model": MODEL, "input": "more", "conversation": conversation.json()["id"]},
        }
        mine = await http.post("/v1/harmony/render", json=in_conversation, headers=a)
        assert mine.status_code == 200 and "secret" in mine.json()["prompt_text"]
        theirs = await http.post("/v1/harmony/render", json=in_conversation, headers=b)
        assert theirs.status_code == 404 and "secret" not in theirs.text


async def test_cache_aware_routing_is_explained_without_being_recorded(sim: RunningSim) -> None:
    settings = test_settings(worker_urls=(sim.url,), policy="cache_aware")
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Cache me if you can"}]}
        render = {"api": "chat", "request": body}
        for _ in range(2):  # asking twice records nothing
            shown = (await http.post("/v1/harmony/render", json=render)).json()
            assert shown["routing"]["policy"] == "cache_aware"
            assert shown["routing"]["cache_match_tokens"] == 0
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        after = (await http.post("/v1/harmony/render", json=render)).json()
        assert after["routing"]["cache_match_tokens"] == after["token_count"]
        longer = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "Hi"}]}
        longer["messages"].append({"role": "user", "content": "again"})
        extended = (await http.post("/v1/harmony/render", json={"api": "chat", "request": longer})).json()
        shared = 0
        for a, b in zip(after["token_ids"], extended["token_ids"], strict=False):
            if a != b:
                break
            shared += 1
        assert extended["routing"]["cache_match_tokens"] == shared
