"""Engine clients by URL scheme and engine name; the gRPC protocols are the ones `detect.DETECTION_ORDER`
lists, so an engine is one client module and one line there."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..errors import InvalidRequest
from .base import EngineClient
from .detect import DETECTION_ORDER, DetectingGrpcClient

#: Each gRPC protocol's client by its engine name (`detect.DETECTION_ORDER` lists them), and `auto`.
GRPC_ENGINES: dict[str, type[EngineClient]] = {
    **{client.engine: client for client in DETECTION_ORDER},
    "auto": DetectingGrpcClient,
}


def create_client(url: str, engine: str = "auto", *, request_timeout: float = 1800.0) -> EngineClient:
    """`grpc://host:port` speaks an engine's gRPC protocol (`engine`: a name in `GRPC_ENGINES`);
    `http(s)://host:port[?model=NAME&api=chat|completions]` an OpenAI-compatible HTTP server.

    `auto` decides on the worker's first probe: the first protocol whose HealthCheck is implemented
    (`detect.DETECTION_ORDER`).
    Raises InvalidRequest for an unknown engine or a URL `check_worker_url` refuses; connects lazily
    (no I/O here).
    """
    check_worker_url(url)
    if url.startswith(("grpc://", "grpcs://")):
        cls = GRPC_ENGINES.get(engine)
        if cls is None:
            raise InvalidRequest(
                f"unknown engine {engine!r}; expected one of {', '.join(GRPC_ENGINES)}", param="engine"
            )
        return cls(url, request_timeout=request_timeout)  # type: ignore[call-arg]
    if url.startswith(("http://", "https://")):
        # An OpenAI-compatible server, in text mode (engines/http_upstream.py); `engine` does not apply.
        # lazy: httpx (and the CLI extras it pulls in) costs ~20 MB a gRPC-only gateway never uses
        from .http_upstream import HttpUpstreamClient

        return HttpUpstreamClient(url, request_timeout=request_timeout)
    raise AssertionError("check_worker_url lets no other scheme through")


def check_worker_url(url: str) -> None:
    """Raise InvalidRequest (one line, naming the URL) unless `url` is `grpc(s)://host:port` or
    `http(s)://host[:port][/path]`. Parses only: nothing is resolved or connected."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidRequest(
            f"worker URL {url!r} has no scheme: use grpc://{url} (an engine's gRPC server) or "
            f"http://{url} (an OpenAI-compatible server)",
            param="url",
        )
    if scheme in ("grpc", "grpcs"):
        host, _, port = rest.rstrip("/").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest(f"worker URL {url!r} needs a host and a port: grpc://host:port", param="url")
        return
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port out of range)
        except ValueError as exc:
            raise InvalidRequest(f"worker URL {url!r}: {exc}", param="url") from None
        if not parts.hostname:
            raise InvalidRequest(f"worker URL {url!r} needs a host: http://host:port", param="url")
        return
    raise InvalidRequest(
        f"worker URL {url!r} has the scheme {scheme!r}: use grpc://host:port, grpcs://, http:// or https://",
        param="url",
    )
