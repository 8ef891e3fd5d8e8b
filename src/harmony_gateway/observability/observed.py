"""What observability reads of the gateway, as protocols: a worker (`routing.workers.Worker`) and a
finished request (`pipeline.context.RequestContext`). Both match structurally, so observability, which
every layer imports, imports nothing back from the layers it observes.

A member is a plain annotation where the implementation holds a field of that very type, and a
read-only property where it holds a narrower type (an enum, a list, a dict) or computes the value:
a protocol attribute must match its implementation exactly, a property only covariantly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class Named(Protocol):
    """An enum member whose value is its label (`WorkerKind`, `BreakerState`)."""

    @property
    def value(self) -> str: ...


class ObservedWorker(Protocol):
    id: str
    url: str
    engine: str
    healthy: bool
    in_flight: int

    @property
    def public_url(self) -> str: ...
    @property
    def kind(self) -> Named: ...
    @property
    def model_id(self) -> str: ...
    @property
    def breaker(self) -> Named: ...


class ObservedMessage(Protocol):
    @property
    def channel(self) -> str | None: ...


class ObservedParser(Protocol):
    """A Harmony output parser (`harmony.token_parser.HarmonyOutputParser`) at the end of its output."""

    output_tokens: int
    unexpected_order: int

    @property
    def messages(self) -> Sequence[ObservedMessage]: ...
    @property
    def parse_error(self) -> object | None: ...
    @property
    def recoveries(self) -> Mapping[str, int]: ...


class ObservedTextStats(Protocol):
    """The counters of a text-level output parser (`harmony.text_parser.ParserStats`)."""

    unexpected_order: int
    parse_errors: int
    marker_fallbacks: int
    passthrough_fallbacks: int
    content_chars: int
    reasoning_chars: int

    @property
    def channel_messages(self) -> Mapping[str, int]: ...


class ObservedPrincipal(Protocol):
    """Who made a request (`principal.Principal`): what its log line and per-key counters name."""

    @property
    def key_id(self) -> str: ...
    @property
    def tenant_name(self) -> str: ...


class ObservedRequest(Protocol):
    """A request at its end. `finish_request` sets `finished`, and `completion_tokens` when a stream
    never reported usage; everything else it only reads."""

    finished: bool
    completion_tokens: int
    request_id: str
    route: str
    #: The model group that served the request ("" until one is found).
    model: str
    #: The `model` the request's body named, whether or not the gateway serves it ("": none read).
    requested_model: str
    started: float
    first_token_at: float | None
    status: int
    prompt_tokens: int
    retries: int
    #: The app's `GatewayMetrics`, or None.
    metrics: Any

    @property
    def principal(self) -> ObservedPrincipal: ...
    @property
    def worker(self) -> ObservedWorker | None: ...
    @property
    def prefill_worker(self) -> ObservedWorker | None: ...
    @property
    def log_extra(self) -> Mapping[str, Any]: ...
    #: Harmony output parsers, one per choice.
    @property
    def parsers(self) -> Sequence[ObservedParser]: ...
    #: The counters of text-level output parsers.
    @property
    def text_stats(self) -> Sequence[ObservedTextStats]: ...
