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

from harmony_gateway.engines.base import ModelInfo
from harmony_gateway.routing.fleet import ModelGroup
from harmony_gateway.surfaces.chat.mapper import prepare_chat
from harmony_gateway.surfaces.chat.types import ChatCompletionRequest
from tests.harmony.test_render import MODEL, gateway_state

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
