"""Plumbing the gRPC engine clients share.

`GrpcEngineClient` owns one channel per worker (`CHANNEL_OPTIONS`, `grpc_target`), answers `health`,
`model_info` and `close` for the wires whose messages for those RPCs are spelled alike, and
`subscribe_kv_events` and `loads` on the wires whose capabilities declare them (`kv_wire.py`), starts and
cancels `Generate` (`_generate_call`), and normalises the stream of the scheduler-style wires (SGLang,
TokenSpeed, vLLM, MLX) into `EngineChunk`s, so `pipeline/` sees one shape. `sampling_fields` copies the
sampling fields the wires share, `token_logprobs` converts an `OutputLogProbs` message. What a wire
spells its own way (the rest of its request, TRT-LLM's stream) stays in its engine module.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from types import ModuleType
from typing import Any, ClassVar

import grpc
from smg_grpc_proto.generated import common_pb2

from ..errors import InvalidRequest, UpstreamError
from ..observability.tracing import grpc_metadata
from .base import (
    EngineCapabilities,
    EngineChunk,
    GenerateRequest,
    ModelInfo,
    SamplingOptions,
    TokenLogprob,
    redact_url,
)
from .grpc_errors import map_grpc_errors
from .kv_events import EngineLoad, KvBatch
from .kv_wire import LOAD_SECTIONS, kv_event_stream, loads_answer

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """Metadata for an engine call: the W3C trace context (`traceparent`), which SGLang and vLLM read,
    while tracing is on; None otherwise."""
    return grpc_metadata()


def grpc_target(url: str) -> str:
    for prefix in ("grpc://", "grpcs://"):
        if url.startswith(prefix):
            return url[len(prefix) :].rstrip("/")
    return url


def token_logprobs(lp: Any, start: int = 0) -> list[TokenLogprob] | None:
    """`OutputLogProbs` as `TokenLogprob`s from position `start`; None when it carries no tokens."""
    if lp is None or not lp.token_ids:
        return None
    out = []
    tops = lp.top_logprobs
    for i, (tid, value) in enumerate(zip(lp.token_ids, lp.token_logprobs, strict=False)):
        top = []
        if i < len(tops):
            top = list(zip(tops[i].token_ids, tops[i].values, strict=False))
        out.append(TokenLogprob(tid, value, top))
    return out[start:]


#: `SamplingOptions` fields every engine wire takes under the same name and meaning (TRT-LLM's
#: `SamplingConfig` too). Not `top_k`: -1 disables it here, 0 on the wires where it is unsigned.
SHARED_SAMPLING = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
#: The stop and choice fields the full scheduler wires (SGLang, TokenSpeed, vLLM) take under our names too.
SHARED_STOPS = ("stop", "stop_token_ids", "skip_special_tokens", "ignore_eos", "n")


def sampling_fields(sampling: SamplingOptions, names: Iterable[str]) -> dict[str, Any]:
    """`sampling`'s values of the fields `names`, as keyword arguments of a wire's sampling message."""
    return {name: getattr(sampling, name) for name in names}


def int32_seed(seed: int) -> int:
    """`seed` on a wire that carries int32 (OpenAI allows 64-bit seeds): folded, deterministically."""
    return ((seed + 2**31) % 2**32) - 2**31


def set_constraint(params: Any, sampling: SamplingOptions) -> None:
    """Fill the `constraint` oneof both engine protos share: at most one of json_schema, regex or
    structural_tag, in that order of precedence."""
    if sampling.json_schema is not None:
        params.json_schema = sampling.json_schema
    elif sampling.regex is not None:
        params.regex = sampling.regex
    elif sampling.structural_tag is not None:
        params.structural_tag = sampling.structural_tag


def oneof_matched_stop(complete: Any) -> tuple[int | None, str | None]:
    """The matched stop of a `GenerateComplete` whose wire spells it as the `matched_stop` oneof
    (SGLang, TokenSpeed, vLLM, TRT-LLM): (stop token id, stop string), at most one set."""
    which = complete.WhichOneof("matched_stop")
    return (
        complete.matched_token_id if which == "matched_token_id" else None,
        complete.matched_stop_str if which == "matched_stop_str" else None,
    )


class GrpcEngineClient:
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`.

    A subclass names its wire in `_pb` (the generated `*_pb2` module) and `_stub_type` (its stub class),
    and declares what its engine can do in `capabilities`.
    """

    engine: ClassVar[str]
    capabilities: ClassVar[EngineCapabilities]
    #: The wire's stream chunks count the tokens of that chunk (vLLM), not all so far (SGLang).
    _delta_counts: ClassVar[bool] = False
    # Set once per subclass; not declared ClassVar, which would make mypy bind the stub class as a method
    # and reject the plain `_pb = module` assignments of the subclasses.
    _pb: ModuleType
    _stub_type: Callable[[grpc.aio.Channel], Any]

    def __init__(self, url: str, *, request_timeout: float = 600.0) -> None:
        self.url = redact_url(url)  # for messages only
        self._channel = grpc.aio.insecure_channel(grpc_target(url), options=CHANNEL_OPTIONS)
        self._stub = self._stub_type(self._channel)
        self._request_timeout = request_timeout
        #: Learned from GetModelInfo: ids at or above it never reach the engine (0: unknown).
        self.vocab_size = 0
        self.eos_token_ids: list[int] = []
        #: `max_tokens` for a request without a budget, on wires where unset means "the whole context".
        self.default_max_tokens = 4096

    def check(self, request: GenerateRequest) -> None:
        """Refuse, before anything is sent, what the engine cannot do or must never see: a 400 naming the
        parameter. Some engines spin on an empty prompt or index past their embedding table."""
        ids = request.input_ids
        if not ids:
            raise InvalidRequest("the prompt is empty: the engine needs at least one token", param="prompt")
        if self.vocab_size and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise InvalidRequest(
                f"token id {bad} is outside the model's vocabulary (0 to {self.vocab_size - 1})",
                param="prompt",
            )
        self.capabilities.check_request(request, self.engine)

    async def get_tokenizer(self, timeout: float = 60.0) -> bytes:
        """The engine's tokenizer files as zip bytes (GetTokenizer streams them in chunks; the last
        carries the SHA-256). Raises UpstreamError on a digest mismatch or an empty answer."""
        parts: list[bytes] = []
        digest = ""
        with map_grpc_errors(self.url):
            async for chunk in self._stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout):
                parts.append(chunk.data)
                digest = chunk.sha256 or digest
        data = b"".join(parts)
        if not data:
            raise UpstreamError(f"engine at {self.url} sent an empty tokenizer")
        if digest and hashlib.sha256(data).hexdigest() != digest.lower():
            raise UpstreamError(f"the tokenizer sent by {self.url} does not match its SHA-256")
        return data

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        raise NotImplementedError  # each engine module normalises its own stream

    def to_proto(self, request: GenerateRequest) -> Any:
        """The wire's `GenerateRequest` message for `request`."""
        raise NotImplementedError

    async def _generate_message(self, request: GenerateRequest) -> Any:
        """The message `generate` sends: `to_proto(request)`, on wires that need nothing else to know."""
        return self.to_proto(request)

    async def _scheduler_stream(
        self, request: GenerateRequest, matched_stop: Callable[[Any], tuple[int | None, str | None]]
    ) -> AsyncGenerator[EngineChunk, None]:
        """`Generate` on the scheduler-style wires (SGLang, TokenSpeed, vLLM, MLX: one `chunk` /
        `complete` oneof with the same field names), normalised: chunks carry new token ids; in stream
        mode the final `GenerateComplete` repeats the last chunk's ids (smg_grpc_servicer), so only its
        finish reason, counts and matched stop count. Where chunks count only their own tokens
        (`_delta_counts`), the counts become running totals per choice. The request is checked when the
        stream is first read."""
        self.check(request)
        stream = request.stream
        want_logprobs = request.return_logprob
        delta_counts = self._delta_counts
        generated: dict[int, int] = {}  # running completion count per choice, when chunks carry deltas
        with self._generate_call(await self._generate_message(request)) as call:
            async for reply in call:
                which = reply.WhichOneof("response")
                if which == "chunk":
                    c = reply.chunk
                    completion = c.completion_tokens
                    if delta_counts:
                        completion = generated[c.index] = generated.get(c.index, 0) + completion
                    yield EngineChunk(
                        c.index,
                        list(c.token_ids),
                        c.prompt_tokens,
                        completion,
                        c.cached_tokens,
                        token_logprobs(c.output_logprobs) if want_logprobs else None,
                    )
                elif which == "complete":
                    c = reply.complete
                    stop_token, stop_str = matched_stop(c)
                    yield EngineChunk(
                        c.index,
                        [] if stream else list(c.output_ids),
                        c.prompt_tokens,
                        max(generated.get(c.index, 0), c.completion_tokens),
                        c.cached_tokens,
                        None if stream or not want_logprobs else token_logprobs(c.output_logprobs),
                        True,
                        c.finish_reason or "stop",
                        stop_token,
                        stop_str,
                    )

    @contextlib.contextmanager
    def _generate_call(self, message: Any) -> Iterator[Any]:
        """`Generate` with `message`, a stream of replies: a failed call surfaces as `errors.Upstream*`,
        and the call is cancelled on every exit, so an abandoned stream does not keep the engine busy."""
        call = self._stub.Generate(message, timeout=self._request_timeout, metadata=call_metadata())
        try:
            with map_grpc_errors(self.url):
                yield call
        finally:
            if not call.done():
                call.cancel()

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        raise NotImplementedError

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """Overridden by engines whose `capabilities.server_info` is set."""
        raise UpstreamError(f"the {self.engine} engine at {self.url} has no server info")

    def subscribe_kv_events(self, start_sequence: int) -> AsyncGenerator[KvBatch, None]:
        """`SubscribeKvEvents` (the same `common.proto` messages on every wire that has it), on engines
        whose `capabilities.kv_events` is set; see `kv_wire.kv_event_stream`."""
        if not self.capabilities.kv_events:
            raise UpstreamError(f"the {self.engine} engine at {self.url} publishes no KV events")
        return kv_event_stream(self._stub.SubscribeKvEvents, self.url, start_sequence, call_metadata())

    async def loads(self, timeout: float) -> EngineLoad:
        """`GetLoads` (core figures, ranks combined), on engines whose `capabilities.loads` is set."""
        if not self.capabilities.loads:
            raise UpstreamError(f"the {self.engine} engine at {self.url} reports no load")
        with map_grpc_errors(self.url):
            answer = await self._stub.GetLoads(
                self._pb.GetLoadsRequest(include=LOAD_SECTIONS), timeout=timeout
            )
        return loads_answer(answer)

    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        with map_grpc_errors(self.url):
            info = await self._stub.GetModelInfo(self._pb.GetModelInfoRequest(), timeout=timeout)
        self.vocab_size = info.vocab_size
        self.eos_token_ids = list(info.eos_token_ids)
        return ModelInfo(
            served_model_name=info.served_model_name or info.model_path,
            model_type=info.model_type,
            architectures=list(info.architectures),
            max_context_length=info.max_context_length,
            eos_token_ids=list(info.eos_token_ids),
            default_sampling=self._default_sampling(info),
            tokenizer_path=self._tokenizer_path(info),
        )

    @staticmethod
    def _default_sampling(info: Any) -> dict[str, Any]:
        """The sampling defaults a `GetModelInfoResponse` advertises."""
        return ModelInfo.parse_sampling_json(info.default_sampling_params_json)

    @staticmethod
    def _tokenizer_path(info: Any) -> str:
        """Where a `GetModelInfoResponse` says the engine's tokenizer files are."""
        return str(info.tokenizer_path)

    async def health(self, timeout: float) -> bool:
        with map_grpc_errors(self.url):
            reply = await self._stub.HealthCheck(self._pb.HealthCheckRequest(), timeout=timeout)
        return bool(reply.healthy)

    async def close(self) -> None:
        await self._channel.close(grace=None)


__all__ = ["CHANNEL_OPTIONS", "GrpcEngineClient", "grpc_target", "token_logprobs"]
