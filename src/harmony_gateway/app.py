"""create_app(settings): builds the object graph in the lifespan and mounts the API.

Start-up order: load the Harmony encoding (fail fast, naming TIKTOKEN_ENCODINGS_BASE), open storage,
register and probe workers (the command line's, then DNS's first answer), then run the health checker
in the lifespan task group until shutdown. The app's loops (health, worker watch, DNS discovery,
storage purge, stream tuning, shared admission) run in that task group; every task that outlives the
code that started it (background responses, token charges, tokenizer loads, each worker's KV-event
feed) is spawned on the app's `TaskSupervisor`, which the lifespan closes last, so nothing the app
started runs on after it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import FastAPI
from openai_harmony import HarmonyEncoding
from starlette.routing import WebSocketRoute

from .api.accounting import RouteNames
from .api.anthropic import router as anthropic_router
from .api.direct_routes import DirectRoutes, post_endpoints
from .api.error_responses import UnexpectedErrorMiddleware, install_error_handlers
from .api.inspector import router as inspector_router
from .api.openapi import install_openapi
from .api.request_guard import RequestGuardMiddleware
from .api.request_id import RequestIdMiddleware
from .api.responses import router as responses_router
from .api.responses_socket import PATH as SOCKET_PATH
from .api.responses_socket import ResponsesSockets, SocketMetrics
from .api.routes import router, surface_router
from .api.workers import router as workers_router
from .engines.registry import GRPC_ENGINES, create_client
from .harmony.encoding import PromptRenderer, get_encoding
from .harmony.stream_parser import token_bytes
from .mcp.pool import open_mcp_pool
from .observability import tracing
from .observability.metrics import GatewayMetrics
from .pipeline.context import GatewayState
from .routing.dns_discovery import DnsDiscovery, DnsMetrics, parse_dns_target
from .routing.fleet import Fleet
from .routing.health import HealthChecker, HealthConfig
from .routing.kv_subscriptions import FeedConfig, KvEventMetrics, KvSubscriptions
from .routing.registry import create_policy
from .routing.shared_registry import SharedWorkers
from .routing.workers import WorkerKind
from .settings import Settings
from .storage import default_storage_url, open_store
from .surfaces.responses.service.runner import BackgroundRunner, default_runner_id, fail_interrupted
from .surfaces.table import route_map
from .tasks import TaskSupervisor
from .traffic import drain
from .traffic.keys import KeyRing
from .traffic.middleware import TrafficControl, TrafficMiddleware

log = logging.getLogger(__name__)

#: `serve --workers N` sets it: the file whose byte-range locks are the gateway-wide admission slots.
SHARED_SLOTS_ENV = "HARMONY_GATEWAY_ADMISSION_SLOTS"


def _release_freed_memory() -> None:
    """Hand the heap that start-up freed back to the system (`_trim_heap`). What start-up keeps (modules,
    schemas, the object graph: a few hundred thousand objects) is moved out of the collector's reach, so
    a full collection, which a request allocating many small lists (the inspector's 120k-token views)
    can trigger, walks only what requests made: a pause of milliseconds, not of a whole heap."""
    gc.collect()
    gc.freeze()
    _trim_heap()


def _trim_heap() -> None:
    """Hand freed heap back to the system (glibc keeps it otherwise)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to hand back this way


def load_vocabularies() -> HarmonyEncoding:
    """Both o200k vocabularies, quicktok's first: loading it leaves about 12 MB of freed buffers, handed
    back before openai-harmony's tables are built, so start-up peaks about 20 MB lower than the other
    way round (the peak resident size is what a container's memory limit sees)."""
    token_bytes()
    _trim_heap()
    return get_encoding()


def build_state(
    settings: Settings, *, tasks: TaskSupervisor | None = None, keys: KeyRing | None = None
) -> GatewayState:
    """The gateway's object graph, nothing started yet: the app lifespan starts the store, enters the
    MCP pool and closes `tasks` (a new supervisor when not given) at shutdown. `keys` are the tenant
    keys in force (the settings' when not given)."""
    encoding = load_vocabularies()

    def policy_for(model: str, role: str) -> object:
        if role == "prefill" and settings.prefill_policy:
            name = settings.prefill_policy
        elif role == "decode" and settings.decode_policy:
            name = settings.decode_policy
        else:
            name = settings.model_policies.get(model, settings.policy)
        return create_policy(name, **settings.policy_options(name))

    fleet = Fleet(
        client_factory=lambda url, engine: create_client(
            url, engine, request_timeout=settings.timeouts.total
        ),
        policy_factory=policy_for,
        harmony_models=settings.harmony_models,
        connect_timeout=settings.timeouts.connect,
        health_timeout=settings.health_timeout,
        default_engine=settings.engine,
        breaker_cooldown=settings.breaker_cooldown,
        retry_interval=settings.health_interval,
        served_model_name=settings.served_model_name,
    )
    health = HealthConfig(
        interval=settings.health_interval,
        timeout=settings.health_timeout,
        failure_threshold=settings.health_failure_threshold,
        success_threshold=settings.health_success_threshold,
        breaker_failure_threshold=settings.breaker_failure_threshold,
        breaker_cooldown=settings.breaker_cooldown,
    )
    store = open_store(
        settings.storage_url or default_storage_url(),
        schema=settings.storage_schema,
        retention_seconds=settings.storage_retention,
    )
    if settings.otlp_endpoint:
        store = tracing.TracedStore(store)
    tasks = tasks or TaskSupervisor()
    metrics = GatewayMetrics(fleet.all_workers)
    # Each process follows every worker itself (`serve --workers N` included): feeds start as workers
    # join the fleet, end as they leave, and run on `tasks`.
    kv_subscriptions = KvSubscriptions(tasks, feed_config(settings), KvEventMetrics(metrics.registry))
    kv_subscriptions.attach(fleet)
    metrics.before_render.append(kv_subscriptions.refresh_metrics)
    return GatewayState(
        settings=settings,
        fleet=fleet,
        encoding=encoding,
        renderer=PromptRenderer(encoding),
        store=store,
        mcp=open_mcp_pool(settings),
        metrics=metrics,
        health_config=health,
        background=BackgroundRunner(default_runner_id(settings.port), tasks),
        tasks=tasks,
        keys=keys if keys is not None else KeyRing.from_settings(settings),
        discovery=_dns_discovery(settings, fleet, metrics),
        kv_subscriptions=kv_subscriptions,
    )


def feed_config(settings: Settings) -> FeedConfig:
    """How the settings have the engines' KV events and loads followed (`--kv-events` and its kin)."""
    return FeedConfig(
        kv_events=settings.kv_events != "off",
        max_blocks=settings.kv_index_max_blocks,
        wedge_ms=settings.engine_wedge_ms,
        prefill_rate=settings.engine_prefill_rate,
        poll_interval=settings.load_poll_interval,
        poll_timeout=settings.health_timeout,
    )


def _dns_discovery(settings: Settings, fleet: Fleet, metrics: GatewayMetrics) -> DnsDiscovery | None:
    """`--worker-dns`: the discovery loop the lifespan runs, or None without targets. Raises ValueError
    for a malformed target or server, and dnspython's NoResolverConfiguration when the system names no
    nameserver and `--worker-dns-server` is not given."""
    if not settings.worker_dns:
        return None
    # lazy: dnspython (~80 ms of imports) loads only in a gateway that discovers workers through DNS
    from .routing.dns_resolver import DnsResolver

    drain = settings.worker_dns_drain_timeout
    return DnsDiscovery(
        fleet,
        [parse_dns_target(spec, tuple(GRPC_ENGINES)) for spec in settings.worker_dns],
        DnsResolver(settings.worker_dns_server, settings.worker_dns_timeout),
        interval=settings.worker_dns_interval,
        drain_timeout=settings.timeouts.total if drain is None else drain,
        metrics=DnsMetrics(metrics.registry),
    )


async def _purge_expired(state: GatewayState) -> None:
    """Apply --storage-retention (delete old stored responses) and drop expired gateway values,
    hourly-ish, off the request path."""
    while True:
        await anyio.sleep(min(3600.0, max(5.0, (state.settings.storage_retention or 3600.0) / 4)))
        try:
            await state.store.purge_expired(time.time())
        except Exception as exc:  # storage trouble must not stop the gateway
            log.warning("purging expired responses failed: %s", exc)


async def _watch_workers(state: GatewayState, checker: HealthChecker) -> None:
    """Probe workers whose model is still unknown (unreachable at start-up), each as its back-off allows
    (`Fleet.due_for_probe`); the checker does the rest."""
    while True:
        await anyio.sleep(state.settings.health_interval)
        async with anyio.create_task_group() as tg:
            for worker in state.fleet.all_workers():
                if state.fleet.due_for_probe(worker):
                    tg.start_soon(state.fleet.probe, worker)


def create_app(settings: Settings) -> FastAPI:
    """The gateway's ASGI app; its lifespan (run once) builds the object graph, serves, and ends every
    task it started."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        gw = build_state(settings, tasks=tasks, keys=control.keys)
        app.state.gateway = gw
        if settings.otlp_endpoint:
            tracing.configure(settings.otlp_endpoint)
        control.attach_metrics(gw.metrics.registry)
        sockets.attach_metrics(SocketMetrics(gw.metrics.registry))
        control.background_running = lambda: gw.background.active
        # Everything from here on is stopped in the finally, a failure during start-up included.
        try:
            await gw.store.start()
            storage_url = settings.storage_url or default_storage_url()
            log.info("storing responses in %s", storage_url.split("@")[-1])
            await fail_interrupted(gw.store, gw.background.runner_id)
            if not settings.api_keys:
                log.warning("no API keys configured: the gateway accepts every request")
            initial = [
                *((url, WorkerKind.REGULAR) for url in settings.worker_urls),
                *((url, WorkerKind.PREFILL) for url in settings.prefill_urls),
                *((url, WorkerKind.DECODE) for url in settings.decode_urls),
            ]
            async with anyio.create_task_group() as tg:
                for url, kind in initial:
                    tg.start_soon(gw.fleet.admit, url, kind)
            _release_freed_memory()
            checker = HealthChecker(gw.fleet.all_workers, gw.health_config)
            if settings.processes > 1:
                # serve --workers N: one worker registry and one health view for all the processes.
                shared = SharedWorkers(
                    gw.fleet,
                    gw.store,
                    checker,
                    gw.fleet.admit,
                    default_runner_id(settings.port),
                    after_sync=gw.metrics.refresh_files,
                )
                await shared.start()
            # MCP connections (pooled and per request) run in the pool's task group until shutdown.
            async with gw.mcp, anyio.create_task_group() as tg:
                if gw.discovery is not None:
                    # Returns once the first answer's workers were probed: they serve the first request.
                    await tg.start(gw.discovery.run)
                if gw.fleet.shared is not None:
                    tg.start_soon(gw.fleet.shared.run)
                    tg.start_soon(gw.fleet.shared.run_health)
                else:
                    tg.start_soon(checker.run)
                if settings.stream_interval == 0:
                    tg.start_soon(gw.stream_tuner.run)
                tg.start_soon(_watch_workers, gw, checker)
                # Also without retention: expiring gateway values (restorable reasoning) are purged here.
                tg.start_soon(_purge_expired, gw)
                tg.start_soon(control.run)
                if gw.keys.file is not None:
                    # The key file is read again when it changes and on SIGHUP, without a restart.
                    tg.start_soon(gw.keys.watch)
                    await tg.start(gw.keys.reload_on_hangup)
                try:
                    yield
                finally:
                    # Before the MCP pool closes: a background response mid tool call must end as
                    # cancelled, not run on with a tool error from a connection shut under it.
                    await gw.background.shutdown()
                tg.cancel_scope.cancel()
        finally:
            await gw.background.shutdown()
            # Before what the tasks use (engines, storage, the rate-limit store) closes.
            await tasks.aclose()
            if gw.fleet.shared is not None:
                await gw.fleet.shared.close()
            await gw.fleet.close()
            await gw.store.close()
            await control.close()
            if settings.otlp_endpoint:
                # In a thread: flushing blocks until the collector answers (or its timeout).
                await anyio.to_thread.run_sync(tracing.shutdown)

    # No trailing-slash redirects: `DELETE /v1/responses/` is a 404 error body, not a 307 to another route.
    app = FastAPI(
        title="harmony-gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )
    tasks = TaskSupervisor()
    control = TrafficControl(settings, shared_slots_path=os.environ.get(SHARED_SLOTS_ENV), tasks=tasks)
    drain.current_control = control
    app.state.traffic = control
    # The Responses API's WebSocket mode: the same path as POST /v1/responses, upgraded.
    sockets = ResponsesSockets(settings, control)
    app.state.sockets = sockets
    # Innermost: the generating routes without FastAPI's per-request routing work (api/direct_routes.py).
    # The generating routes and the wire of every route, from the surface table.
    routes = route_map()
    direct = post_endpoints((surface_router,), routes.generating)
    app.add_middleware(DirectRoutes, routes=direct, exception_handlers=app.exception_handlers)
    # Inside the request-id middleware: refusals carry the id too.
    app.add_middleware(TrafficMiddleware, control=control, routes=routes)
    app.add_middleware(
        RequestGuardMiddleware,
        max_body_bytes=settings.max_body_bytes,
        body_timeout=settings.body_timeout,
        routes=routes,
    )
    routers = (surface_router, router, responses_router, workers_router, anthropic_router, inspector_router)
    # Inside the request-id middleware, outside the rest: a failure anywhere is one log line and a clean
    # 500, and every request, refused or failed, is accounted once.
    app.add_middleware(UnexpectedErrorMiddleware, routes=routes, names=RouteNames(routers))
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, a 413 included, carries the id
    install_error_handlers(app, routes)
    for included in routers:
        app.include_router(included)
    app.router.routes.append(WebSocketRoute(SOCKET_PATH, sockets, name="responses_socket"))
    # /openapi.json and /docs: the spec lists the routes included above; --protect-metrics guards both.
    install_openapi(app)
    return app
