"""One frozen Settings object, built by the CLI (or tests) and read everywhere else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .types.limits import DEFAULT_MAX_CONVERSATION_BYTES, DEFAULT_MAX_CONVERSATION_ITEMS, ConversationLimits


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    """One API key's own limits, priority and tenant, from its line in the key file (traffic/keys.py);
    None leaves the command-line default."""

    rate_limit: int | None = None
    token_rate_limit: int | None = None
    priority: int | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Named phases, each in seconds.

    | phase        | bounds                                                              |
    |--------------|---------------------------------------------------------------------|
    | connect      | model info / server info probes when a worker is added              |
    | first_token  | from dispatch until the engine's first chunk                        |
    | total        | one engine request from dispatch to its last chunk                  |
    | abort        | the shielded Abort RPC sent when a client goes away                 |
    """

    connect: float = 10.0
    first_token: float = 300.0
    total: float = 1800.0
    abort: float = 2.0


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    worker_urls: tuple[str, ...] = ()
    prefill_urls: tuple[str, ...] = ()
    decode_urls: tuple[str, ...] = ()
    #: DNS names whose addresses are workers, looked up again every `worker_dns_interval` seconds
    #: (`--worker-dns`, routing/dns_discovery.py): `grpc://NAME:PORT` (A/AAAA) or `grpc+srv://NAME` (SRV).
    worker_dns: tuple[str, ...] = ()
    worker_dns_interval: float = 5.0
    #: Seconds one DNS lookup may take.
    worker_dns_timeout: float = 2.0
    #: The nameserver to ask (`ADDRESS[:PORT]`); None: the system's (/etc/resolv.conf).
    worker_dns_server: str | None = None
    #: Seconds a worker gone from DNS may keep serving its requests in flight before it is removed;
    #: None: the request timeout (`timeouts.total`), so a drain never cuts a request short of its limit.
    worker_dns_drain_timeout: float | None = None
    engine: str = "auto"  # sglang | vllm | auto
    harmony_models: frozenset[str] = frozenset()
    #: The name clients use for the model the workers serve (`--served-model-name`), whatever name the
    #: engines report; None: the engines' names. Every worker must then serve the same model.
    served_model_name: str | None = None
    policy: str = "round_robin"
    model_policies: dict[str, str] = field(default_factory=dict)
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_key: str = "tokens"  # tokens | selection-text
    #: cache_aware: the share of the prompt (0-1) a cached prefix must cover to decide the worker.
    cache_threshold: float = 0.5
    #: cache_aware, kv_aware: load counts as skewed when a worker has more than
    #: `balance_abs_threshold` requests above the least loaded and more than `balance_rel_threshold`
    #: times its count (cache_aware: the least loaded wins; kv_aware: the skewed worker loses its
    #: cache affinity).
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    #: kv_aware (routing/kv_aware.py): the weight of prefill tokens in a worker's cost ...
    kv_overlap_weight: float = 1.0
    #: ... the weight of the uncached prompt tokens already queued on a worker against the prefix it holds ...
    kv_queue_weight: float = 0.25
    #: ... the prompt tokens one request already running or waiting on a worker weighs ...
    kv_decode_weight: float = 1024.0
    #: ... the age in seconds past which an engine's load record is not read ...
    kv_load_max_age: float = 5.0
    #: ... the KV usage (0-1) above which a worker gives up its affinity ...
    kv_pressure_threshold: float = 0.9
    #: ... and the softmax temperature over normalised costs (0: the least cost always wins).
    kv_temperature: float = 0.0
    #: The engines' KV events and load records (routing/kv_subscriptions.py): followed where an engine
    #: publishes them (`auto`) or not (`off`: loads are polled only); the blocks each worker's prefix
    #: index holds at most; the output silence, with requests in flight, past which a worker takes no
    #: traffic (0: never vetoed), lengthened by its pending prefill at `engine_prefill_rate` prompt
    #: tokens a second; and the load poll of workers that push no records (0: never polled).
    kv_events: str = "auto"
    kv_index_max_blocks: int = 262_144
    engine_wedge_ms: float = 20_000.0
    engine_prefill_rate: float = 2_000.0
    load_poll_interval: float = 1.0
    bootstrap_port: int = 8998
    #: Gateway processes sharing the port (`serve --workers N`). Above 1 they share the workers
    #: registered through the API and their health through storage (routing/shared_registry.py).
    processes: int = 1
    max_retries: int = 2
    #: Samples one `/generate` or `/v1/completions` batch may ask for (prompts × n); above it a 400.
    max_batch_size: int = 64
    #: Sub-requests of one batch at the engines at once; the rest wait their turn.
    batch_concurrency: int = 8
    #: Tokens per streamed engine message (SGLang `stream_interval`); None leaves the engine's default,
    #: 0 (the default) adapts it to the decode rate and the gateway's load (pipeline/stream_interval.py).
    stream_interval: int | None = 0
    retry_backoff: float = 0.05
    health_interval: float = 5.0
    health_timeout: float = 2.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    breaker_failure_threshold: int = 5
    breaker_cooldown: float = 30.0
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: Pins the Harmony conversation start date (tests, reproducible prompts); else today's UTC date.
    conversation_start_date: str | None = None
    model_identity: str | None = None
    knowledge_cutoff: str | None = None
    #: Which reasoning fields to emit: both (default), reasoning_content, or reasoning.
    reasoning_fields: str = "both"
    storage_url: str | None = None
    #: PostgreSQL schema holding the tables (several deployments can share one database).
    storage_schema: str | None = None
    #: Stored responses older than this many seconds are purged (None keeps them).
    storage_retention: float | None = None
    #: Caps on one conversation (items, and their stored JSON in bytes), enforced by the storage on
    #: every append: a write past one is a 400 `conversation_too_large`.
    max_conversation_items: int = DEFAULT_MAX_CONVERSATION_ITEMS
    max_conversation_bytes: int = DEFAULT_MAX_CONVERSATION_BYTES
    api_keys: frozenset[str] = frozenset()
    #: Keys for the admin plane (worker management, and /metrics and /docs under `protect_metrics`);
    #: distinct from `api_keys`: a tenant key never opens an admin route (api/admin.py).
    admin_keys: frozenset[str] = frozenset()
    #: A second listener serving the admin routes (`--admin-port`); None: no admin listener. 0 picks
    #: a free port (tests).
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    #: Hosts (names, addresses, CIDR networks) a worker registered through `POST /workers` may resolve
    #: to although not public; workers given on the command line are trusted operator config.
    worker_allow_hosts: tuple[str, ...] = ()
    #: /metrics, /docs and /openapi.json require the admin credential.
    protect_metrics: bool = False
    log_level: str = "info"
    log_json: bool = False
    log_prompts: bool = False
    mcp_config: str | None = None
    mcp_allow_hosts: tuple[str, ...] = ()
    mcp_tool_timeout: float = 30.0
    mcp_max_output_chars: int = 64_000
    max_tool_calls: int = 10
    #: Hosted tools without a backing (web_search without a browser server, file_search, ...): drop | reject.
    unbacked_tools: str = "drop"
    #: Key of the reasoning AEAD/HMAC (encrypted_content, thinking signatures), from --reasoning-key-file,
    #: HARMONY_GATEWAY_REASONING_KEY or --reasoning-key; None: generated once and kept in the storage so
    #: restarts and replicas share it. What it seals or signs is bound to the tenant as well.
    reasoning_key: str | None = None
    tokenizer_paths: dict[str, str] = field(default_factory=dict)
    reasoning_parsers: dict[str, str] = field(default_factory=dict)
    tool_call_parsers: dict[str, str] = field(default_factory=dict)
    #: Extra model names (`--model-alias NAME=MODEL`), resolved by the Anthropic Messages API.
    model_aliases: dict[str, str] = field(default_factory=dict)
    #: Text-level output parser per model for text-mode (HTTP) upstreams: harmony | think | marker |
    #: passthrough | off. Default: harmony for Harmony models, else the reasoning/tool-call parsers.
    text_parsers: dict[str, str] = field(default_factory=dict)
    #: The Harmony text parser's fallback window: with no channel marker in the first this many
    #: characters (or this many seconds after the first chunk, when set), it falls back to `marker`,
    #: then pass-through.
    text_parser_window_chars: int = 256
    text_parser_window_seconds: float | None = None
    #: Admission (`traffic.admission`): requests running at once (generations, and the routes whose
    #: `traffic.routes.RouteCost` takes a slot; None: no cap), how many more may wait, and for how long.
    max_concurrent_requests: int | None = None
    queue_size: int = 64
    queue_timeout: float = 30.0
    #: Per-key (or per-address) budgets per minute (`traffic.rate_limit`); None: unlimited. Requests are
    #: weighed per route (`traffic.routes`); generations reserve their estimated tokens at admission.
    rate_limit: int | None = None
    token_rate_limit: int | None = None
    #: redis://host:port/db keeps the budgets in Redis, shared by every replica; None: per process.
    rate_limit_store: str | None = None
    #: Key file entries with their own limits and priority (`KeyPolicy`), by key, as read at start-up
    #: (their keys are among `api_keys`).
    key_policies: dict[str, KeyPolicy] = field(default_factory=dict)
    #: The key file (`--api-key-file`): read again when it changes and on SIGHUP (traffic/keys.py
    #: `KeyRing`); None: the keys are fixed.
    api_key_file: str | None = None
    #: SIGTERM: seconds in-flight requests may take to finish before they are cut.
    drain_timeout: float = 30.0
    #: OTLP/HTTP collector base URL (http://host:4318); None: tracing off.
    otlp_endpoint: str | None = None
    #: Connection and request-size limits (README "Limits"): a body over `max_body_bytes` is a 413
    #: before it is parsed; a request head slower than `header_timeout` or a body piece slower than
    #: `body_timeout` is a 408; bigger or more headers than these are a 431; an idle keep-alive
    #: connection closes after `keep_alive_timeout`; past `max_connections` open connections new
    #: requests get 503 (None: no cap besides the open-file limit, which start-up raises to its maximum).
    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 128
    keep_alive_timeout: float = 5.0
    max_connections: int | None = None
    #: The gateway's own TLS (`--ssl-certfile`, `--ssl-keyfile`: PEM files); None: plain HTTP (a proxy
    #: in front terminates TLS).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    #: Peers (IPs, CIDRs, or "*") whose `X-Forwarded-For` / `X-Forwarded-Proto` are believed: the client
    #: address (per-address budgets, logs) is then the forwarded one. Empty: no peer is (uvicorn's own
    #: default would trust 127.0.0.1, so any local client could pick its address).
    forwarded_allow_ips: tuple[str, ...] = ()
    #: Most token ids `POST /v1/harmony/parse` reads (a text is encoded first; it may hold 8 characters a
    #: token); a larger input is a 400 naming `token_ids` or `text`.
    max_parse_tokens: int = 131_072
    #: The Responses API's WebSocket mode (api/responses_socket.py): the largest client message (a larger
    #: one closes the socket with 1009 before it is read), seconds a socket may sit idle (no turn running,
    #: nothing received) before it is closed, the `response.create` turns one socket may run, and its
    #: lifetime (OpenAI's own is 60 minutes); past a limit the next turn gets an `error` event
    #: `websocket_connection_limit_reached` and the socket closes.
    ws_max_message_bytes: int = 8 * 1024 * 1024
    ws_idle_timeout: float = 300.0
    ws_max_turns: int = 1000
    ws_max_lifetime: float = 3600.0
    #: Open sockets one key (one client address on a gateway without keys) may hold; a handshake past it
    #: is refused with 429. Sockets skip uvicorn's `--max-connections` count once upgraded, so this is
    #: what bounds them per client.
    ws_max_sockets_per_key: int = 64

    @property
    def conversation_limits(self) -> ConversationLimits:
        return ConversationLimits(self.max_conversation_items, self.max_conversation_bytes)

    def policy_options(self, policy: str) -> dict[str, Any]:
        """The constructor options these settings give the routing policy named `policy`."""
        if policy == "kv_aware":
            return {
                "overlap_weight": self.kv_overlap_weight,
                "queue_weight": self.kv_queue_weight,
                "decode_weight": self.kv_decode_weight,
                "load_max_age": self.kv_load_max_age,
                "kv_pressure_threshold": self.kv_pressure_threshold,
                "temperature": self.kv_temperature,
                "balance_abs_threshold": self.balance_abs_threshold,
                "balance_rel_threshold": self.balance_rel_threshold,
            }
        if policy != "cache_aware":
            return {}
        return {
            "cache_key": self.cache_key,
            "cache_threshold": self.cache_threshold,
            "balance_abs_threshold": self.balance_abs_threshold,
            "balance_rel_threshold": self.balance_rel_threshold,
        }
