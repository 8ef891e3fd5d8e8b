"""Replays a trace (`agent_trace.py`) against one or two gateway base URLs and measures what routing buys.

Each session runs as its own agent loop: think, send the whole conversation so far as a streamed chat
completion (usage included), read the answer, append it, go on. A turn records its time to first token
(first reasoning or answer delta), its prompt and cached tokens (`usage.prompt_tokens_details`), and
whether it succeeded: HTTP 200, a stream ending in `[DONE]` with usage and an answer. An agent whose turn
fails stops (its later turns are never sent); the failure is counted.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from agent_trace import Session, Trace

MODEL = "openai/gpt-oss-20b"


@dataclass
class TurnResult:
    session: int
    turn: int
    replica: int
    ok: bool
    #: Seconds after the replay's start when the request was sent.
    sent: float = 0.0
    ttft: float | None = None
    latency: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class ReplayResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_seconds: float = 0.0
    #: Wall-clock time (time.time()) when the replay started: engine records before it are warm-up.
    started_at: float = 0.0

    def ok_turns(self) -> list[TurnResult]:
        return [t for t in self.turns if t.ok]

    def errors(self) -> list[TurnResult]:
        return [t for t in self.turns if not t.ok]

    def prompt_tokens(self) -> int:
        return sum(t.prompt_tokens for t in self.ok_turns())

    def cached_tokens(self) -> int:
        return sum(t.cached_tokens for t in self.ok_turns())

    def hit_rate(self) -> float:
        prompt = self.prompt_tokens()
        return self.cached_tokens() / prompt if prompt else 0.0

    def ttft(self, p: float) -> float | None:
        values = sorted(t.ttft for t in self.ok_turns() if t.ttft is not None)
        if not values:
            return None
        return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]

    def turns_per_second(self) -> float:
        return len(self.ok_turns()) / self.wall_seconds if self.wall_seconds else 0.0


async def _turn(
    http: aiohttp.ClientSession, base: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[TurnResult, str]:
    body = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
    }
    result = TurnResult(session=-1, turn=-1, replica=-1, ok=False)
    answer: list[str] = []
    done = usage_seen = False
    t0 = time.perf_counter()
    async with http.post(f"{base}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return result, ""
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            event: dict[str, Any] = json.loads(payload)
            if "error" in event:
                result.error = f"stream error: {json.dumps(event['error'])[:200]}"
                return result, ""
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                if text and result.ttft is None:
                    result.ttft = time.perf_counter() - t0
                if delta.get("content"):
                    answer.append(delta["content"])
            usage = event.get("usage")
            if usage:
                usage_seen = True
                result.prompt_tokens = usage.get("prompt_tokens") or 0
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens = details.get("cached_tokens") or 0
    result.latency = time.perf_counter() - t0
    if not done:
        result.error = "stream ended without [DONE]"
    elif not usage_seen:
        result.error = "no usage in the stream"
    elif not answer:
        result.error = "no answer text"
    else:
        result.ok = True
    return result, "".join(answer)


async def _session(
    http: aiohttp.ClientSession,
    bases: list[str],
    session: Session,
    max_tokens: int,
    t_start: float,
    out: list[TurnResult],
) -> None:
    await asyncio.sleep(max(0.0, t_start + session.start - time.perf_counter()))
    messages = [{"role": "system", "content": session.system}]
    for index, turn in enumerate(session.turns):
        await asyncio.sleep(turn.think)
        messages.append({"role": "user", "content": turn.message})
        replica = session.replica(index, len(bases))
        sent = time.perf_counter() - t_start
        try:
            result, answer = await _turn(http, bases[replica], messages, max_tokens)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            result, answer = TurnResult(-1, -1, -1, ok=False, error=repr(exc)), ""
        result.session, result.turn, result.replica, result.sent = session.id, index, replica, sent
        out.append(result)
        if not result.ok:
            return  # an agent whose turn failed stops; the failure is counted
        messages.append({"role": "assistant", "content": answer})


async def replay(
    trace: Trace, bases: list[str], *, max_tokens: int = 256, timeout: float = 180.0
) -> ReplayResult:
    """Run every session of `trace` against `bases` (one URL per gateway replica) and collect the turns."""
    result = ReplayResult()
    connector = aiohttp.TCPConnector(limit=0)
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=client_timeout) as http:
        result.started_at = time.time()
        t_start = time.perf_counter()
        await asyncio.gather(
            *(_session(http, bases, s, max_tokens, t_start, result.turns) for s in trace.sessions)
        )
        result.wall_seconds = time.perf_counter() - t_start
    return result
