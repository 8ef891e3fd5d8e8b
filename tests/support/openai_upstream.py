"""A small OpenAI-compatible HTTP server for tests: it answers with scripted text in awkward chunkings, the
way llama.cpp, Ollama or an old vLLM return gpt-oss output (Harmony as raw text).

The reply is chosen by the first `SCRIPTS` trigger found in the request (the prompt of `/v1/completions`,
or the last message of `/v1/chat/completions`); streams are cut into pieces of `CHUNK_SIZES` characters,
cycling, so markers arrive split mid-marker. `[[http400]]` / `[[http500]]` answer with that status,
`[[midstream]]` sends an error event after some text, `[[slow]]` waits before answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CHUNK_SIZES = (3, 1, 7, 2, 5, 11, 4)

HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Let me think.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>The answer is 4.<|return|>"
)
SCRIPTS: dict[str, str] = {
    "[[stripped]]": "analysisLet me think.assistantfinalThe answer is 4.",
    "[[unknown]]": (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>weird<|message|>Odd. <|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    ),
    "[[noend]]": (
        "<|channel|>analysis<|message|>Thinking<|start|>assistant<|channel|>final<|message|>Answer without end"
    ),
    "[[tool]]": (
        "<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>'
    ),
    "[[plain]]": "Just plain text with no markers at all.",
    # Malformed shapes of real gpt-oss output (the answer is "Done." whenever there is one).
    "[[bad_header]]": (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>––commentary<|message|>Hidden.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    ),
    "[[doubled_start]]": (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|start|>assistant<|channel|>final"
        "<|message|>Done.<|return|>"
    ),
    "[[stray_text]]": (
        "<|channel|>analysis<|message|>Hmm.<|end|>Hidden.<|start|>assistant<|channel|>final<|message|>Done.<|return|>"
    ),
    "[[return_after_analysis]]": "<|channel|>analysis<|message|>Hmm.<|return|>",
    "[[think]]": "<think>Hmm, a greeting.</think>Plain answer.",
    "[[midstream]]": "<|channel|>analysis<|message|>Some reasoning that breaks",
    "[[long]]": "",
}


@dataclass
class FakeUpstream:
    models: tuple[str, ...] = ("gpt-oss-test",)
    requests: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    health_status: int = 200
    #: `/v1/chat/completions`: also send the reasoning as `reasoning_content` (as a parsing server would).
    structured_reasoning: bool = False
    long_text: str = ""
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES
    slow_seconds: float = 5.0
    #: Pause between events, so the gateway reads them one by one (it merges what arrives together).
    pause: float = 0.001
    url: str = ""

    def script(self, text: str) -> str:
        for trigger, reply in SCRIPTS.items():
            if trigger in text:
                return self.long_text if trigger == "[[long]]" else reply
        return HARMONY_ANSWER

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            data = [{"id": m, "object": "model", "max_model_len": 8192} for m in self.models]
            return JSONResponse({"object": "list", "data": data})

        async def health(request: Request) -> Response:
            return Response(status_code=self.health_status)

        async def completions(request: Request) -> Response:
            body = await request.json()
            self.requests.append(("completions", body))
            return await self._answer(body, body.get("prompt", ""), chat=False)

        async def chat(request: Request) -> Response:
            body = await request.json()
            self.requests.append(("chat", body))
            last = body["messages"][-1].get("content") or ""
            return await self._answer(body, json.dumps(last), chat=True)

        return Starlette(
            routes=[
                Route("/v1/models", models),
                Route("/health", health),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat, methods=["POST"]),
            ]
        )

    async def _answer(self, body: dict[str, Any], text: str, *, chat: bool) -> Response:
        if "[[http400]]" in text:
            return JSONResponse({"error": {"message": "prompt is too silly", "type": "BadRequestError"}}, 400)
        if "[[http500]]" in text:
            return JSONResponse({"error": {"message": "engine exploded"}}, 500)
        if "[[slow]]" in text:
            await asyncio.sleep(self.slow_seconds)
        reply = self.script(text)
        reasoning = None
        if chat and self.structured_reasoning and reply.startswith("<think>"):
            reasoning, reply = reply[7:].split("</think>", 1)
        usage = {"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30}
        if not body.get("stream"):
            if chat:
                message = {"role": "assistant", "content": reply}
                if reasoning:
                    message["reasoning_content"] = reasoning
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
            else:
                choice = {"index": 0, "text": reply, "finish_reason": "stop"}
            return JSONResponse({"id": "x", "object": "chat.completion", "choices": [choice], "usage": usage})
        return StreamingResponse(
            self._stream(reply, reasoning, chat, "[[midstream]]" in text, usage),
            media_type="text/event-stream",
        )

    async def _stream(
        self, reply: str, reasoning: str | None, chat: bool, fail: bool, usage: dict[str, Any]
    ) -> AsyncIterator[bytes]:
        def event(data: Any) -> bytes:
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        if reasoning:
            yield event(
                {"choices": [{"index": 0, "delta": {"reasoning_content": reasoning}, "finish_reason": None}]}
            )
        yield b": keep-alive\n\n"
        pos = 0
        for size in itertools.cycle(self.chunk_sizes):
            if pos >= len(reply):
                break
            piece = reply[pos : pos + size]
            pos += size
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None}
            yield event({"choices": [choice]})
            await asyncio.sleep(self.pause)
        if fail:
            yield event({"error": {"message": "engine died mid-stream", "code": 500}})
            return
        final = (
            {"index": 0, "delta": {}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": "", "finish_reason": "stop"}
        )
        yield event({"choices": [final]})
        yield event({"choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def running_upstream(upstream: FakeUpstream) -> AsyncIterator[FakeUpstream]:
    config = uvicorn.Config(
        upstream.app(), host="127.0.0.1", port=0, log_level="warning", lifespan="off", log_config=None
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        upstream.url = f"http://127.0.0.1:{port}"
        yield upstream
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
