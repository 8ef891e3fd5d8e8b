"""What travels through the pipeline: the gateway's shared components, one request's context, and the
prepared request that the prepare stage hands to select, build and dispatch."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ..engines.base import SamplingOptions
from ..principal import ANONYMOUS, Principal
from ..settings import Settings
from ..wire import OPENAI, Wire
from .stream_interval import StreamIntervalTuner

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding

    from ..harmony.encoding import PromptRenderer
    from ..harmony.messages import Msg, PromptPrefix
    from ..harmony.text_parser import ParserStats
    from ..harmony.token_parser import HarmonyOutputParser
    from ..mcp.pool import McpPool
    from ..observability.metrics import GatewayMetrics
    from ..routing.dns_discovery import DnsDiscovery
    from ..routing.fleet import Fleet, ModelGroup
    from ..routing.health import HealthConfig
    from ..routing.kv_subscriptions import KvSubscriptions
    from ..routing.workers import Worker
    from ..storage.base import Store
    from ..tasks import TaskSupervisor
    from ..traffic.keys import KeyRing
    from .output_spec import OutputSpec
    from .tokenizer import ModelTokenizer


class LiveEvents(Protocol):
    """The live event feed of a background response running in this process (`EventFeed` of the
    Responses service): what a reader resuming its stream follows."""

    def follow(self, after: int, *, idle_timeout: float) -> AsyncIterator[tuple[int, bytes]]:
        """Frames of the events after sequence number `after`, live, until the terminal event."""
        ...


class BackgroundResponses(Protocol):
    """The runner of background responses (`BackgroundRunner` of the Responses service, a layer above
    the pipeline, which therefore knows it by this protocol only)."""

    @property
    def runner_id(self) -> str:
        """`host:port:pid` of this process, stored with each response it runs."""
        ...

    @property
    def active(self) -> int:
        """Background responses running in this process (the drain waits for them)."""
        ...

    def start(
        self, response_id: str, work: Coroutine[Any, Any, None], feed: LiveEvents, store: Store
    ) -> None:
        """Run `work` as the response's task, its `feed` reachable by id and a cancel stored in `store`
        obeyed until the task ends."""
        ...

    def feed(self, response_id: str) -> LiveEvents | None:
        """The live feed of a response running in this process, or None."""
        ...

    def running(self, response_id: str) -> bool: ...

    async def cancel(self, response_id: str) -> bool:
        """Cancel the response's task when it runs here and wait for it; False when it does not."""
        ...

    async def shutdown(self) -> None:
        """Cancel every running response and wait for them (bounded)."""
        ...


class FinishedChoice(Protocol):
    """A choice whose output has ended, as `PreparedRequest.after_turn` reads it: its output parser (a
    Harmony token parser, or a text-level one)."""

    @property
    def parser(self) -> object: ...


@dataclass(eq=False)
class GatewayState:
    """The object graph built once in the app lifespan (`app.build_state`); pipeline stages read it,
    never rebuild it. The lifespan starts `store` and enters `mcp` before any request, and closes
    `tasks` last."""

    settings: Settings
    fleet: Fleet
    encoding: HarmonyEncoding
    renderer: PromptRenderer
    store: Store
    mcp: McpPool
    metrics: GatewayMetrics
    health_config: HealthConfig
    background: BackgroundResponses
    #: The owner of every task that outlives its request; the lifespan's shutdown ends them.
    tasks: TaskSupervisor
    #: The tenant keys in force, shared with traffic control; a key file reload changes them.
    keys: KeyRing
    #: Tokenizers of non-Harmony models, by model, as loaded (pipeline/tokenizer.py).
    tokenizers: dict[str, ModelTokenizer] = field(default_factory=dict)
    #: The loads under way, by model: concurrent first requests of a model share one.
    tokenizer_loads: dict[str, asyncio.Task[ModelTokenizer]] = field(default_factory=dict)
    #: Chooses `stream_interval` under `--stream-interval auto` (pipeline/stream_interval.py).
    stream_tuner: StreamIntervalTuner = field(default_factory=StreamIntervalTuner)
    #: Keeps the fleet in step with `--worker-dns` (routing/dns_discovery.py); None without it.
    discovery: DnsDiscovery | None = None
    #: Follows the engines' KV events and loads into each worker's index and load record
    #: (routing/kv_subscriptions.py); its feeds run on `tasks`.
    kv_subscriptions: KvSubscriptions | None = None


log = logging.getLogger(__name__)

#: Seconds the closers of one request may take together (engine aborts, MCP connections).
CLEANUP_TIMEOUT = 10.0


def new_request_id() -> str:
    return os.urandom(12).hex()


#: Joins a client-visible request id and the gateway's random part in an engine request id; client ids
#: never contain it (api/request_id.py), so the client part reads back unambiguously in engine logs.
ENGINE_ID_SEPARATOR = "~"


def engine_request_id(request_id: str) -> str:
    """An engine request id for the request `request_id`: that id (engine logs still correlate with the
    client's) plus 64 random bits, so no client can name, or abort, another client's engine request."""
    return f"{request_id}{ENGINE_ID_SEPARATOR}{os.urandom(8).hex()}"


@dataclass(slots=True, eq=False)
class RequestContext:
    #: The id the client sees (`x-request-id`, log lines, completion ids): the client's own when it sent
    #: a well-formed one (api/request_id.py), else a fresh one. Never sent to an engine.
    request_id: str
    route: str
    principal: Principal = ANONYMOUS
    #: The id of this request's engine call under way (or last made) at the engines (generate, abort):
    #: `engine_request_id(request_id)`, made by the gateway, so one client can never name, and abort,
    #: another client's engine request. Each later call gets a new one (`next_engine_id`).
    engine_id: str = ""
    #: Engine calls made under this context so far (`next_engine_id`).
    engine_calls: int = 0
    routing_key: str | None = None
    #: The request's `prompt_cache_key`: the routing key of `cache_aware` and `consistent_hash` when given.
    prompt_cache_key: str | None = None
    started: float = field(default_factory=time.perf_counter)
    #: The model group serving the request: a metric label, so only ever a served model's name.
    model: str = ""
    #: The `model` the client's body named (cut to `MAX_LOGGED_MODEL_CHARS`), served or not: logged.
    requested_model: str = ""
    worker: Worker | None = None
    prefill_worker: Worker | None = None
    first_token_at: float | None = None
    retries: int = 0
    status: int = 200
    prompt_tokens: int = 0
    completion_tokens: int = 0
    log_extra: dict[str, Any] = field(default_factory=dict)
    #: Closers of what the request opened (engine streams, tool connections); the HTTP response runs
    #: them on every exit, including a client that leaves before the first byte of a stream.
    cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    #: The app's metrics (None: no metrics); `observability.metrics.finish_request` records.
    metrics: GatewayMetrics | None = None
    #: The Harmony output parsers of the request's choices, read once at the end for the Harmony
    #: counters (messages per channel, parse errors); empty for non-Harmony models.
    parsers: list[HarmonyOutputParser] = field(default_factory=list)
    #: `ParserStats` of text-level output parsers (HTTP upstreams, non-Harmony models), read once at
    #: the end for the channel-parser metrics.
    text_stats: list[ParserStats] = field(default_factory=list)
    #: Set by `finish_request`, so a request is recorded and logged once.
    finished: bool = False
    #: The wire the request answers on (its error bodies and its stream's terminal frame); set by the
    #: route, read by the stream driver and traffic control. The stages never build error bodies.
    wire: Wire = OPENAI
    #: On a wire that numbers its events (Responses): the sequence number the stream's next event takes,
    #: advanced by the surface's framer as it hands events out. Never parsed back from the bytes.
    next_sequence: int = 0
    #: `next_sequence` as of the last piece of the stream handed to the client (api/routes.py): a stream
    #: cut from outside is numbered on from there, even when the framer had run ahead of a slow client.
    sent_sequence: int = 0

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = engine_request_id(self.request_id)

    def next_engine_id(self) -> str:
        """The request id of the engine call about to be made: `engine_id` for the first call, a new one
        for each later call (a retry, the next turn of a tool loop), kept in `engine_id`.

        An engine keys a request's state, its clean-up and Abort by this id, and cleans up after the
        call has ended (the MLX servicer on its generation thread a step later, SGLang's servicer when
        the call's handler exits), so a call reusing the id of the one before can be cut, or uncounted,
        by that clean-up: one id names one engine call."""
        if self.engine_calls:
            self.engine_id = engine_request_id(self.request_id)
        self.engine_calls += 1
        return self.engine_id

    def error_frame(self, exc: BaseException) -> bytes:
        """The terminal frame of this request's stream for a failure after its first byte, in its wire's
        shape (the stream driver's, through the surface's framer)."""
        return self.wire.stream_error(exc, self.next_sequence)

    def cut_frame(self, exc: BaseException) -> bytes:
        """The terminal frame of this request's stream when it is cut from outside (a drain timeout),
        numbered right after the last event the client was handed."""
        return self.wire.stream_error(exc, self.sent_sequence)

    @property
    def owner(self) -> str:
        """The tenant that owns what this request stores and finds (`Principal.tenant`)."""
        return self.principal.tenant


@dataclass(slots=True, eq=False)
class PreparedRequest:
    """A request ready for routing: prompt ids, sampling and what the output parser must know."""

    group: ModelGroup
    input_ids: list[int]
    sampling: SamplingOptions
    selection_text: str
    stream: bool
    n: int = 1
    harmony: bool = True
    function_names: frozenset[str] = frozenset()
    tool_namespaces: frozenset[str] = frozenset()
    stop_strings: tuple[str, ...] = ()
    max_reasoning_tokens: int | None = None
    effort: str = "medium"
    return_logprob: bool = False
    top_logprobs: int = 0
    original_text: str = ""
    #: Harmony prompt pieces, kept for continuations (reasoning budget, tool loops).
    prefix: PromptPrefix | None = None
    history: list[Msg] = field(default_factory=list)
    #: Output that is text, not Harmony tokens (non-Harmony models, HTTP upstreams): how it is parsed
    #: (`TextChoiceOutput` reads it).
    output_adapter: OutputSpec | None = None
    #: Text-mode (HTTP) upstreams: the OpenAI request bodies to forward, by API.
    upstream_body: dict[str, dict[str, Any]] | None = None
    #: Awaited with each finished choice before its last event is sent (keeps the analysis behind issued
    #: tool calls restorable: `reasoning_store.turn_remembering`).
    after_turn: Callable[[FinishedChoice], Awaitable[None]] | None = None


#: What a detached context takes from its request's context (besides a copy of `log_extra`).
DETACHED_FIELDS = (
    "request_id",
    "route",
    "principal",
    "routing_key",
    "model",
    "requested_model",
    "metrics",
    "wire",
)


def detached_context(ctx: RequestContext) -> RequestContext:
    """A context for work that outlives the HTTP request of `ctx` (a background response): the same
    request id, owner and routing key, but its own `cleanups`, worker and counters, so the request's
    clean-up never closes an engine stream or tool connection the work still uses. The work runs
    `run_cleanups` on it when it ends; the HTTP request is recorded on its own."""
    shared = {name: getattr(ctx, name) for name in DETACHED_FIELDS}
    return RequestContext(**shared, log_extra=dict(ctx.log_extra))


async def run_cleanups(ctx: RequestContext) -> None:
    """Run the request's closers, newest first, shielded (a cancelled request still frees what it
    opened) and bounded; a failing closer is logged and never hides the others. Idempotent."""
    closers, ctx.cleanups = ctx.cleanups, []
    with anyio.CancelScope(shield=True), anyio.move_on_after(CLEANUP_TIMEOUT):
        for close in reversed(closers):
            try:
                await close()
            except Exception as exc:
                log.debug("closing %s failed: %s", close, exc)
