"""Real engine servers for the conformance tests: their environment, their model, their processes.

The MLX servicer (smg-grpc-servicer) runs from its own virtual environment in the project's cache folder
(`.cache/engines/mlx-venv`, made by `make engines`, which `make test` runs) and serves the tiny gpt-oss
that `harmony_gateway.sim.tiny_model` trains once and caches next to it. Every process is started here,
remembered by its PID, and stopped by that PID.

`RecordingProxy` sits between the gateway and an engine and forwards every RPC byte for byte while
recording what crossed it, so a test sees what the engine itself answered (an Abort acknowledged, a
stream that ended without a Complete) rather than what the gateway believes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from harmony_gateway.engines.mlx_grpc import MlxGrpcClient
from harmony_gateway.sim.tiny_model import ensure_tiny_model
from tests.support.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("HARMONY_GATEWAY_ENGINE_CACHE", ROOT / ".cache" / "engines"))
MLX_VENV = CACHE / "mlx-venv"
MLX_PYTHON = MLX_VENV / "bin" / "python"
#: Written by `make engines` once the pinned servicer stack is installed.
MLX_STAMP = MLX_VENV / ".installed"
START_TIMEOUT = 180.0


def mlx_unavailable_reason() -> str | None:
    if not MLX_STAMP.exists():
        return f"the MLX engine environment is not installed ({MLX_VENV}); run `make engines`"
    return None


def tiny_model_folder() -> Path:
    return ensure_tiny_model(CACHE, str(MLX_PYTHON), log=lambda line: sys.stderr.write(line + "\n"))


@dataclass
class EngineProcess:
    """One engine server process, known by its PID; `stop()` ends exactly that process."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would: no graceful shutdown, no goodbye to open streams."""
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(10)

    def log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-4000:]
        return ""


async def start_mlx_servicer(model: Path, log_dir: Path) -> EngineProcess:
    """Start `python -m smg_grpc_servicer.mlx.server` and wait until its HealthCheck says healthy."""
    port = free_port()
    log_path = log_dir / f"mlx-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(MLX_PYTHON), "-m", "smg_grpc_servicer.mlx.server", "--model", str(model)]
            + ["--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
    engine = EngineProcess(process, port, log_path)
    client = MlxGrpcClient(engine.url)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the MLX servicer exited with {process.returncode}:\n{engine.log_tail()}")
            with contextlib.suppress(Exception):
                if await client.health(timeout=2.0):
                    return engine
            if time.monotonic() > deadline:
                raise RuntimeError(f"the MLX servicer did not become healthy:\n{engine.log_tail()}")
            await asyncio.sleep(0.25)  # polling a process we do not control; no event to wait on
    except BaseException:
        engine.stop()
        raise
    finally:
        await client.close()


@dataclass
class RecordedCall:
    method: str
    request: bytes
    responses: list[bytes] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class RecordingProxy:
    """A gRPC server that forwards every method to `target` unchanged and records each call."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.calls: list[RecordedCall] = []
        self.changed = asyncio.Condition()
        self._channel = grpc.aio.insecure_channel(target)
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((_Handler(self),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace=None)
        await self._channel.close()

    async def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0) -> Any:
        async def until() -> Any:
            async with self.changed:
                while not (found := predicate()):
                    await self.changed.wait()
                return found

        return await asyncio.wait_for(until(), timeout)

    async def _note(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def unary(self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        call = RecordedCall(method, request)
        self.calls.append(call)
        upstream = self._channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            reply: bytes = await upstream(request, timeout=context.time_remaining())
            call.responses.append(reply)
            call.code = grpc.StatusCode.OK
            return reply
        except grpc.aio.AioRpcError as exc:
            call.code = exc.code()
            await context.abort(exc.code(), exc.details() or "")
            raise
        finally:
            call.done.set()
            await self._note()

    async def stream(
        self, method: str, request: bytes, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        call = RecordedCall(method, request)
        self.calls.append(call)
        upstream = self._channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        stream = upstream(request, timeout=context.time_remaining())
        try:
            async for reply in stream:
                call.responses.append(reply)
                await self._note()
                yield reply
            call.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            call.code = exc.code()
            await context.abort(exc.code(), exc.details() or "")
        finally:
            if call.code is None:
                call.code = grpc.StatusCode.CANCELLED  # the gateway went away first
                stream.cancel()
            call.done.set()
            await self._note()


#: The engine RPCs that stream their answers; everything else is unary.
_STREAMING = {"Generate", "GetTokenizer", "SubscribeKvEvents"}


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: RecordingProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details: Any) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method
        proxy = self._proxy
        if method.rsplit("/", 1)[-1] in _STREAMING:

            async def stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
                async for reply in proxy.stream(method, request, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(stream)

        async def unary(request: bytes, context: Any) -> bytes:
            return await proxy.unary(method, request, context)

        return grpc.unary_unary_rpc_method_handler(unary)
