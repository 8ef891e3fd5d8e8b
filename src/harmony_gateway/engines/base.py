"""The engine seam: one request/chunk shape that every engine client (SGLang gRPC, vLLM gRPC, HTTP) speaks.

Engine modules normalise their wire format (delta vs cumulative ids, a final message that repeats the
last chunk, stripped stop tokens) into `EngineChunk`s, so the pipeline sees one shape. Engine clients
translate transport failures into `errors.Upstream*` at their boundary.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from ..errors import InvalidRequest, UpstreamError
from .kv_events import EngineLoad, KvBatch

_Caught = TypeVar("_Caught", bound=BaseException)


@contextlib.contextmanager
def translating_errors(
    caught: type[_Caught], translate: Callable[[_Caught, str], UpstreamError], url: str
) -> Iterator[None]:
    """Raise a `caught` error (a transport's own) from the block again as `translate(exc, url)`: each
    engine client translates its dependency's errors into `errors.Upstream*` once, at its boundary
    (`grpc_errors.map_grpc_errors`, `http_upstream.map_httpx_errors`)."""
    try:
        yield
    except caught as exc:
        raise translate(exc, url) from exc


def redact_url(url: str) -> str:
    """`url` with any `user:password@` replaced by `***@`; other URLs unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.rsplit("@", 1)[-1] if "@" in url else url
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


@dataclass(slots=True)
class SamplingOptions:
    """Sampling fields, always sent explicitly (proto3 sends unset numbers as 0)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = False
    json_schema: str | None = None
    regex: str | None = None
    structural_tag: str | None = None
    stream_interval: int | None = None
    #: The request field a constraint came from ("tool_choice", "response_format", "text.format"),
    #: named by the 400 when the engine cannot constrain.
    constraint_param: str | None = None


@dataclass(slots=True)
class BootstrapInfo:
    """Prefill/decode disaggregation rendezvous: the prefill worker's host/port and one shared room."""

    host: str
    port: int
    room: int


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    input_ids: list[int]
    sampling: SamplingOptions
    stream: bool = True
    original_text: str = ""
    return_logprob: bool = False
    top_logprobs_num: int = 0
    bootstrap: BootstrapInfo | None = None
    #: Text-mode upstreams (HTTP): the OpenAI request bodies to forward, keyed by API
    #: ("completions", "chat"); gRPC engines ignore it and use `input_ids`.
    upstream_body: dict[str, dict[str, Any]] | None = None


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class EngineChunk:
    """New output of one choice. `finished` marks the last chunk of that choice."""

    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop_token: int | None = None
    matched_stop_str: str | None = None
    #: Text-mode upstreams (HTTP) have no token ids: the new output text of the choice.
    text: str | None = None
    #: Text-mode upstreams: fields the upstream parsed itself (`reasoning`, `tool_calls` as
    #: OpenAI stream deltas, `logprobs` entries, `reasoning_tokens`), passed on unchanged.
    upstream_delta: dict[str, Any] | None = None


class TokenCounts(Protocol):
    """What keeps an engine request's token counts (a choice's output, one turn of a response)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def take_counts(into: TokenCounts, chunk: EngineChunk) -> None:
    """Keep `chunk`'s counts on `into`: they are cumulative within an engine request, and a chunk that
    carries none (0) leaves the last known value."""
    if chunk.prompt_tokens:
        into.prompt_tokens = chunk.prompt_tokens
    if chunk.completion_tokens:
        into.completion_tokens = chunk.completion_tokens
    if chunk.cached_tokens:
        into.cached_tokens = chunk.cached_tokens


@dataclass(slots=True)
class ModelInfo:
    served_model_name: str
    model_type: str = ""
    architectures: list[str] = field(default_factory=list)
    max_context_length: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    default_sampling: dict[str, Any] = field(default_factory=dict)
    tokenizer_path: str = ""

    @property
    def looks_harmony(self) -> bool:
        return (
            self.model_type == "gpt_oss"
            or "GptOssForCausalLM" in self.architectures
            or "gpt-oss" in self.served_model_name.lower()
        )

    @staticmethod
    def parse_sampling_json(*blobs: str) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for blob in blobs:
            if not blob:
                continue
            try:
                value = json.loads(blob)
            except ValueError:
                continue
            if isinstance(value, dict):
                merged.update(value)
        return merged


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine protocol can do, declared by its client so the rest of the gateway never probes.

    A request that needs something the engine cannot do is refused with a 400 naming the parameter
    (`check_request`), never silently served without it.
    """

    #: "tokens": the engine takes rendered ids and returns ids (gRPC); "text": an OpenAI-compatible
    #: server that tokenizes and parses itself (HTTP upstreams).
    wire: Literal["tokens", "text"] = "tokens"
    #: Text wire only: the OpenAI endpoint the upstream is told to use ("chat", "completions", "auto").
    text_api: str = ""
    #: Several choices per request (`n` > 1).
    n: bool = True
    #: Stop strings matched by the engine (Harmony stop strings are matched by the gateway anyway).
    stop_strings: bool = True
    #: Constrained decoding (structural tags, JSON schemas, regexes).
    constraints: bool = True
    #: Honours `SamplingOptions.stream_interval` per request (fewer, larger stream messages).
    stream_interval: bool = False
    #: Answers `server_info()` (PD bootstrap port, KV role).
    server_info: bool = False
    #: Answers `get_tokenizer()` (the engine's tokenizer files as a zip).
    tokenizer: bool = False
    #: The engine stops on EOS ids it was not sent; False means every stop id must be listed.
    implicit_stops: bool = True
    #: Streams its KV-cache events and pushed load records (`subscribe_kv_events()`).
    kv_events: bool = False
    #: Answers a load poll (`loads()`: GetLoads), the fallback while no load records are pushed.
    loads: bool = False

    def check_request(self, request: GenerateRequest, engine: str) -> None:
        """Raise InvalidRequest (400) naming the parameter the engine cannot honour."""
        s = request.sampling
        if s.n > 1 and not self.n:
            raise InvalidRequest(
                f"the {engine} engine serving this model cannot return n > 1 choices", param="n"
            )
        if s.stop and not self.stop_strings:
            raise InvalidRequest(
                f"the {engine} engine serving this model cannot stop on strings", param="stop"
            )
        if not self.constraints and (s.json_schema or s.regex or s.structural_tag):
            raise InvalidRequest(
                f"the {engine} engine serving this model has no constrained decoding, which "
                f"{s.constraint_param or 'this request'} needs",
                param=s.constraint_param or "response_format",
            )


#: What every engine protocol can do: one choice, stopping on token ids, unconstrained.
BASIC_CAPABILITIES = EngineCapabilities(stop_strings=False, constraints=False, n=False)
#: What an `--engine auto` client reports before it knows the protocol: nothing beyond the basics.
UNKNOWN_CAPABILITIES = BASIC_CAPABILITIES


class EngineClient(Protocol):
    """One connection to one engine worker. Implementations reuse one channel for all requests."""

    url: str

    @property
    def engine(self) -> str:
        """The protocol's name ("sglang", "vllm", "mlx", "trtllm", "tokenspeed", "http"; "auto" until known)."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities: ...

    async def model_info(self, timeout: float = 10.0) -> ModelInfo: ...

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """Only when `capabilities.server_info`."""
        ...

    async def get_tokenizer(self, timeout: float = 60.0) -> bytes:
        """Only when `capabilities.tokenizer`: the tokenizer files as zip bytes, checked by SHA-256."""
        ...

    async def health(self, timeout: float) -> bool: ...

    def subscribe_kv_events(self, start_sequence: int) -> AsyncGenerator[KvBatch, None]:
        """Only when `capabilities.kv_events`: the engine's KV-event batches from `start_sequence` (0 = the
        current state on). Raises `KvStreamLost` when the relay cannot resume from there (the caller
        clears what it knew and starts over from 0), `KvEventsUnavailable` when the engine runs without
        a publisher, and `UpstreamError` when the stream breaks. Closing the generator ends the call."""
        ...

    async def loads(self, timeout: float) -> EngineLoad:
        """Only when `capabilities.loads`: the engine's load now (GetLoads; data-parallel ranks summed)."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        """Stream chunks for every choice; raises errors.Upstream* on failure. Cancelling the iteration
        does not abort the engine request: callers call `abort` (dispatch does, shielded)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def close(self) -> None: ...
