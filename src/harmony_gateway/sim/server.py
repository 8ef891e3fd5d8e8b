"""Runs the simulated engine: a real `grpc.aio` server speaking the SGLang or vLLM engine protocol.

`start_sim_engine(SimConfig(...))` binds the server and returns a `RunningSim` (address, received
requests, aborts, failure injection, `stop()`), used as `async with await start_sim_engine(cfg) as sim:`.
`SimCore` holds what every protocol servicer shares: the script, request recording, the block-level KV
cache (`kv_cache.py`), the scheduler with its timing model (`scheduler.py`), the KV-event relay
(`kv_relay.py`), stop/length rules, pacing, abort wake-ups and injected failures. The servicers
(`sglang_server.py`, `vllm_server.py`, ...) only translate between their wire messages and the core.
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

from .kv_cache import BlockCache, ClearedAll, HashStyle, chain_keys
from .kv_relay import DEFAULT_HISTORY, KvRelay, Publisher, RelayTiming
from .scheduler import LoadFigures, Scheduler, Ticket, Timing
from .script import HarmonyScript, TextScript, echo_reply

log = logging.getLogger(__name__)

HARMONY_EOS_IDS: tuple[int, ...] = (200002, 199999, 200012)
PREFIX_PAGE = 16
#: The KV capacity when none is configured: room for every test and demo prompt.
DEFAULT_KV_CAPACITY_TOKENS = 1_000_000
_FAKE_VOCAB = 199998

EngineKind = Literal["sglang", "vllm", "mlx", "trtllm", "tokenspeed"]
#: The engines whose wire carries `SubscribeKvEvents` (MLX's does not).
_PUBLISHERS: dict[str, Publisher] = {
    "sglang": "sglang",
    "vllm": "vllm",
    "trtllm": "trtllm",
    "tokenspeed": "tokenspeed",
}
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
    #: The KV cache: tokens per block and the capacity in tokens (whole blocks), LRU-evicted.
    block_size: int = PREFIX_PAGE
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS
    #: The timing model (docs/simulated-engine.md); all 0 keeps `ttft_ms` / `tokens_per_second` pacing.
    prefill_ms_per_token: float = 0.0
    decode_ms_per_token: float = 0.0
    decode_ms_per_running: float = 0.0
    #: The admission window: requests beyond it wait FIFO.
    max_running_requests: int = 1024
    #: `SubscribeKvEvents` (SGLang, vLLM, TRT-LLM, TokenSpeed) and the relay's history in batches.
    kv_events: bool = True
    kv_history_batches: int = DEFAULT_HISTORY
    #: The load-record cadence on the event stream (seconds): change checks, heartbeat, backoff.
    kv_load_tick_s: float = 0.1
    kv_heartbeat_s: float = 1.0
    kv_heartbeat_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        problems = [
            name
            for name, bad in (
                ("block_size must be at least 1", self.block_size < 1),
                ("kv_capacity_tokens must hold one block", self.kv_capacity_tokens < self.block_size),
                ("max_running_requests must be at least 1", self.max_running_requests < 1),
                ("kv_history_batches must be at least 1", self.kv_history_batches < 1),
                (
                    "the timing model's costs cannot be negative",
                    min(self.prefill_ms_per_token, self.decode_ms_per_token, self.decode_ms_per_running) < 0,
                ),
            )
            if bad
        ]
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def looks_gpt_oss(self) -> bool:
        return self.harmony if self.reports_gpt_oss is None else self.reports_gpt_oss

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return HARMONY_EOS_IDS if self.harmony else (self.eos_token_id,)

    @property
    def primary_eos_id(self) -> int:
        return RETURN if self.harmony else self.eos_token_id

    @property
    def timing(self) -> Timing:
        return Timing(self.prefill_ms_per_token, self.decode_ms_per_token, self.decode_ms_per_running)

    @property
    def hash_style(self) -> HashStyle:
        """How the engine hashes its blocks: TokenSpeed pages as SGLang does."""
        if self.engine in ("vllm", "trtllm"):
            return self.engine
        return "sglang"


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
    """One in-flight Generate call: its place in the scheduler, abort flag, armed failure and abortable
    pacing. `start` takes it through admission and prefill; `stream_steps` / `wait_whole` then pace its
    output. `cached_tokens` is known once `start` returned."""

    __slots__ = (
        "_core",
        "_started",
        "_waiter",
        "aborted",
        "cached_tokens",
        "failure",
        "plans",
        "request_id",
        "ticket",
    )

    def __init__(
        self, core: SimCore, request_id: str, input_ids: Sequence[int], failure: _Failure | None
    ) -> None:
        self._core = core
        self.request_id = request_id
        self.ticket = Ticket(input_ids)
        self.cached_tokens = 0
        self.plans: list[ChoicePlan] = []
        self.failure = failure
        self.aborted = False
        self._started = False
        self._waiter: asyncio.Future[None] | None = None

    def abort(self) -> None:
        self.aborted = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def _until(self, future: asyncio.Future[None]) -> None:
        """Wait for `future` unless aborted; an Abort wakes it at once."""
        self._waiter = future
        try:
            await future
        finally:
            self._waiter = None

    async def wait(self, seconds: float) -> None:
        """Sleep unless aborted; an Abort wakes it at once (asyncio.sleep's own mechanism, made wakeable)."""
        if seconds <= 0 or self.aborted:
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(seconds, _resolve, waiter)
        try:
            await self._until(waiter)
        finally:
            handle.cancel()

    async def start(self, plans: list[ChoicePlan], *, every_token: bool = False) -> None:
        """Admission (FIFO within the admission window and the KV capacity), the prefill of the uncached
        prompt, then `hold` and `ttft_ms`. Idempotent. `every_token`: the request streams each token as
        it is made (what the engine's silence is judged on)."""
        if self._started:
            return
        self._started = True
        core = self._core
        scheduler = core.scheduler
        ticket = self.ticket
        self.plans = plans
        ticket.out_tokens = sum(len(plan.ids) for plan in plans)
        ticket.reports = every_token
        admission = scheduler.enter(ticket)
        if admission is not None:
            await self._until(admission)
            if self.aborted:
                return
        self.cached_tokens = ticket.cached_blocks * core.config.block_size
        await self.wait(scheduler.prefill_seconds(ticket))
        scheduler.prefilled(ticket, aborted=self.aborted)
        if self.aborted:
            return
        if core.gate is not None and core.gate_after <= 0:
            await self.wait_open(core.gate)
        await self.wait(core.ttft)

    async def hold_while_wedged(self) -> None:
        """While the engine is wedged, wait (an Abort still wakes it)."""
        core = self._core
        while core.wedged and not self.aborted:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            core.wedge_waiters.add(future)
            try:
                await self._until(future)
            finally:
                core.wedge_waiters.discard(future)

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
        scheduler = core.scheduler
        chunk = max(1, chunk)
        total = sum(len(p.ids) for p in plans)
        if self.failure is not None:
            # An armed failure always fires before the last token, so the stream never completes.
            self.failure.after_tokens = min(self.failure.after_tokens, max(total - 1, 0))
            if self.failure.after_tokens == 0:
                self.fail_if_armed()
        await self.start(plans, every_token=chunk == 1)
        sent = 0
        spans = {plan.index: chunk_spans(len(plan.ids), chunk, first_alone=first_alone) for plan in plans}
        step_no = 0
        while not self.aborted:
            if core.wedged:
                await self.hold_while_wedged()
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
                scheduler.note_output(end - pos)
                yield Step(plan, pos, end, last)
            if all(p.done for p in plans):
                return
            step_no += 1
            await self.wait(scheduler.step_seconds(size))

    async def wait_whole(self, plans: list[ChoicePlan]) -> None:
        """Non-stream timing: admission and prefill, then the longest choice's decode steps."""
        await self.start(plans)
        longest = max((len(p.ids) for p in plans), default=0)
        scheduler = self._core.scheduler
        await self.wait(scheduler.step_seconds(longest))
        if self._core.wedged:
            await self.hold_while_wedged()
        if not self.aborted:
            scheduler.note_output(longest)
            for plan in plans:
                plan.sent = len(plan.ids)
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
        self.frames = FrameCache()
        #: While set, the engine emits nothing: requests hold their place and the silence grows.
        self.wedged = False
        self.wedge_waiters: set[asyncio.Future[None]] = set()
        publisher = _PUBLISHERS.get(config.engine) if config.kv_events else None
        self.relay = (
            KvRelay(
                publisher,
                block_size=config.block_size,
                history=config.kv_history_batches,
                timing=RelayTiming(
                    config.kv_load_tick_s, config.kv_heartbeat_s, config.kv_heartbeat_backoff_s
                ),
            )
            if publisher is not None
            else None
        )
        self.cache = BlockCache(
            config.block_size,
            config.kv_capacity_tokens // config.block_size,
            config.hash_style,
            on_change=self.relay.emit if self.relay is not None else None,
        )
        self.scheduler = Scheduler(
            self.cache,
            config.timing,
            config.max_running_requests,
            token_delay=self.token_delay,
            # vLLM keeps a second physical copy of a block two requests computed at once.
            physical_copies=config.engine == "vllm",
            on_change=self.relay.poke if self.relay is not None else None,
        )
        if self.relay is not None:
            self.relay.attach(self.cache, self.scheduler.figures, lambda: self.scheduler.busy)
            if self.relay.startup_clear:
                self.relay.emit(ClearedAll())

    @property
    def active(self) -> int:
        return len(self._runs)

    def figures(self) -> LoadFigures:
        return self.scheduler.figures()

    def publish(self) -> None:
        """Publish the changes made so far as their own batch (a test control is a step of its own)."""
        if self.relay is not None:
            self.relay.flush()

    def wedge(self) -> None:
        self.wedged = True

    def unwedge(self) -> None:
        self.wedged = False
        for future in self.wedge_waiters:
            if not future.done():
                future.set_result(None)
        self.wedge_waiters.clear()

    def flush(self, *, force: bool = False) -> bool:
        """Empty the KV cache (`AllBlocksCleared`); refused (False) while requests are in flight unless
        `force`, as the engines refuse a flush while they run requests."""
        if self.scheduler.busy and not force:
            return False
        self.cache.clear()
        return True

    def cached_tokens(self, ids: Sequence[int]) -> int:
        """What a request for `ids` would report as `cached_tokens` now (never the whole prompt)."""
        size = self.config.block_size
        return self.cache.match(chain_keys(ids, size, max(0, len(ids) - 1) // size)) * size

    def restart_publisher(self) -> None:
        """A new engine incarnation behind the relay: empty cache, sequences from 0, streams DATA_LOSS."""
        self.cache.clear(publish=False)
        if self.relay is None:
            return
        self.relay.restart()
        if self.relay.startup_clear:
            self.relay.emit(ClearedAll())

    def fail_next(self, code: grpc.StatusCode, after_tokens: int, message: str) -> None:
        self._failures.append(_Failure(code, after_tokens, message))

    def admit(self, received: ReceivedRequest) -> Run:
        """Record the request and register it for Abort; callers must `release` it."""
        self.total_requests += 1
        self.last_receive = time.time()
        if self.config.record_requests:
            self.requests.append(received)
        failure = self._failures.popleft() if self._failures else None
        run = Run(self, received.request_id, received.input_ids, failure)
        self._runs[received.request_id] = run
        self.peak_active = max(self.peak_active, len(self._runs))
        return run

    def release(self, run: Run) -> None:
        """The call ended: the scheduler stores the blocks of its prompt and output and frees the rest."""
        if self._runs.get(run.request_id) is run:
            del self._runs[run.request_id]
        output: Sequence[int] = ()
        if run.plans:
            first = run.plans[0]
            output = first.ids[: first.sent]
        self.scheduler.leave(run.ticket, output)

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


@dataclass(frozen=True, slots=True)
class CacheState:
    """What the engine's KV cache holds (`RunningSim.cache_state`), for tests and routing oracles."""

    block_size: int
    capacity_blocks: int
    #: Distinct cached blocks, and the physical copies of them (vLLM may hold a block twice).
    blocks: int
    physical_blocks: int
    #: Physical blocks running requests use, and the blocks they reserved and have not stored yet.
    pinned_blocks: int
    reserved_blocks: int
    #: Physical blocks evicted since the start.
    evicted_blocks: int
    #: The engine hash of every cached block (what its events name).
    block_hashes: frozenset[int]


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

    # -- the KV cache, the scheduler and the event stream (docs/simulated-engine.md, "Cluster twin") --

    def announce_prefix(self, ids: Sequence[int]) -> int:
        """Store every full block of `ids` without generating, as if another gateway had routed that
        prompt here: published as Stored like any store, in a batch of its own. Returns the blocks
        that were new."""
        stored = self._core.cache.announce(ids)
        self._core.publish()
        return stored

    def remove_prefix(self, ids: Sequence[int], *, from_token: int = 0) -> int:
        """Remove the cached blocks of `ids` from the block holding `from_token` on, and every cached
        block extending them (not those running requests use): published as Removed, in a batch of its
        own. Returns the physical blocks removed."""
        removed = self._core.cache.remove_from(ids, from_token)
        self._core.publish()
        return removed

    def flush(self, *, force: bool = False) -> bool:
        """Empty the cache, published as Cleared in a batch of its own. Refused (False) while requests
        are in flight, as the engines refuse `FlushCache`, unless `force`."""
        flushed = self._core.flush(force=force)
        self._core.publish()
        return flushed

    def cached_tokens(self, ids: Sequence[int]) -> int:
        """The `cached_tokens` a request for `ids` would report if admitted now."""
        return self._core.cached_tokens(ids)

    def cache_state(self) -> CacheState:
        cache = self._core.cache
        return CacheState(
            block_size=cache.block_size,
            capacity_blocks=cache.capacity_blocks,
            blocks=len(cache),
            physical_blocks=cache.physical,
            pinned_blocks=cache.pinned_physical,
            reserved_blocks=cache.reserved,
            evicted_blocks=cache.evicted,
            block_hashes=frozenset(block.hash for block in cache.blocks()),
        )

    def load(self) -> LoadFigures:
        """The figures the load records and `GetLoads` report now."""
        return self._core.figures()

    def wedge(self) -> None:
        """Stop all output: requests keep arriving, being admitted and prefilled, but no token or
        completion leaves until `unwedge()`, so `engine_silence_ms` grows on the load records."""
        self._core.wedge()

    def unwedge(self) -> None:
        self._core.unwedge()

    @property
    def wedged(self) -> bool:
        return self._core.wedged

    def drop_kv_subscriptions(
        self,
        code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
        message: str = "simulated KV event stream drop",
    ) -> int:
        """End every live `SubscribeKvEvents` stream with `code` (UNAVAILABLE: the subscriber resumes
        from its last sequence); returns how many were open."""
        return self._core.relay.drop_subscriptions(code, message) if self._core.relay else 0

    def restart_kv_publisher(self) -> None:
        """Start the engine over behind its relay: the cache empties, sequences start again at 0 and live
        streams end with DATA_LOSS (the subscriber clears and resubscribes from zero)."""
        self._core.restart_publisher()

    @property
    def kv_sequence(self) -> int | None:
        """The sequence of the last KV-event batch published (None before the first)."""
        return self._core.relay.last_sequence if self._core.relay else None

    @property
    def kv_subscriptions(self) -> int:
        """Live `SubscribeKvEvents` streams."""
        return self._core.relay.subscriptions if self._core.relay else 0

    @property
    def kv_subscription_starts(self) -> list[int]:
        """The `start_sequence_number` every `SubscribeKvEvents` call asked for, in order."""
        return list(self._core.relay.requested_starts) if self._core.relay else []

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
            "simulated %s engine on %s (model=%s, harmony=%s, mode=%s, kv: %d-token blocks, %d tokens, "
            "events %s; timing: prefill %g ms/token, decode %g + %g x running ms/token, window %d)",
            config.engine,
            sim.url,
            config.model,
            config.harmony,
            config.mode,
            config.block_size,
            config.kv_capacity_tokens,
            "on" if config.kv_events and config.engine in _PUBLISHERS else "off",
            config.prefill_ms_per_token,
            config.decode_ms_per_token,
            config.decode_ms_per_running,
            config.max_running_requests,
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
    "CacheState",
    "ChoicePlan",
    "FrameCache",
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
