"""The frameworks people put on top of the openai SDK, pointed at the gateway as a new user would point
them: openai-agents, langchain-openai and pydantic-ai; plain answers and a tool round trip, unmodified."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest

from tests.conftest import MODEL
from tests.support.servers import RunningGateway

WEATHER_QUESTION = "Use get_weather: what is the weather in Paris?"


def weather(city: str) -> str:
    return f"Sunny and 21C in {city}"


EXPECTED_ANSWER = 'The tool functions.get_weather returned: "Sunny and 21C in Paris".'


# -- openai-agents ------------------------------------------------------------------------------------


@pytest.fixture
async def agents_model(gateway: RunningGateway) -> AsyncIterator[object]:
    from agents import OpenAIChatCompletionsModel, set_tracing_disabled

    set_tracing_disabled(True)
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="test", max_retries=0) as client:
        yield OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


async def test_openai_agents_plain_question(agents_model: object) -> None:
    from agents import Agent, Runner

    agent = Agent(name="Assistant", instructions="You are helpful.", model=agents_model)  # type: ignore[arg-type]
    result = await Runner.run(agent, "What is the capital of France?")
    assert result.final_output == 'You said: "What is the capital of France?". This is a simulated answer.'


async def test_openai_agents_function_tool(agents_model: object) -> None:
    from agents import Agent, Runner, function_tool

    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return weather(city)

    agent = Agent(name="Assistant", instructions="Use tools.", model=agents_model, tools=[get_weather])  # type: ignore[arg-type]
    result = await Runner.run(agent, WEATHER_QUESTION)
    assert calls == ["Paris"]
    assert result.final_output == EXPECTED_ANSWER


async def test_openai_agents_streamed_tool_run(agents_model: object) -> None:
    from agents import Agent, Runner, function_tool

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return weather(city)

    agent = Agent(name="Assistant", model=agents_model, tools=[get_weather])  # type: ignore[arg-type]
    result = Runner.run_streamed(agent, WEATHER_QUESTION)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds
    assert result.final_output == EXPECTED_ANSWER


# -- langchain-openai ---------------------------------------------------------------------------------


def chat_openai(gateway: RunningGateway) -> object:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=gateway.base_url, api_key="test", model=MODEL, max_retries=0)  # type: ignore[arg-type]


async def test_langchain_invoke_and_stream(gateway: RunningGateway) -> None:
    llm = chat_openai(gateway)
    message = await llm.ainvoke("What is the capital of France?")  # type: ignore[attr-defined]
    assert message.content == 'You said: "What is the capital of France?". This is a simulated answer.'
    pieces = [chunk async for chunk in llm.astream("What is the capital of France?")]  # type: ignore[attr-defined]
    assert len(pieces) > 3
    assert "".join(p.content for p in pieces if isinstance(p.content, str)) == message.content


async def test_langchain_bind_tools_round_trip(gateway: RunningGateway) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return weather(city)

    llm = chat_openai(gateway).bind_tools([get_weather])  # type: ignore[attr-defined]
    messages: list[object] = [HumanMessage(WEATHER_QUESTION)]
    ai = await llm.ainvoke(messages)
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    assert call["id"].startswith("call_")
    messages += [ai, ToolMessage(content=get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = await llm.ainvoke(messages)
    assert final.content == EXPECTED_ANSWER
    assert not final.tool_calls


async def test_langchain_streamed_tool_call(gateway: RunningGateway) -> None:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return weather(city)

    llm = chat_openai(gateway).bind_tools([get_weather])  # type: ignore[attr-defined]
    merged = None
    async for chunk in llm.astream(WEATHER_QUESTION):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    [call] = merged.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})


# -- pydantic-ai --------------------------------------------------------------------------------------


def pydantic_model(gateway: RunningGateway) -> object:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=gateway.base_url, api_key="test"))


async def test_pydantic_ai_plain_run(gateway: RunningGateway) -> None:
    from pydantic_ai import Agent

    agent = Agent(pydantic_model(gateway), instructions="Be concise.")  # type: ignore[call-overload]
    result = await agent.run("What is the capital of France?")
    assert result.output == 'You said: "What is the capital of France?". This is a simulated answer.'


async def test_pydantic_ai_tool_run(gateway: RunningGateway) -> None:
    from pydantic_ai import Agent

    agent = Agent(pydantic_model(gateway))  # type: ignore[call-overload]
    calls: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return weather(city)

    result = await agent.run(WEATHER_QUESTION)
    assert calls == ["Paris"]
    assert result.output == EXPECTED_ANSWER
    tool_returns = [
        part.content
        for message in result.all_messages()
        for part in getattr(message, "parts", ())
        if getattr(part, "part_kind", "") == "tool-return"
    ]
    assert tool_returns == [weather("Paris")]


async def test_pydantic_ai_streamed_run(gateway: RunningGateway) -> None:
    from pydantic_ai import Agent

    agent = Agent(pydantic_model(gateway))  # type: ignore[call-overload]
    async with agent.run_stream("What is the capital of France?") as run:
        text = [piece async for piece in run.stream_text(delta=True)]
    assert "".join(text) == 'You said: "What is the capital of France?". This is a simulated answer.'
    assert json.dumps(text)  # plain strings
