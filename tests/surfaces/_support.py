"""What the surface tests share: a gateway state serving the test model (with no worker: nothing is ever
dispatched), request contexts as the routes build them, a completion as an engine streams it (real
Harmony token ids in `EngineChunk`s) and a plan answered with that output, its SSE read back as data."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from pydantic import BaseModel

from harmony_gateway.app import build_state
from harmony_gateway.engines.base import EngineChunk
from harmony_gateway.harmony.encoding import ASSISTANT_STOP_IDS, get_encoding
from harmony_gateway.pipeline.context import GatewayState, RequestContext
from harmony_gateway.pipeline.drive import Generation, Planned, answer
from harmony_gateway.storage.memory import MemoryStore
from harmony_gateway.wire import ANTHROPIC, OPENAI, RESPONSES
from tests.harmony.test_render import MODEL, model_group
from tests.support.servers import test_settings

REQUEST_ID = "req-1"
PROMPT_TOKENS = 20

#: A gpt-oss completion: analysis, then the final answer.
ANSWER = (
    "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hello<|return|>"
)
#: A gpt-oss completion that calls the `get_weather` function.
WEATHER_CALL = (
    "<|channel|>analysis<|message|>need weather<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>'
)


@functools.cache
def serving_state() -> GatewayState:
    """A gateway state whose fleet serves `MODEL`, with a memory store (reasoning keys, restorable
    analyses, responses). Its group has no worker: a test gives each plan its engine output itself."""
    state = build_state(test_settings())
    state.store = MemoryStore()
    state.fleet.groups[MODEL] = model_group()
    return state


def openai_context(route: str) -> RequestContext:
    """A request context as the OpenAI-shaped routes build it (chat, completions, generate, responses).
    With `anthropic_context`, the one place these tests say which wire a request's errors take."""
    wire = RESPONSES if route == "responses" else OPENAI
    return RequestContext(request_id=REQUEST_ID, route=route, wire=wire)


def anthropic_context() -> RequestContext:
    """A request context as the Messages route builds it: Anthropic's error event mid-stream."""
    return RequestContext(request_id=REQUEST_ID, route="messages", wire=ANTHROPIC)


def harmony_ids(text: str) -> list[int]:
    """Token ids of `text`, special-token text as the special tokens."""
    return get_encoding().encode(text, allowed_special="all")


def engine_chunks(
    completion: str, *, per_chunk: int = 4, finish_reason: str = "stop", index: int = 0
) -> list[EngineChunk]:
    """`completion` as an engine streams it: `per_chunk` ids at a time with cumulative counts; the stop
    token that ends it is stripped and reported as `matched_stop_token`, as SGLang and vLLM do."""
    ids = harmony_ids(completion)
    stop = ids.pop() if ids and ids[-1] in ASSISTANT_STOP_IDS else None
    chunks = [
        EngineChunk(
            index=index,
            token_ids=ids[start : start + per_chunk],
            prompt_tokens=PROMPT_TOKENS,
            completion_tokens=min(start + per_chunk, len(ids)),
        )
        for start in range(0, len(ids), per_chunk)
    ]
    last = chunks[-1]
    last.finished, last.finish_reason, last.matched_stop_token = True, finish_reason, stop
    last.completion_tokens = len(ids) + (stop is not None)
    return chunks


async def source(items: Sequence[Any], fail: BaseException | None = None) -> AsyncIterator[Any]:
    """An opened engine stream: `items`, then `fail` raised if given."""
    for item in items:
        yield item
    if fail is not None:
        raise fail


#: One SSE event: its `event:` name (None for data-only events) and its data, parsed as JSON
#: (the `[DONE]` marker stays a string).
Event = tuple[str | None, Any]


def sse_events(raw: bytes) -> list[Event]:
    events: list[Event] = []
    for frame in raw.split(b"\n\n"):
        if not frame:
            continue
        name: str | None = None
        data = b""
        for line in frame.split(b"\n"):
            field, _, value = line.partition(b": ")
            if field == b"event":
                name = value.decode()
            elif field == b"data":
                data = value
        events.append((name, data.decode() if data == b"[DONE]" else orjson.loads(data)))
    return events


async def answered(
    ctx: RequestContext,
    planned: Planned,
    items: Sequence[Any],
    fail: BaseException | None = None,
) -> Any:
    """Run `planned` through the driver (`answer`) with `items` (then `fail`) as what its generation
    opened: the SSE events of a stream, or the JSON body."""
    assert isinstance(planned, Generation)

    async def open_items() -> AsyncIterator[Any]:
        return source(items, fail)

    result = await answer(ctx, dataclasses.replace(planned, open=open_items))
    if isinstance(result, dict | list):
        return result
    return sse_events(b"".join([piece async for piece in result]))


# -- the raw-prompt surfaces (/generate, /v1/completions) -------------------------------------------------
#: A raw Harmony prompt, and what the engine returns of ANSWER for it: its stop token stripped (and
#: reported as matched).
RAW_PROMPT = "<|start|>user<|message|>Weather?<|end|><|start|>assistant"
RAW_OUTPUT = ANSWER.removesuffix("<|return|>")


async def run_raw(
    route: str,
    request_type: type[BaseModel],
    plan: Callable[[GatewayState, Any, RequestContext], Awaitable[Planned]],
    prompt_field: str,
    items: list[tuple[int, EngineChunk]],
    fail: BaseException | None = None,
    **body: Any,
) -> tuple[Any, RequestContext]:
    """A raw-prompt request (`prompt_field` holding RAW_PROMPT) planned by `plan` and answered with
    `items`: the body or the stream's events, and the request's context."""
    ctx = openai_context(route)
    request = request_type.model_validate({"model": MODEL, prompt_field: RAW_PROMPT, **body})
    planned = await plan(serving_state(), request, ctx)
    return await answered(ctx, planned, items, fail), ctx


def of_prompt(index: int, chunks: list[EngineChunk]) -> list[tuple[int, EngineChunk]]:
    """Engine chunks tagged with the index of the prompt they answer (a batch's source)."""
    return [(index, chunk) for chunk in chunks]
