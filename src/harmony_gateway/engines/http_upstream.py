"""Engine client for an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, Ollama, a hosted endpoint).

`--worker-url http://host:port[/v1][?model=NAME&api=chat|completions]`. The server has no token-level
interface, so this client works in text mode: the pipeline puts ready OpenAI request bodies in
`GenerateRequest.upstream_body` (keyed by API) and gets `EngineChunk`s whose `text` is the new output
text of a choice; `upstream_delta` carries what the upstream parsed itself (reasoning, tool calls,
logprobs). `api` picks the endpoint: `completions` sends a pre-rendered prompt to `/v1/completions`,
`chat` forwards to `/v1/chat/completions`, `auto` (default) uses `completions` when the pipeline built
that body (Harmony models) and `chat` otherwise.

Errors are translated once, here (as `grpc_errors.py` does for gRPC):

    upstream 4xx                   → UpstreamRejected (400, the upstream's message)
    upstream 429                   → UpstreamUnavailable (503, retried on another worker)
    upstream 5xx, broken stream    → UpstreamError (502)
    connection refused / DNS       → UpstreamUnavailable (503, retryable)
    connect/read/write/pool timeout → UpstreamTimeout (504)

One `httpx.AsyncClient` per worker, reused by every request, with explicit per-phase timeouts. HTTP
has no abort call: closing the response stream (dispatch does, on any early exit) makes vLLM and SGLang
abort the request, so `abort()` does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import orjson

from ..errors import (
    InvalidRequest,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from .base import EngineCapabilities, EngineChunk, GenerateRequest, ModelInfo, redact_url, translating_errors
from .kv_events import EngineLoad, KvBatch

APIS = ("auto", "chat", "completions")
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def _upstream_message(response: httpx.Response, body: bytes) -> str:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode(errors="replace")[:500] or response.reason_phrase
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            message = error.get("message") or error.get("detail")
            if message:
                return str(message)[:2000]
        elif isinstance(error, str):
            return error[:2000]
        detail = data.get("detail")
        if detail:
            return str(detail)[:2000]
    return body.decode(errors="replace")[:500]


def status_error(url: str, response: httpx.Response, body: bytes) -> UpstreamError:
    """The gateway error for a non-2xx upstream answer."""
    message = _upstream_message(response, body)
    status = response.status_code
    if status == 429:
        return UpstreamUnavailable(f"upstream at {url} is overloaded (429): {message}")
    if 400 <= status < 500:
        return UpstreamRejected(f"upstream rejected the request: {message}")
    return UpstreamError(f"upstream at {url} failed with HTTP {status}: {message}")


def translate_httpx_error(exc: httpx.TransportError, url: str) -> UpstreamError:
    """The gateway error for an httpx transport failure (httpx's own `map_httpcore_exceptions`)."""
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"upstream at {url} did not answer in time ({type(exc).__name__})")
    if isinstance(exc, httpx.RemoteProtocolError):
        return UpstreamError(f"upstream at {url} broke the connection: {exc}")
    return UpstreamUnavailable(f"upstream at {url} is unavailable: {exc}")  # refused, DNS, reset...


def map_httpx_errors(url: str) -> contextlib.AbstractContextManager[None]:
    """A context in which an httpx transport error raises its `translate_httpx_error` instead."""
    return translating_errors(httpx.TransportError, translate_httpx_error, url)


class _Choice:
    """Per-choice state while reading a stream: the finished chunk waits for the usage chunk."""

    __slots__ = ("finish",)

    def __init__(self) -> None:
        self.finish: EngineChunk | None = None


class HttpUpstreamClient:
    """`EngineClient` over an OpenAI-compatible HTTP server (text mode; see the module docstring)."""

    engine = "http"
    #: Tells the pipeline this worker takes `upstream_body` and answers with text, not token ids.
    wire = "text"

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float = 1800.0,
        connect_timeout: float = 10.0,
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"worker URL {url!r} needs a host: http://host:port", param="url")
        query = parse_qs(parts.query)
        api = (query.get("api") or ["auto"])[0]
        path = parts.path.rstrip("/")
        for name, suffix in _PATHS.items():
            if path.endswith(suffix):
                api, path = name, path[: -len(suffix)]
        path = path.removesuffix("/v1")
        if api not in APIS:
            raise InvalidRequest(f"api={api!r} in {url!r}: expected one of {', '.join(APIS)}", param="url")
        #: For messages only: the connection uses `base_url`, whose credentials must not reach logs.
        self.url = redact_url(url)
        self.api = api
        #: Text mode: the pipeline sends `upstream_body` and reads text; the upstream does its own
        #: stops, constraints and tokenization, so nothing else is declared.
        self.capabilities = EngineCapabilities(wire="text", text_api=api)
        #: `?model=NAME` picks one of several models the server lists.
        models = query.get("model")
        self.model_name: str | None = models[0] if models else None
        self.base_url = f"{parts.scheme}://{parts.netloc}{path}"
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(
                connect=connect_timeout, read=request_timeout, write=60.0, pool=connect_timeout
            ),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            headers=headers,
            transport=transport,
        )
        self._health_path: str | None = None
        #: The upstream's own model name (requests are rewritten to it).
        self.upstream_model: str | None = self.model_name

    # -- EngineClient ----------------------------------------------------------------------------
    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        with map_httpx_errors(self.url):
            response = await self._client.get("/v1/models", timeout=timeout)
        if response.status_code != 200:
            raise status_error(self.url, response, response.content)
        try:
            models = orjson.loads(response.content).get("data") or []
        except (orjson.JSONDecodeError, AttributeError):
            raise UpstreamError(f"upstream at {self.url} answered /v1/models with non-JSON") from None
        entry: dict[str, Any] | None = None
        for model in models:
            if isinstance(model, dict) and (self.model_name is None or model.get("id") == self.model_name):
                entry = model
                break
        if entry is None:
            wanted = f"model {self.model_name!r}" if self.model_name else "any model"
            raise UpstreamError(f"upstream at {self.url} does not list {wanted} in /v1/models")
        name = str(entry.get("id"))
        self.upstream_model = name
        context = entry.get("max_model_len") or entry.get("context_length") or 0
        return ModelInfo(served_model_name=name, max_context_length=int(context or 0))

    async def health(self, timeout: float) -> bool:
        """`GET /health` (vLLM, SGLang, llama.cpp); servers without it are probed with `/v1/models`."""
        paths = [self._health_path] if self._health_path else ["/health", "/v1/models"]
        for path in paths:
            assert path is not None
            with map_httpx_errors(self.url):
                response = await self._client.get(path, timeout=timeout)
            if response.status_code in (404, 405) and path == "/health" and len(paths) > 1:
                continue
            self._health_path = path
            return response.status_code == 200
        return False

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """Not declared (`capabilities.server_info` is False): an OpenAI server has no such endpoint."""
        raise UpstreamError(f"the HTTP upstream at {self.url} has no server info")

    async def get_tokenizer(self, timeout: float = 60.0) -> bytes:
        """Not declared (`capabilities.tokenizer` is False): the upstream tokenizes itself."""
        raise UpstreamError(f"the HTTP upstream at {self.url} cannot send its tokenizer")

    def subscribe_kv_events(self, start_sequence: int) -> AsyncGenerator[KvBatch, None]:
        """Not declared (`capabilities.kv_events` is False): an OpenAI server publishes no KV events."""
        raise UpstreamError(f"the HTTP upstream at {self.url} publishes no KV events")

    async def loads(self, timeout: float) -> EngineLoad:
        """Not declared (`capabilities.loads` is False)."""
        raise UpstreamError(f"the HTTP upstream at {self.url} reports no load")

    async def abort(self, request_id: str) -> None:
        """Nothing to send: closing the response stream aborts the upstream request."""

    async def close(self) -> None:
        await self._client.aclose()

    # -- generation ------------------------------------------------------------------------------
    def choose_api(self, bodies: dict[str, dict[str, Any]]) -> str:
        if self.api != "auto" and self.api in bodies:
            return self.api
        return "completions" if "completions" in bodies else "chat"

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        bodies = request.upstream_body
        if not bodies:
            raise UpstreamRejected(
                f"worker {self.url} is an HTTP upstream and needs a text-mode request; "
                "do not mix gRPC and HTTP workers for one model"
            )
        api = self.choose_api(bodies)
        body = dict(bodies[api])
        if self.upstream_model:
            body["model"] = self.upstream_model
        body["stream"] = request.stream
        if request.stream:
            body["stream_options"] = {"include_usage": True}
        with map_httpx_errors(self.url):
            async with self._client.stream(
                "POST", _PATHS[api], content=orjson.dumps(body), headers={"content-type": "application/json"}
            ) as response:
                if response.status_code != 200:
                    raise status_error(self.url, response, await response.aread())
                if not request.stream:
                    data = orjson.loads(await response.aread())
                    for chunk in self._whole(data, api):
                        yield chunk
                    return
                async for chunk in self._stream(response, api):
                    yield chunk

    def _whole(self, data: dict[str, Any], api: str) -> list[EngineChunk]:
        usage = data.get("usage") or {}
        out: list[EngineChunk] = []
        for choice in data.get("choices") or []:
            text, delta = _choice_output(choice, api, stream=False)
            chunk = EngineChunk(index=int(choice.get("index", 0)), text=text, upstream_delta=delta)
            _finish(chunk, choice.get("finish_reason"), usage, first=not out)
            out.append(chunk)
        return out

    async def _stream(self, response: httpx.Response, api: str) -> AsyncIterator[EngineChunk]:
        """Events of one network read are parsed together, and the text a choice got in that read is
        yielded as one chunk: no added latency, and the parser and SSE writer run once per read rather
        than once per event when the upstream is faster than the gateway."""
        choices: dict[int, _Choice] = {}
        usage: dict[str, Any] = {}
        buffer = b""
        done = False
        async for data in response.aiter_bytes():
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            pending: dict[int, list[str]] = {}
            for line in lines:
                if not line.startswith(b"data:"):
                    continue  # comments, `event:` lines, keep-alives, blank separators
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    raise UpstreamError(f"upstream at {self.url} sent a malformed stream event") from None
                if not isinstance(event, dict):
                    continue
                error = event.get("error")
                if error:
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    raise UpstreamError(f"upstream at {self.url} failed mid-stream: {message}")
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or ():
                    index = int(choice.get("index", 0))
                    state = choices.get(index)
                    if state is None:
                        state = choices[index] = _Choice()
                    text, structured = _choice_output(choice, api, stream=True)
                    if structured:
                        parts = pending.pop(index, None)
                        if parts:  # keep the choice's order: earlier text first
                            yield EngineChunk(index=index, text="".join(parts))
                        yield EngineChunk(index=index, text=text, upstream_delta=structured)
                    elif text:
                        pending.setdefault(index, []).append(text)
                    finish_reason = choice.get("finish_reason")
                    if finish_reason and state.finish is None:
                        # Held until the usage event (sent after every finish) or the end of the stream.
                        state.finish = EngineChunk(
                            index=index, text="", finished=True, finish_reason=finish_reason
                        )
            for index, parts in pending.items():
                yield EngineChunk(index=index, text=parts[0] if len(parts) == 1 else "".join(parts))
            if done:
                break
        for n, (index, state) in enumerate(sorted(choices.items())):
            chunk = state.finish or EngineChunk(index=index, text="", finished=True, finish_reason="stop")
            _finish(chunk, chunk.finish_reason, usage, first=n == 0)
            yield chunk


def _choice_output(choice: dict[str, Any], api: str, *, stream: bool) -> tuple[str, dict[str, Any] | None]:
    """A choice's output text, and what the upstream parsed itself (reasoning, tool calls, logprobs) or
    None: from a chat choice's `message` (its `delta` in a stream), or a completions choice's `text`."""
    if api != "chat":
        return choice.get("text") or "", None
    message = choice.get("delta" if stream else "message") or {}
    parsed: dict[str, Any] = {}
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        parsed["reasoning"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        if not stream:  # a whole message: give each call the index a stream would
            calls = [{"index": i, **call} for i, call in enumerate(calls)]
        parsed["tool_calls"] = calls
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and logprobs.get("content"):
        parsed["logprobs"] = logprobs["content"]
    return message.get("content") or "", parsed or None


def _finish(chunk: EngineChunk, finish_reason: str | None, usage: dict[str, Any], *, first: bool) -> None:
    """Close a choice. Usage is per request: the first choice carries the completion count (the
    pipeline sums choices), every choice the prompt count."""
    chunk.finished = True
    reason = finish_reason or "stop"
    # OpenAI servers say "tool_calls"/"function_call"; the pipeline decides that from the parsed output.
    chunk.finish_reason = "length" if reason == "length" else ("abort" if reason == "abort" else "stop")
    if usage:
        chunk.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        if not first:
            return
        chunk.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        chunk.cached_tokens = int(details.get("cached_tokens") or 0)
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
        if reasoning:
            chunk.upstream_delta = {**(chunk.upstream_delta or {}), "reasoning_tokens": int(reasoning)}


__all__ = ["APIS", "HttpUpstreamClient", "map_httpx_errors", "status_error", "translate_httpx_error"]
