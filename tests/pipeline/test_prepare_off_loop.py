"""Preparing a request whose history holds thousands of messages leaves the event loop free: a message
whose header this process has not rendered before (a new tool name) costs openai-harmony about 0.3 ms
however short its text, so a history of many messages is rendered in worker threads like a long one,
a batch per thread call (`pipeline/offload.py`: one call over the whole history starved the loop of
the GIL for half a second). Measured as the longest gap between the beats of a task that wakes every
millisecond while the request is prepared (a loop-stall test: generous bound)."""

from __future__ import annotations

import asyncio
import gc
import time

import anyio.to_thread

from harmony_gateway.engines.base import ModelInfo
from harmony_gateway.pipeline import prepare
from harmony_gateway.routing.fleet import ModelGroup
from harmony_gateway.surfaces.chat.mapper import prepare_chat
from harmony_gateway.surfaces.chat.types import ChatCompletionRequest
from tests.harmony.test_render import MODEL, gateway_state, model_group

MANY = 4000
#: A loaded 2-core machine schedules a beat late by a few switch intervals (5 ms each); a request
#: prepared on the loop held it for about a second.
STALL_BOUND = 0.1


async def _longest_gap_while(work: asyncio.Future[object]) -> float:
    beats = [time.perf_counter()]
    while not work.done():
        await asyncio.sleep(0.001)
        beats.append(time.perf_counter())
    await work
    return max(b - a for a, b in zip(beats, beats[1:], strict=False))


async def test_a_history_of_many_tool_calls_is_prepared_off_the_loop() -> None:
    calls = [
        {"id": f"c{i}", "type": "function", "function": {"name": f"new_{i}", "arguments": ""}}
        for i in range(MANY)
    ]
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}],
        }
    )
    # A context that holds the whole history: the work measured is preparing it, not refusing it.
    info = ModelInfo(served_model_name=MODEL, model_type="gpt_oss", max_context_length=4_000_000)
    group = ModelGroup(
        name=MODEL, harmony=True, info=info, policy=None, prefill_policy=None, decode_policy=None
    )
    state = gateway_state()
    warm = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    await prepare_chat(state, warm, group, owner="")  # the prefix is cached; the calls' headers are not
    # As the gateway does once started (`app._release_freed_memory`): what earlier tests left in the heap
    # is out of the collector's reach, or a full collection in the render thread holds the GIL for a
    # fifth of a second whatever the renderer does.
    gc.collect()
    gc.freeze()
    try:
        gap = await _longest_gap_while(asyncio.ensure_future(prepare_chat(state, request, group, owner="")))
    finally:
        gc.unfreeze()
    assert gap < STALL_BOUND, gap


async def test_a_burst_with_a_new_prefix_takes_one_worker_thread(monkeypatch) -> None:
    # A burst with a new system prompt (the first requests after a start): one thread call renders the
    # prefix for all of them, and their few short messages are rendered on the loop, not in thread
    # calls of their own (a pool of threads, each with a heap, for microseconds of work).
    state = gateway_state()
    history_calls = []
    thread_calls = []
    run_sync = anyio.to_thread.run_sync

    async def counted(fn: object, *args: object) -> object:
        thread_calls.append(fn)
        return await run_sync(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(anyio.to_thread, "run_sync", counted)

    async def offloaded(fn: object, items: list[object]) -> list[object]:
        history_calls.append(items)
        return [fn(item) for item in items]  # type: ignore[operator]

    monkeypatch.setattr(prepare, "map_off_loop", offloaded)
    request = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": "A new prompt."}, {"role": "user", "content": "hi"}],
        }
    )
    group = model_group()
    prepared = await asyncio.gather(*(prepare_chat(state, request, group, owner="") for _ in range(8)))
    assert len({tuple(p.input_ids) for p in prepared}) == 1
    assert history_calls == []
    assert len(thread_calls) == 1
