"""Responses logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`) for answer tokens only,
identical in stream and non-stream; and streamed failures that are stored as failed Responses."""

from __future__ import annotations

from typing import Any

import grpc
import openai
import pytest

from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.responses_stream import validate_event_stream

LOGPROBS = ["message.output_text.logprobs"]


def _dump(events: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump(exclude_unset=True, warnings=False) for e in events]


def _entries(response: Any) -> list[list[dict[str, Any]]]:
    """Each message item's output_text logprob entries, in output order."""
    body = response if isinstance(response, dict) else response.model_dump(warnings=False)
    return [item["content"][0]["logprobs"] for item in body["output"] if item["type"] == "message"]


async def test_logprobs_cover_answer_tokens_only(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    r = await client.responses.create(
        model=MODEL, input="[[preamble]] with logprobs", include=LOGPROBS, top_logprobs=2
    )
    sent = sim.requests[-1]
    assert sent.return_logprob and sent.top_logprobs_num == 2
    assert r.top_logprobs == 2
    kinds = [item.type for item in r.output]
    assert kinds.count("reasoning") >= 1 and kinds.count("message") == 2  # preamble and final answer
    for item in r.output:
        if item.type != "message":
            continue
        part = item.content[0]
        assert part.logprobs, item.phase
        # Exactly the tokens of the answer text: no analysis, header or control token.
        assert "".join(lp.token for lp in part.logprobs) == part.text
        for lp in part.logprobs:
            assert "<|" not in lp.token and lp.bytes == list(lp.token.encode())
            assert -1 < lp.logprob <= 0
            assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob


async def test_stream_reports_the_same_logprobs(client: openai.AsyncOpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "input": "[[preamble]] same logprobs", "include": LOGPROBS}
    plain = await client.responses.create(**kwargs, top_logprobs=1)
    events = _dump([e async for e in await client.responses.create(**kwargs, top_logprobs=1, stream=True)])
    validate_event_stream(events)
    final = events[-1]["response"]
    assert final["status"] == "completed"
    expected = _entries(plain)
    assert expected and all(expected) and _entries(final) == expected
    # The deltas carry them token by token, and each `.done` carries the whole list.
    by_item: dict[str, list[dict[str, Any]]] = {}
    for event in events:
        if event["type"] == "response.output_text.delta":
            by_item.setdefault(event["item_id"], []).extend(event["logprobs"])
        elif event["type"] == "response.output_text.done":
            assert event["logprobs"] == by_item[event["item_id"]]
    assert list(by_item.values()) == expected
    # The SDK helper rebuilds the same final response.
    async with client.responses.stream(**kwargs, top_logprobs=1) as helper:
        rebuilt = await helper.get_final_response()
    assert _entries(rebuilt) == expected


async def test_logprobs_only_when_included(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    # `top_logprobs` alone is echoed but asks for nothing (OpenAI needs the include too).
    r = await client.responses.create(model=MODEL, input="no include", top_logprobs=3)
    assert not sim.requests[-1].return_logprob
    assert r.top_logprobs == 3 and _entries(r) == [[]]
    # Other include values (Codex sends reasoning.encrypted_content) ask for no logprobs.
    r = await client.responses.create(
        model=MODEL, input="codex style", include=["reasoning.encrypted_content"], store=False
    )
    assert r.status == "completed" and not sim.requests[-1].return_logprob and _entries(r) == [[]]
    # Without top_logprobs each entry has an empty top list.
    r = await client.responses.create(model=MODEL, input="bare include", include=LOGPROBS)
    assert sim.requests[-1].top_logprobs_num == 0
    assert [lp.top_logprobs for lp in r.output[-1].content[0].logprobs] == [[]] * len(
        r.output[-1].content[0].logprobs
    )


# -- failures ----------------------------------------------------------------------------------------
async def test_failed_stream_is_stored_as_failed(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=30, message="engine fell over")
    stream = await client.responses.create(model=MODEL, input="[[long]] fail midway", stream=True)
    events = _dump([e async for e in stream])
    validate_event_stream(events)
    assert events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output"]
    stored = await client.responses.retrieve(failed["id"])
    assert stored.status == "failed" and stored.error is not None and stored.error.code == "server_error"
    assert [item.id for item in stored.output] == [item["id"] for item in failed["output"]]
    assert stored.output[-1].status == "incomplete"  # the item the failure cut
    assert stored.output[-1].content[0].text == failed["output"][-1]["content"][0]["text"]

    # store=false stores nothing, failed or not.
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=30, message="engine fell over")
    stream = await client.responses.create(model=MODEL, input="[[long]] unstored", stream=True, store=False)
    events = _dump([e async for e in stream])
    assert events[-1]["type"] == "response.failed"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(events[-1]["response"]["id"])


async def test_failed_non_stream_is_an_http_error(client: openai.AsyncOpenAI, sim: RunningSim) -> None:
    """The client never learns the id of a non-stream response that failed, so nothing is stored."""
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=30, message="engine fell over")
    with pytest.raises(openai.APIStatusError) as info:
        await client.responses.create(model=MODEL, input="[[long]] fail quietly")
    assert info.value.status_code >= 500
