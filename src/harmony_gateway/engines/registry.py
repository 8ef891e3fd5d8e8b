"""Engine clients by URL scheme and engine name: one line per engine."""

from __future__ import annotations

from ..errors import InvalidRequest
from .base import EngineClient
from .sglang_grpc import SglangGrpcClient

GRPC_ENGINES = {
    "sglang": SglangGrpcClient,
}


def create_client(url: str, engine: str = "auto", *, request_timeout: float = 1800.0) -> EngineClient:
    """`grpc://host:port` speaks an engine's gRPC protocol (`engine`: sglang, vllm, or auto)."""
    if url.startswith(("grpc://", "grpcs://")):
        name = "sglang" if engine == "auto" else engine
        cls = GRPC_ENGINES.get(name)
        if cls is None:
            raise InvalidRequest(
                f"unknown engine {engine!r}; expected one of {', '.join(GRPC_ENGINES)}", param="engine"
            )
        return cls(url, request_timeout=request_timeout)
    raise InvalidRequest(f"unsupported worker URL {url!r}: use grpc://host:port", param="url")
