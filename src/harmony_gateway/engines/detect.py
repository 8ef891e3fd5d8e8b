"""`--engine auto`: find out which gRPC protocol a worker speaks the first time it is probed.

`DetectingGrpcClient` calls SGLang's `HealthCheck`; a server that answers UNIMPLEMENTED does not serve
`sglang.grpc.scheduler.SglangScheduler`, so the vLLM client is used instead. Detection happens inside the
worker's first probe (`model_info` / `health`), on the event loop, bounded by the probe's timeout; until it
succeeds the worker takes no traffic and later probes try again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from ..errors import UpstreamError, UpstreamUnavailable
from .base import EngineChunk, EngineClient, GenerateRequest, ModelInfo, redact_url
from .sglang_grpc import SglangGrpcClient
from .vllm_grpc import VllmGrpcClient


async def detect_engine(
    url: str, timeout: float, *, request_timeout: float
) -> SglangGrpcClient | VllmGrpcClient:
    """Return a client for the protocol the worker at `url` speaks.

    Raises `errors.Upstream*` when the worker cannot be reached (nothing is decided then).
    """
    sglang = SglangGrpcClient(url, request_timeout=request_timeout)
    try:
        await sglang.health(timeout)
    except UpstreamError as exc:
        await sglang.close()
        cause = exc.__cause__
        if isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNIMPLEMENTED:
            return VllmGrpcClient(url, request_timeout=request_timeout)
        raise
    return sglang


class DetectingGrpcClient:
    """An `EngineClient` that picks SGLang or vLLM on first use and then delegates to it.

    `engine` reads "auto" until detection succeeded, then the detected engine's name. `generate` hands out
    the detected client's own iterator, so streaming costs nothing extra.
    """

    def __init__(self, url: str, *, request_timeout: float = 600.0) -> None:
        self.url = url
        self.engine = "auto"
        self._request_timeout = request_timeout
        self._inner: SglangGrpcClient | VllmGrpcClient | None = None
        self._lock = asyncio.Lock()

    @property
    def detected(self) -> EngineClient | None:
        return self._inner

    async def resolve(self, timeout: float = 10.0) -> SglangGrpcClient | VllmGrpcClient:
        if self._inner is None:
            async with self._lock:
                if self._inner is None:
                    inner = await detect_engine(self.url, timeout, request_timeout=self._request_timeout)
                    self._inner, self.engine = inner, inner.engine
        return self._inner

    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        return await (await self.resolve(timeout)).model_info(timeout=timeout)

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        return await (await self.resolve(timeout)).server_info(timeout=timeout)

    async def health(self, timeout: float) -> bool:
        return await (await self.resolve(timeout)).health(timeout)

    async def get_tokenizer(self, timeout: float = 60.0) -> bytes:
        inner = await self.resolve(timeout)
        fetch = getattr(inner, "get_tokenizer", None)
        if fetch is None:
            raise UpstreamError(
                f"the {inner.engine} engine at {redact_url(self.url)} cannot send its tokenizer"
            )
        data: bytes = await fetch(timeout=timeout)
        return data

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
