"""Translation of gRPC failures into the gateway's Upstream* errors, once, at the engine boundary."""

from __future__ import annotations

import contextlib

import grpc

from ..errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from .base import translating_errors

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}


def translate_rpc_error(exc: grpc.aio.AioRpcError, url: str) -> UpstreamError:
    code = exc.code()
    detail = exc.details() or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return UpstreamRejected(f"engine rejected the request: {detail}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return UpstreamTimeout(f"engine at {url} did not answer in time")
    if code in _UNAVAILABLE:
        return UpstreamUnavailable(f"engine at {url} is unavailable: {detail}")
    return UpstreamError(f"engine at {url} failed: {code.name}: {detail}")


def map_grpc_errors(url: str) -> contextlib.AbstractContextManager[None]:
    """A context in which a failed gRPC call raises its `translate_rpc_error` instead."""
    return translating_errors(grpc.aio.AioRpcError, translate_rpc_error, url)
