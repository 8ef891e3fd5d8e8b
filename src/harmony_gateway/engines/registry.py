"""Engine clients by URL scheme and engine name; the gRPC protocols are the ones `detect.DETECTION_ORDER`
lists, so an engine is one client module and one line there."""

from __future__ import annotations

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
    Raises InvalidRequest for an unknown engine or URL scheme; connects lazily (no I/O here).
    """
    if url.startswith(("grpc://", "grpcs://")):
        host, _, port = url.split("://", 1)[1].rstrip("/").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidRequest(f"worker URL {url!r} needs a host and a port: grpc://host:port", param="url")
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
    raise InvalidRequest(
        f"unsupported worker URL {url!r}: use grpc://host:port or http://host:port", param="url"
    )
