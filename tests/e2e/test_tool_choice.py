"""tool_choice that forces a call reaches the engine as a structural tag over the chosen tools only;
`auto` and `none` leave generation unconstrained (REFERENCE §2.8)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.conftest import MODEL

WEATHER = {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


def constraint(sim) -> dict | None:
    tag = sim.requests[-1].sampling.get("structural_tag")
    return json.loads(tag) if tag else None


@pytest.mark.parametrize(
    ("choice", "names"),
    [
        ("required", ["get_weather", "get_time"]),
        ({"type": "function", "function": {"name": "get_time"}}, ["get_time"]),
    ],
)
async def test_chat_forced_choice_constrains_the_call(client: openai.AsyncOpenAI, sim, choice, names) -> None:
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=CHAT_TOOLS, tool_choice=choice
    )
    tag = constraint(sim)
    assert tag is not None and tag["triggers"] == ["<|channel|>commentary to="]
    begins = [s["begin"] for s in tag["structures"]]
    assert begins == [f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>" for n in names]
    assert all(s["end"] == "<|call|>" for s in tag["structures"])
    schemas = {s["begin"].split("functions.")[1].split(" ")[0]: s["schema"] for s in tag["structures"]}
    assert schemas.get("get_time", TIME) == TIME


@pytest.mark.parametrize("choice", ["auto", "none", None])
async def test_chat_free_choice_is_unconstrained(client: openai.AsyncOpenAI, sim, choice) -> None:
    kwargs = {"tool_choice": choice} if choice else {}
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=CHAT_TOOLS, **kwargs
    )
    assert constraint(sim) is None


async def test_responses_required_is_constrained(client: openai.AsyncOpenAI, sim) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    await client.responses.create(model=MODEL, input="hi", tools=tools, tool_choice="required")
    tag = constraint(sim)
    assert tag is not None and tag["structures"][0]["schema"] == WEATHER


async def test_anthropic_tool_choice_tool_is_constrained(gateway, sim) -> None:
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="k", max_retries=0) as client:
        await client.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"name": "get_weather", "input_schema": WEATHER}],
            tool_choice={"type": "tool", "name": "get_weather"},
        )
    tag = constraint(sim)
    assert tag is not None and [s["schema"] for s in tag["structures"]] == [WEATHER]


SHOPPING = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}


def last_prompt(sim) -> str:
    from harmony_gateway.harmony.encoding import get_encoding

    return get_encoding().decode(sim.requests[-1].input_ids)


async def test_chat_json_schema_is_described_and_constrains_only_the_final(client, sim) -> None:
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "groceries"}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "shopping_list", "description": "items to buy", "schema": SHOPPING},
        },
    )
    prompt = last_prompt(sim)
    developer = prompt.split("<|start|>developer<|message|>")[1].split("<|end|>")[0]
    assert developer.startswith("# Instructions\n\nBe terse.")
    assert developer.endswith(
        "# Response Formats\n\n## shopping_list\n\n// items to buy\n"
        + json.dumps(SHOPPING, separators=(",", ":"))
    )
    tag = constraint(sim)
    assert tag["triggers"] == ["<|channel|>commentary to=", "<|channel|>final"]
    final = tag["structures"][-1]
    assert final == {
        "begin": "<|channel|>final<|constrain|>json<|message|>",
        "schema": SHOPPING,
        "end": "<|return|>",
    }


async def test_json_object_alone(client, sim) -> None:
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={"type": "json_object"}
    )
    assert r.choices[0].finish_reason == "stop"
    assert "# Response Formats\n\n## json_object" in last_prompt(sim)
    assert [s["begin"] for s in constraint(sim)["structures"]] == [
        "<|channel|>final<|constrain|>json<|message|>"
    ]


async def test_responses_text_format(client, sim) -> None:
    await client.responses.create(
        model=MODEL,
        input="groceries",
        text={"format": {"type": "json_schema", "name": "shopping_list", "schema": SHOPPING}},
    )
    assert "## shopping_list" in last_prompt(sim)
    assert constraint(sim)["structures"][0]["schema"] == SHOPPING


async def test_invalid_response_format_is_400(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], response_format={"type": "json_schema"}
        )
    assert info.value.param == "response_format.json_schema"


@pytest.mark.parametrize(
    ("api", "choice"),
    [
        # Chat nests the list; the Responses API does not.
        ("chat", {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [CHAT_TOOLS[1]]}}),
        (
            "responses",
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [{"type": "function", "name": "get_time"}],
            },
        ),
    ],
)
async def test_allowed_tools_constrain_the_call_to_the_listed_ones(
    client: openai.AsyncOpenAI, sim, api: str, choice: dict
) -> None:
    if api == "chat":
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=CHAT_TOOLS, tool_choice=choice
        )
    else:
        tools = [
            {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
            for t in CHAT_TOOLS
        ]
        await client.responses.create(model=MODEL, input="hi", tools=tools, tool_choice=choice)
    tag = constraint(sim)
    assert tag is not None
    assert [s["begin"] for s in tag["structures"]] == [
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
    ]
