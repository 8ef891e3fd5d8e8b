"""Runs the simulated engine: a real `grpc.aio` server speaking the SGLang or vLLM engine protocol.

`start_sim_engine(SimConfig(...))` binds the server and returns a `RunningSim` (address, received
requests, aborts, failure injection, `stop()`), used as `async with await start_sim_engine(cfg) as sim:`.
`SimCore` holds what both protocol servicers share: the script, request recording, the simulated prefix
cache, stop/length rules, pacing, abort wake-ups and injected failures. The servicers
(`sglang_server.py`, `vllm_server.py`) only translate between their wire messages and the core.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from harmony_gateway.harmony.encoding import RETURN

from .script import HarmonyScript, TextScript, echo_reply

log = logging.getLogger(__name__)

HARMONY_EOS_IDS: tuple[int, ...] = (200002, 199999, 200012)
PREFIX_PAGE = 16
_FAKE_VOCAB = 199998

EngineKind = Literal["sglang", "vllm", "mlx", "trtllm", "tokenspeed"]
Mode = Literal["regular", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the simulated engine behaves; every field is documented in docs/simulated-engine.md.

    `port=0` picks a free port. `output_tokens` pads/trims the Harmony reply to that length when possible.
    `tokens_per_second=None` sends without delay; `ttft_ms` delays the first token. `strip_stop_token`
    omits the final stop token from output ids (Complete.matched_token_id still names it).
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "openai/gpt-oss-20b"
    harmony: bool = True
    engine: EngineKind = "sglang"
    tokens_per_second: float | None = None
    ttft_ms: float = 0.0
    output_tokens: int | None = None
    tokens_per_chunk: int = 1
    mode: Mode = "regular"
    bootstrap_port: int = 8998
    strip_stop_token: bool = False
    max_context_length: int = 131072
    eos_token_id: int = 2
    record_requests: bool = True
    #: Non-Harmony mode: a tokenizer folder (tokenizer.json); the model then answers with `replies`
    #: (`script.TextScript`) and `GetTokenizer` streams the folder as a zip.
    tokenizer_path: str | None = None
    replies: tuple[tuple[str, str], ...] = ()
    #: Whether GetModelInfo names the gpt-oss model type and architecture (None: when `harmony`).
    #: `harmony=True` with False is a Harmony fine-tune under another name: it needs `--harmony-models`.
    reports_gpt_oss: bool | None = None

    @property
    def looks_gpt_oss(self) -> bool:
        return self.harmony if self.reports_gpt_oss is None else self.reports_gpt_oss

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return HARMONY_EOS_IDS if self.harmony else (self.eos_token_id,)

    @property
    def primary_eos_id(self) -> int:
        return RETURN if self.harmony else self.eos_token_id


@dataclass(slots=True)
class ReceivedRequest:
    """One Generate call as the engine saw it. `sampling` holds the explicitly set fields only."""

    request_id: str
    input_ids: list[int]
    sampling: dict[str, Any]
    stream: bool
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    #: The call's gRPC metadata (e.g. `traceparent`), keys lower-case.
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ChoicePlan:
    """What one choice will emit. `ids` runs up to and including the stop token; when `hide_last` the
    engine omits that token on the wire but still counts it as generated."""

    index: int
    ids: list[int]
    finish_reason: str
    matched_token_id: int | None = None
    hide_last: bool = False
    sent: int = 0
    done: bool = False

    def visible(self, start: int, end: int) -> list[int]:
        if self.hide_last and end == len(self.ids):
            return self.ids[start : end - 1]
        return self.ids[start:end]

    @property
    def visible_ids(self) -> list[int]:
        return self.visible(0, len(self.ids))


@dataclass(frozen=True, slots=True)
class Step:
    """One streamed piece of one choice: tokens `plan.ids[start:end]`; `last` closes the choice."""

    plan: ChoicePlan
    start: int
    end: int
    last: bool


class SimulatedFailure(Exception):
    """Raised inside a Generate call when `fail_next` armed a failure; the servicer aborts with `code`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class PromptRejected(ValueError):
    """Raised when a prompt cannot be served (longer than the context); maps to INVALID_ARGUMENT."""


@dataclass(slots=True)
class _Failure:
    code: grpc.StatusCode
    after_tokens: int
    message: str


class PrefixCache:
    """Approximate radix cache: chained hashes of 16-token pages of every prompt seen (bounded).

    `lookup_and_insert` returns how many leading tokens an earlier prompt shared, in whole pages and never
    the whole prompt (the last token is always computed), as paged engines report `cached_tokens`.
    """

    def __init__(self, max_pages: int = 200_000) -> None:
        self._pages: dict[int, None] = {}
        self._max_pages = max_pages

    def lookup_and_insert(self, ids: Sequence[int]) -> int:
        usable = (len(ids) - 1) // PREFIX_PAGE
        chain = 0
        cached = 0
        matching = True
        for page in range(usable):
            chain = hash((chain, tuple(ids[page * PREFIX_PAGE : (page + 1) * PREFIX_PAGE])))
            if matching and chain in self._pages:
                cached += PREFIX_PAGE
            else:
                matching = False
                self._pages[chain] = None
        if len(self._pages) > self._max_pages:
            self._pages.clear()
        return cached


class FrameCache:
    """Serialized stream frames (by the start of their token span) per choice and request shape (LRU).

    Benchmarks repeat prompts; reusing the bytes of every chunk keeps the sim's CPU per streamed token
    close to the bare gRPC cost on the 2-core box it shares with the gateway.
    """

    def __init__(self, size: int = 256) -> None:
        self._frames: OrderedDict[Hashable, tuple[dict[int, bytes], bytes]] = OrderedDict()
        self._size = size

    def get(
        self, key: Hashable, build: Callable[[], tuple[dict[int, bytes], bytes]]
    ) -> tuple[dict[int, bytes], bytes]:
        frames = self._frames.get(key)
        if frames is None:
            frames = build()
            self._frames[key] = frames
            if len(self._frames) > self._size:
                self._frames.popitem(last=False)
        else:
            self._frames.move_to_end(key)
        return frames


def serialize_response(message: Any) -> bytes:
    """Response serializer that also passes pre-serialized frames through unchanged."""
    if isinstance(message, bytes):
        return message
    data: bytes = message.SerializeToString()
    return data


def capture_handlers(add_servicer: Callable[[Any, Any], None], servicer: Any) -> dict[str, Any]:
    """The method handlers a generated `add_*Servicer_to_server` would register, for adjusting one."""

    class _Capture:
        handlers: dict[str, Any] = {}

        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
            self.handlers = dict(handlers)

    capture = _Capture()
    add_servicer(servicer, capture)
    return capture.handlers


class Run:
    """One in-flight Generate call: abort flag, armed failure and abortable pacing."""

    __slots__ = ("aborted", "cached_tokens", "failure", "request_id", "_core", "_waiter")

    def __init__(self, core: SimCore, request_id: str, cached_tokens: int, failure: _Failure | None) -> None:
        self._core = core
        self.request_id = request_id
        self.cached_tokens = cached_tokens
        self.failure = failure
        self.aborted = False
        self._waiter: asyncio.Future[None] | None = None

    def abort(self) -> None:
        self.aborted = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Sleep unless aborted; an Abort wakes it at once (asyncio.sleep's own mechanism, made wakeable)."""
        if seconds <= 0 or self.aborted:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(seconds, _resolve, waiter)
        self._waiter = waiter
        try:
            await waiter
        finally:
            handle.cancel()
            self._waiter = None

    async def wait_open(self, gate: asyncio.Event) -> None:
        """Wait until `gate` is set (`RunningSim.hold`) unless aborted: an Abort wakes it at once."""
        if gate.is_set() or self.aborted:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        opened = asyncio.ensure_future(gate.wait())
        opened.add_done_callback(lambda _: _resolve(waiter))
        self._waiter = waiter
        try:
            await waiter
        finally:
            opened.cancel()
            self._waiter = None

    def check_failure(self, sent_after_step: int) -> None:
        failure = self.failure
        if failure is not None and sent_after_step > failure.after_tokens:
            self.failure = None
            raise SimulatedFailure(failure.code, failure.message)

    def fail_if_armed(self) -> None:
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise SimulatedFailure(failure.code, failure.message)

    async def stream_steps(
        self, plans: list[ChoicePlan], chunk: int, *, first_alone: bool = False
    ) -> AsyncIterator[Step]:
        """Steps for all choices, interleaved as a batching engine emits them, paced by the config.
        `first_alone`: the first token goes out on its own, then `chunk` at a time (`chunk_spans`).

        On Abort it stops; the caller reports unfinished choices (`plan.done` false) as aborted.
        """
        core = self._core
        chunk = max(1, chunk)
        total = sum(len(p.ids) for p in plans)
        if self.failure is not None:
            # An armed failure always fires before the last token, so the stream never completes.
            self.failure.after_tokens = min(self.failure.after_tokens, max(total - 1, 0))
            if self.failure.after_tokens == 0:
                self.fail_if_armed()
        if core.gate is not None and core.gate_after <= 0:
            await self.wait_open(core.gate)
        await self.wait(core.ttft)
        sent = 0
        spans = {plan.index: chunk_spans(len(plan.ids), chunk, first_alone=first_alone) for plan in plans}
        step_no = 0
        while not self.aborted:
            # A mid-stream hold is read at every step, so a test can release one and arm the next at once.
            gate = core.gate
            if gate is not None and 0 < core.gate_after <= sent and not gate.is_set():
                await self.wait_open(gate)
                continue
            size = chunk
            for plan in plans:
                if plan.done:
                    continue
                pos, end = spans[plan.index][step_no]
                size = end - pos if end > pos else chunk
                self.check_failure(sent + (end - pos))
                if self.aborted:
                    return
                last = step_no == len(spans[plan.index]) - 1
                plan.sent = end
                plan.done = last
                sent += end - pos
                yield Step(plan, pos, end, last)
            if all(p.done for p in plans):
                return
            step_no += 1
            await self.wait(size * core.token_delay)

    async def wait_whole(self, plans: list[ChoicePlan]) -> None:
        """Non-stream timing: first-token delay plus the longest choice at the configured rate."""
        longest = max((len(p.ids) for p in plans), default=0)
        if self._core.gate is not None and self._core.gate_after <= 0:
            await self.wait_open(self._core.gate)
        await self.wait(self._core.ttft + longest * self._core.token_delay)
        self.fail_if_armed()


def chunk_spans(length: int, size: int, *, first_alone: bool = False) -> list[tuple[int, int]]:
    """The [start, end) token spans a stream of `length` tokens goes out in, `size` at a time. With
    `first_alone` the first token goes out at once and then `size` at a time, as SGLang honours a
    request's `stream_interval`. An empty stream is one empty span (its closing message)."""
    spans: list[tuple[int, int]] = []
    start = 0
    if first_alone and size > 1 and length > 1:
        spans.append((0, 1))
        start = 1
    while start < length:
        spans.append((start, min(start + size, length)))
        start += size
    return spans or [(0, 0)]


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def fake_logprob(token_id: int, position: int) -> float:
    """A deterministic, plausible logprob in (-1, 0]."""
    return -((token_id * 7 + position * 13) % 1000) / 1000.0


def fake_top_logprobs(token_id: int, position: int, count: int) -> tuple[list[float], list[int]]:
    """`count` alternatives, the sampled token first, each later one less likely."""
    first = fake_logprob(token_id, position)
    values = [first - 0.5 * k for k in range(count)]
    ids = [token_id] + [(token_id + k) % _FAKE_VOCAB for k in range(1, count)]
    return values, ids


class SimCore:
    """State shared by the protocol servicers of one simulated engine."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.script = HarmonyScript(output_tokens=config.output_tokens) if config.harmony else None
        self.text_script = (
            TextScript(config.tokenizer_path, config.replies, config.eos_token_id)
            if not config.harmony and config.tokenizer_path
            else None
        )
        self.requests: list[ReceivedRequest] = []
        self.aborted: list[str] = []
        self.healthy = True
        self.started_at = time.time()
        self.last_receive = 0.0
        self.total_requests = 0
        self.ttft = config.ttft_ms / 1000.0
        self.token_delay = 1.0 / config.tokens_per_second if config.tokens_per_second else 0.0
        self._runs: dict[str, Run] = {}
        #: Most Generate calls in flight at once (admission tests assert a cap through it).
        self.peak_active = 0
        #: While set and not open, Generate calls wait here once they have streamed `gate_after` tokens
        #: (0: before their first token; `RunningSim.hold`).
        self.gate: asyncio.Event | None = None
        self.gate_after = 0
        self._failures: deque[_Failure] = deque()
        self._prefix = PrefixCache()
        self.frames = FrameCache()

    @property
    def active(self) -> int:
        return len(self._runs)

    def fail_next(self, code: grpc.StatusCode, after_tokens: int, message: str) -> None:
        self._failures.append(_Failure(code, after_tokens, message))

    def admit(self, received: ReceivedRequest) -> Run:
        """Record the request and register it for Abort; callers must `release` it."""
        self.total_requests += 1
        self.last_receive = time.time()
        if self.config.record_requests:
            self.requests.append(received)
        failure = self._failures.popleft() if self._failures else None
        cached = self._prefix.lookup_and_insert(received.input_ids)
        run = Run(self, received.request_id, cached, failure)
        self._runs[received.request_id] = run
        self.peak_active = max(self.peak_active, len(self._runs))
        return run

    def release(self, run: Run) -> None:
        if self._runs.get(run.request_id) is run:
            del self._runs[run.request_id]

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        run = self._runs.get(request_id)
        if run is None:
            return False
        run.abort()
        return True

    def plan(
        self,
        input_ids: list[int],
        *,
        n: int,
        max_new_tokens: int | None,
        stop_token_ids: Sequence[int],
        ignore_eos: bool,
        eos_is_matched: bool = True,
    ) -> list[ChoicePlan]:
        """Each choice's tokens after the stop and length rules.

        The script's reply is cut at the first token in `stop_token_ids` (plus the EOS ids unless
        `ignore_eos`), inclusive, finish "stop"; then at `max_new_tokens` and the context window, finish
        "length". `eos_is_matched=False` leaves matched_token_id unset when the primary EOS stopped the
        choice, as vLLM does. Raises PromptRejected when the prompt fills the context.
        """
        config = self.config
        room = config.max_context_length - len(input_ids)
        if room <= 0:
            raise PromptRejected(
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"({config.max_context_length} tokens)."
            )
        limit = room if max_new_tokens is None else min(max_new_tokens, room)
        stops = set(stop_token_ids)
        if not ignore_eos:
            stops.update(config.eos_token_ids)
        key = tuple(input_ids)
        plans: list[ChoicePlan] = []
        for index in range(max(n, 1)):
            if self.script is not None:
                reply = self.script.reply(input_ids, index, key=key)
            elif self.text_script is not None:
                reply = self.text_script.reply(input_ids)
            else:
                reply = echo_reply(input_ids, config.eos_token_id)
            cut = next((i for i, t in enumerate(reply) if t in stops), None)
            ids = reply if cut is None else reply[: cut + 1]
            if len(ids) > limit:
                plans.append(ChoicePlan(index, ids[:limit], "length"))
                continue
            matched = ids[-1] if cut is not None else None
            hide = matched is not None and config.strip_stop_token
            if matched == config.primary_eos_id and not eos_is_matched:
                matched = None
            plans.append(ChoicePlan(index, ids, "stop", matched, hide))
        return plans


class RunningSim:
    """A started simulated engine. Use `async with await start_sim_engine(cfg) as sim:`; `stop()` ends it.

    `requests` and `aborted` grow as calls arrive; `fail_next` makes the next Generate fail with a gRPC
    status, before any token (`after_tokens=0`) or once that many tokens were streamed.
    """

    def __init__(
        self, config: SimConfig, server: grpc.aio.Server, core: SimCore, health_servicer: Any, port: int
    ) -> None:
        self.config = config
        self.port = port
        self.address = f"{config.host}:{port}"
        self.url = f"grpc://{self.address}"
        self._server = server
        self._core = core
        self._health = health_servicer
        self._stopped = False

    @property
    def requests(self) -> list[ReceivedRequest]:
        return self._core.requests

    @property
    def aborted(self) -> list[str]:
        return self._core.aborted

    @property
    def active_requests(self) -> int:
        return self._core.active

    @property
    def peak_active(self) -> int:
        """Most Generate calls in flight at once since start."""
        return self._core.peak_active

    def hold(self, after_tokens: int = 0) -> None:
        """Generate calls from now on wait before their first token until `release_held()`: a test holds
        streams open as long as it needs, with no timing. With `after_tokens`, every stream (those under
        way too) waits instead once it has sent that many tokens: `release_held(); hold(after_tokens=M)`
        lets a held stream go on to the next point M."""
        self._core.gate = asyncio.Event()
        self._core.gate_after = after_tokens

    def release_held(self) -> None:
        if self._core.gate is not None:
            self._core.gate.set()
        self._core.gate = None

    def fail_next(
        self,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        after_tokens: int = 0,
        message: str = "simulated engine failure",
    ) -> None:
        """Arm a one-shot failure for the next Generate call (call again to arm more, in order)."""
        self._core.fail_next(code, after_tokens, message)

    async def set_healthy(self, healthy: bool) -> None:
        """Flip HealthCheck and the grpc.health.v1 status (SERVING / NOT_SERVING)."""
        self._core.healthy = healthy
        status = (
            health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", _service_name(self.config.engine)):
            await self._health.set(name, status)

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving; in-flight calls are cancelled (after `grace` seconds if given). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self._server.stop(grace)

    async def __aenter__(self) -> RunningSim:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


def _protocols() -> dict[str, Any]:
    """Engine name → the module of its servicer (`SERVICE_NAME`, the servicer class, `add_to_server`)."""
    from . import mlx_server, sglang_server, tokenspeed_server, trtllm_server, vllm_server

    return {
        "sglang": (sglang_server, sglang_server.SimSglangScheduler),
        "vllm": (vllm_server, vllm_server.SimVllmEngine),
        "mlx": (mlx_server, mlx_server.SimMlxEngine),
        "trtllm": (trtllm_server, trtllm_server.SimTrtllmService),
        "tokenspeed": (tokenspeed_server, tokenspeed_server.SimTokenSpeedScheduler),
    }


def _service_name(engine: EngineKind) -> str:
    name: str = _protocols()[engine][0].SERVICE_NAME
    return name


async def start_sim_engine(config: SimConfig) -> RunningSim:
    """Bind and start the simulated engine; raises OSError when the port cannot be bound."""
    protocols = _protocols()
    if config.engine not in protocols:
        raise ValueError(f"unknown engine {config.engine!r}; expected one of {', '.join(protocols)}")
    core = SimCore(config)
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", 4096),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
    )
    module, servicer = protocols[config.engine]
    module.add_to_server(servicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(f"{config.host}:{config.port}")
    except RuntimeError as exc:
        raise OSError(f"cannot bind the simulated engine to {config.host}:{config.port}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot bind the simulated engine to {config.host}:{config.port}")
    await server.start()
    for name in ("", _service_name(config.engine)):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningSim(config, server, core, health_servicer, port)


async def serve_forever(config: SimConfig) -> None:
    """Run until SIGINT/SIGTERM (the `harmony-gateway sim` command)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Handlers go in before the port opens, so anyone who can reach the port can also stop it cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        sim = await start_sim_engine(config)
        log.warning(
            "simulated %s engine on %s (model=%s, harmony=%s, mode=%s)",
            config.engine,
            sim.url,
            config.model,
            config.harmony,
            config.mode,
        )
        try:
            await stop.wait()
        finally:
            await sim.stop(grace=1.0)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def parse_kv_transfer_params(text: str) -> dict[str, Any]:
    """vLLM's `kv_transfer_params_json`: a JSON object, else PromptRejected (INVALID_ARGUMENT)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise PromptRejected(f"kv_transfer_params_json is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise PromptRejected("kv_transfer_params_json must be a JSON object")
    return value


__all__ = [
    "ChoicePlan",
    "FrameCache",
    "PrefixCache",
    "PromptRejected",
    "ReceivedRequest",
    "RunningSim",
    "SimConfig",
    "SimCore",
    "SimulatedFailure",
    "Step",
    "capture_handlers",
    "fake_logprob",
    "fake_top_logprobs",
    "serialize_response",
    "serve_forever",
    "start_sim_engine",
]
