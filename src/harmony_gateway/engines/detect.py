"""`--engine auto`: find out which gRPC protocol a worker speaks the first time it is probed.

`DetectingGrpcClient` calls each known protocol's `HealthCheck` in `DETECTION_ORDER`; a server that answers
UNIMPLEMENTED does not serve that service, so the next protocol is tried. Detection happens inside the
worker's first probe (`model_info` / `health`), on the event loop, bounded by the probe's timeout; until it
succeeds the worker takes no traffic and later probes try again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from ..errors import UpstreamError, UpstreamUnavailable
from .base import (
    UNKNOWN_CAPABILITIES,
    EngineCapabilities,
    EngineChunk,
    GenerateRequest,
    ModelInfo,
    redact_url,
)
from .grpc_common import GrpcEngineClient
from .kv_events import EngineLoad, KvBatch
from .mlx_grpc import MlxGrpcClient
from .sglang_grpc import SglangGrpcClient
from .tokenspeed_grpc import TokenSpeedGrpcClient
from .trtllm_grpc import TrtllmGrpcClient
from .vllm_grpc import VllmGrpcClient

#: Every gRPC protocol the gateway speaks, in the order `auto` tries them (most common first; each costs
#: one HealthCheck round trip to rule out). `registry.GRPC_ENGINES` names them from this tuple.
DETECTION_ORDER: tuple[type[GrpcEngineClient], ...] = (
    SglangGrpcClient,
    VllmGrpcClient,
    MlxGrpcClient,
    TrtllmGrpcClient,
    TokenSpeedGrpcClient,
)


async def detect_engine(url: str, timeout: float, *, request_timeout: float) -> GrpcEngineClient:
    """Return a client for the protocol the worker at `url` speaks.

    Raises `errors.Upstream*` when the worker cannot be reached or speaks none of them (nothing is
    decided then).
    """
    for cls in DETECTION_ORDER:
        client = cls(url, request_timeout=request_timeout)
        try:
            await client.health(timeout)
        except UpstreamError as exc:
            await client.close()
            cause = exc.__cause__
            if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNIMPLEMENTED:
                continue
            raise
        return client
    names = ", ".join(cls.engine for cls in DETECTION_ORDER)
    raise UpstreamError(f"the worker at {url} speaks none of the engine protocols ({names})")


class DetectingGrpcClient:
    """An `EngineClient` that picks its protocol on first use and then delegates to it.

    `engine` reads "auto" until detection succeeded, then the detected engine's name. `generate` hands out
    the detected client's own iterator, so streaming costs nothing extra.
    """

    def __init__(self, url: str, *, request_timeout: float = 600.0) -> None:
        self.url = url
        self.engine = "auto"
        self._request_timeout = request_timeout
        self._inner: GrpcEngineClient | None = None
        self._lock = asyncio.Lock()

    @property
    def detected(self) -> GrpcEngineClient | None:
        return self._inner

    @property
    def capabilities(self) -> EngineCapabilities:
        return UNKNOWN_CAPABILITIES if self._inner is None else self._inner.capabilities

    async def resolve(self, timeout: float = 10.0) -> GrpcEngineClient:
        if self._inner is None:
            async with self._lock:
                if self._inner is None:
                    inner = await detect_engine(self.url, timeout, request_timeout=self._request_timeout)
                    self._inner, self.engine = inner, inner.engine
        return self._inner

    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        return await (await self.resolve(timeout)).model_info(timeout=timeout)

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        inner = await self.resolve(timeout)
        if not inner.capabilities.server_info:
            raise UpstreamError(f"the {inner.engine} engine at {self.url} has no server info")
        return await inner.server_info(timeout=timeout)

    async def health(self, timeout: float) -> bool:
        return await (await self.resolve(timeout)).health(timeout)

    async def get_tokenizer(self, timeout: float = 60.0) -> bytes:
        inner = await self.resolve(timeout)
        if not inner.capabilities.tokenizer:
            raise UpstreamError(
                f"the {inner.engine} engine at {redact_url(self.url)} cannot send its tokenizer"
            )
        return await inner.get_tokenizer(timeout=timeout)

    def subscribe_kv_events(self, start_sequence: int) -> AsyncGenerator[KvBatch, None]:
        # Subscriptions open after the first probe, which detects the protocol.
        if self._inner is None or not self._inner.capabilities.kv_events:
            raise UpstreamError(f"the engine at {redact_url(self.url)} publishes no KV events")
        return self._inner.subscribe_kv_events(start_sequence)

    async def loads(self, timeout: float) -> EngineLoad:
        inner = await self.resolve(timeout)
        if not inner.capabilities.loads:
            raise UpstreamError(f"the {inner.engine} engine at {redact_url(self.url)} reports no load")
        return await inner.loads(timeout)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        if self._inner is None:
            # Unreachable in practice: a worker takes traffic only after a probe, which detects.
            raise UpstreamUnavailable(f"the engine protocol of {redact_url(self.url)} is not known yet")
        return self._inner.generate(request)

    async def abort(self, request_id: str) -> None:
        if self._inner is not None:
            await self._inner.abort(request_id)

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()
