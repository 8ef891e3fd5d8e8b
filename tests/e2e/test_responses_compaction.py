"""Compaction over real HTTP, the official SDK and the gRPC sim: `POST /v1/responses/compact` turns a
conversation (input items or a `previous_response_id` chain) into its user messages and one `compaction`
item whose sealed summary the model wrote; fed back, it renders as the summary (the engine sees a shorter
prompt that still carries the conversation's facts) and the model answers from it. `context_management`
compacts a response's own conversation first when its prompt passes the threshold, in stored chains
too. A changed, foreign-tenant or reasoning blob is a 400 naming the item's `encrypted_content`, and bad
input on the new fields a 400 naming its param. Bodies and events validate against OpenAI's schemas."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.surfaces.responses.compaction import COMPACTION_REQUEST, SUMMARY_HEADER
from tests.conftest import MODEL
from tests.e2e.test_reasoning_tenants import KEY_A, KEY_B, http_as
from tests.support.published_schemas import assert_valid, assert_valid_events, assert_valid_response
from tests.support.responses_stream import validate_event_stream
from tests.support.servers import RunningGateway, running_gateway, test_settings

FACT = "My code word is pineapple."
#: A tool output of some 1,600 tokens: what compaction is for.
LOG = " ".join(f"Reading {n}: the sensor on line {n} reports nominal values." for n in range(120))


def conversation() -> list[dict[str, Any]]:
    """A stateless history: a fact, an answer, a tool call with a long output, and the answer to it."""
    return [
        {"role": "user", "content": FACT},
        {
            "type": "message",
            "id": "msg_noted",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Noted.", "annotations": [], "logprobs": []}],
        },
        {"role": "user", "content": "Read the sensor log with read_log."},
        {"type": "function_call", "call_id": "call_log", "name": "read_log", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_log", "output": LOG},
        {
            "type": "message",
            "id": "msg_nominal",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "All nominal.", "annotations": [], "logprobs": []}],
        },
    ]


def conversation_items() -> list[dict[str, Any]]:
    """`conversation()` as a conversation stores it: the items themselves, with their ids."""
    items = conversation()
    for n, item in enumerate(items):
        if item.get("role") == "user":
            items[n] = {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": item["content"]}],
            }
    return items


def prompt(sim: RunningSim, index: int) -> str:
    return get_encoding().decode(sim.requests[index].input_ids)


async def compact_raw(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    assert_valid("CompactResponseMethodPublicBody", body)
    r = await http.post("/responses/compact", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    assert_valid("CompactResource", data)
    return data


@pytest.fixture
async def two_tenants(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    settings = test_settings(worker_urls=(sim.url,), api_keys=frozenset({KEY_A, KEY_B}))
    async with running_gateway(settings) as gw:
        yield gw


@pytest.fixture
async def http(gateway: RunningGateway) -> Any:
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30) as c:
        yield c


async def test_compact_then_feed_back_then_answer(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, sim: RunningSim
) -> None:
    start = len(sim.requests)
    raw = await compact_raw(http, {"model": MODEL, "input": conversation()})
    assert raw["object"] == "response.compaction" and raw["id"].startswith("resp_")
    *users, item = raw["output"]
    # Every user message, as it was, then one compaction item (OpenAI's compacted window).
    assert [u["content"][0]["text"] for u in users] == [FACT, "Read the sensor log with read_log."]
    assert all(u["type"] == "message" and u["role"] == "user" for u in users)
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert "pineapple" not in item["encrypted_content"]  # sealed, not the summary in the clear
    # The summary is the model's answer to the conversation followed by the request for a summary.
    summary_prompt = prompt(sim, start)
    assert summary_prompt.rstrip().endswith(f"{COMPACTION_REQUEST}<|end|><|start|>assistant")
    assert LOG in summary_prompt
    usage = raw["usage"]
    assert usage["input_tokens"] == len(sim.requests[start].input_ids)
    assert (
        usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )

    # The SDK decodes it, and its output goes back as input with the next question.
    compacted = await client.responses.compact(model=MODEL, input=conversation())  # type: ignore[arg-type]
    assert compacted.object == "response.compaction"
    assert compacted.output[-1].type == "compaction"
    fed = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
    question = {"role": "user", "content": "What is my code word?"}
    before = len(sim.requests)
    answered = await client.responses.create(model=MODEL, input=[*fed, question])  # type: ignore[list-item]
    assert answered.status == "completed" and answered.output_text
    seen = prompt(sim, before)
    assert f"<|start|>developer<|message|>{SUMMARY_HEADER}" in seen
    assert "pineapple" in seen.split(SUMMARY_HEADER, 1)[1]  # the fact travels in the summary
    assert LOG not in seen and "All nominal." not in seen  # what the summary stands for is gone
    assert seen.index(FACT) < seen.index(SUMMARY_HEADER) < seen.index("What is my code word?")

    # The same question over the whole history costs more prompt tokens than over the compacted one.
    full = await client.responses.create(model=MODEL, input=[*conversation(), question])  # type: ignore[list-item]
    assert answered.usage is not None and full.usage is not None
    assert answered.usage.input_tokens < full.usage.input_tokens / 3
    assert answered.usage.input_tokens == len(sim.requests[before].input_ids)


async def test_compact_a_stored_chain(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    first = await client.responses.create(model=MODEL, input=FACT)
    second = await client.responses.create(
        model=MODEL, input=f"Now some noise: {LOG}", previous_response_id=first.id
    )
    compacted = await client.responses.compact(model=MODEL, previous_response_id=second.id)
    texts = [item.content[0].text for item in compacted.output if item.type == "message"]  # type: ignore[union-attr]
    assert texts == [FACT, f"Now some noise: {LOG}"]
    assert compacted.output[-1].type == "compaction"
    # A new chain starts from the compacted window, without previous_response_id.
    before = len(sim.requests)
    fed = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]
    answered = await client.responses.create(
        model=MODEL,
        input=[*fed, {"role": "user", "content": "And the code word?"}],  # type: ignore[list-item]
    )
    assert answered.status == "completed"
    seen = prompt(sim, before)
    assert SUMMARY_HEADER in seen and "This is a simulated answer" not in seen  # old answers are summarised


async def test_a_conversation_longer_than_the_context_is_summarised_from_its_newest_part() -> None:
    """Compaction is for conversations near the context's end: one past it loses its oldest messages to
    the summary's room instead of failing."""
    async with (
        await start_sim_engine(SimConfig(model=MODEL, max_context_length=4096)) as small,
        running_gateway(test_settings(worker_urls=(small.url,))) as gw,
        httpx.AsyncClient(base_url=gw.base_url, timeout=30) as http,
    ):
        long = [*conversation(), {"role": "user", "content": LOG}, {"role": "user", "content": LOG}]
        r = await http.post("/responses", json={"model": MODEL, "input": long})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        raw = await compact_raw(http, {"model": MODEL, "input": long})
        assert raw["output"][-1]["type"] == "compaction"
        [asked] = small.requests
        assert len(asked.input_ids) <= 4096 - 1024  # the summary's room: a quarter of the context
        assert COMPACTION_REQUEST in get_encoding().decode(asked.input_ids)


async def test_changed_or_foreign_compaction_items_are_refused(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, gateway: RunningGateway
) -> None:
    raw = await compact_raw(http, {"model": MODEL, "input": conversation()})
    item = raw["output"][-1]
    sealed = item["encrypted_content"]
    flipped = sealed[:-3] + ("A" if sealed[-3] != "A" else "B") + sealed[-2:]
    # A reasoning blob is sealed under another purpose: it never opens as a summary.
    reasoning = await client.responses.create(
        model=MODEL, input="hello", include=["reasoning.encrypted_content"], store=False
    )
    [thought] = [i for i in reasoning.output if i.type == "reasoning"]
    for bad in (flipped, "hg1.AAAA", "not sealed here", thought.encrypted_content):
        r = await http.post(
            "/responses",
            json={
                "model": MODEL,
                "input": [{"role": "user", "content": "hi"}, {**item, "encrypted_content": bad}],
            },
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input[1].encrypted_content"
    # Without its encrypted_content it is no compaction item at all.
    r = await http.post("/responses", json={"model": MODEL, "input": [{"type": "compaction", "id": "cmp_1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].encrypted_content"
    # The untouched item still works.
    ok = await http.post(
        "/responses", json={"model": MODEL, "input": [item, {"role": "user", "content": "hi"}]}
    )
    assert ok.status_code == 200, ok.text


async def test_a_compaction_item_opens_only_for_its_tenant(two_tenants: RunningGateway) -> None:
    async with http_as(two_tenants, KEY_A) as a, http_as(two_tenants, KEY_B) as b:
        raw = await compact_raw(a, {"model": MODEL, "input": conversation()})
        fed = [*raw["output"], {"role": "user", "content": "What is my code word?"}]
        foreign = await b.post("/responses", json={"model": MODEL, "input": fed})
        assert foreign.status_code == 400, foreign.text
        assert foreign.json()["error"]["param"] == f"input[{len(fed) - 2}].encrypted_content"
        own = await a.post("/responses", json={"model": MODEL, "input": fed})
        assert own.status_code == 200, own.text
        # No key, no compaction.
        async with httpx.AsyncClient(base_url=two_tenants.base_url, timeout=30) as anonymous:
            r = await anonymous.post("/responses/compact", json={"model": MODEL, "input": "hi"})
            assert r.status_code == 401


def _stream_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_context_management_compacts_past_the_threshold(
    http: httpx.AsyncClient, sim: RunningSim, stream: bool
) -> None:
    question = {"role": "user", "content": "What is my code word?"}
    body = {
        "model": MODEL,
        "input": [*conversation(), question],
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "stream": stream,
    }
    assert_valid("CreateResponse", body)
    start = len(sim.requests)
    r = await http.post("/responses", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = _stream_events(r.text)
        validate_event_stream(events)
        assert_valid_events(events)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added[0] == "compaction"
        response = events[-1]["response"]
    else:
        response = r.json()
    assert_valid_response(response)
    assert response["status"] == "completed"
    kinds = [item["type"] for item in response["output"]]
    assert kinds[0] == "compaction" and kinds[-1] == "message"
    # Two generations: the summary, then the answer from the compacted conversation.
    assert len(sim.requests) == start + 2
    summary_prompt, answer_prompt = prompt(sim, start), prompt(sim, start + 1)
    assert COMPACTION_REQUEST in summary_prompt and LOG in summary_prompt
    assert SUMMARY_HEADER in answer_prompt and LOG not in answer_prompt and "pineapple" in answer_prompt
    assert answer_prompt.index(SUMMARY_HEADER) > answer_prompt.index("What is my code word?")
    sizes = [len(sim.requests[start + i].input_ids) for i in (0, 1)]
    assert sizes[1] < 1000 < sizes[0]
    assert response["usage"]["input_tokens"] == sum(sizes)


async def test_context_management_in_a_stored_chain(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    compaction = [{"type": "compaction", "compact_threshold": 1000}]
    first = await client.responses.create(
        model=MODEL,
        input=[*conversation(), {"role": "user", "content": "Carry on."}],  # type: ignore[list-item]
        context_management=compaction,  # type: ignore[arg-type]
    )
    assert first.output[0].type == "compaction"
    before = len(sim.requests)
    second = await client.responses.create(
        model=MODEL,
        input="What is my code word?",
        previous_response_id=first.id,
        context_management=compaction,  # type: ignore[arg-type]
    )
    # The chain replays the summary, not what it stands for: under the threshold, nothing to compact.
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert len(sim.requests) == before + 1
    seen = prompt(sim, before)
    assert SUMMARY_HEADER in seen and "pineapple" in seen and LOG not in seen
    assert second.usage is not None and second.usage.input_tokens < 1000


async def test_context_management_in_a_conversation(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    conversation = await client.conversations.create(items=conversation_items())
    compaction = [{"type": "compaction", "compact_threshold": 1000}]
    first = await client.responses.create(
        model=MODEL,
        input="Carry on.",
        conversation=conversation.id,
        context_management=compaction,  # type: ignore[arg-type]
    )
    assert first.output[0].type == "compaction"
    before = len(sim.requests)
    second = await client.responses.create(
        model=MODEL,
        input="What is my code word?",
        conversation=conversation.id,
        context_management=compaction,  # type: ignore[arg-type]
    )
    # The conversation holds the compaction item now: what came before it renders as its summary.
    assert [item.type for item in second.output] == ["reasoning", "message"]
    seen = prompt(sim, before)
    assert SUMMARY_HEADER in seen and "pineapple" in seen and LOG not in seen


async def test_context_management_in_the_background(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    queued = await client.responses.create(
        model=MODEL,
        input=[*conversation(), {"role": "user", "content": "Carry on."}],  # type: ignore[list-item]
        context_management=[{"type": "compaction", "compact_threshold": 1000}],  # type: ignore[list-item]
        background=True,
    )
    events = [
        event.model_dump(mode="json", warnings=False)
        async for event in await client.responses.retrieve(queued.id, stream=True)
    ]
    assert events[-1]["type"] == "response.completed"
    done = await client.responses.retrieve(queued.id)
    assert done.status == "completed" and done.output[0].type == "compaction"
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added[0] == "compaction"


async def test_under_the_threshold_nothing_is_compacted(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    before = len(sim.requests)
    response = await client.responses.create(
        model=MODEL,
        input=FACT,
        context_management=[{"type": "compaction", "compact_threshold": 1000}],  # type: ignore[list-item]
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert len(sim.requests) == before + 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/responses/compact", {"input": "hi"}, "model"),
        ("/responses/compact", {"model": MODEL, "input": 7}, "input"),
        ("/responses/compact", {"model": MODEL}, "input"),
        ("/responses/compact", {"model": MODEL, "input": [{"type": "bogus"}]}, "input[0].type"),
        ("/responses/compact", {"model": MODEL, "input": "hi", "conversation": "conv_1"}, "conversation"),
        ("/responses/compact", {"model": MODEL, "input": "hi", "instructions": 5}, "instructions"),
        ("/responses/compact", {"model": "no-such-model", "input": "hi"}, "model"),
        (
            "/responses",
            {"model": MODEL, "input": "hi", "context_management": "compact"},
            "context_management",
        ),
        ("/responses", {"model": MODEL, "input": "hi", "context_management": []}, "context_management"),
        (
            "/responses",
            {"model": MODEL, "input": "hi", "context_management": [{"type": "summarise"}]},
            "context_management[0].type",
        ),
        (
            "/responses",
            {
                "model": MODEL,
                "input": "hi",
                "context_management": [{"type": "compaction", "compact_threshold": 10}],
            },
            "context_management[0].compact_threshold",
        ),
        (
            "/responses",
            {"model": MODEL, "input": [{"type": "compaction", "encrypted_content": 5}]},
            "input[0].encrypted_content",
        ),
    ],
)
async def test_bad_input_names_its_param(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    if param != "model" or "model" not in body:
        assert r.status_code == 400


async def test_compact_errors_reach_the_sdk(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as missing:  # as OpenAI answers an unknown id
        await client.responses.compact(model=MODEL, previous_response_id="resp_missing")
    assert missing.value.param == "previous_response_id"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as bad:
        await client.responses.compact(model=MODEL, input=[{"type": "bogus"}])  # type: ignore[list-item]
    assert bad.value.param == "input[0].type"  # type: ignore[attr-defined]
