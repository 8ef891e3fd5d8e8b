"""Gateway processes for tests that must kill or run several real gateways (SIGKILL, shared storage)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

import httpx

from tests.support.servers import TEST_DATE


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class GatewayProcess:
    proc: subprocess.Popen[bytes]
    port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


async def start_gateway_process(*args: str, timeout: float = 30.0, port: int | None = None) -> GatewayProcess:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "harmony_gateway.cli",
        "serve",
        "--port",
        str(port),
        "--conversation-date",
        TEST_DATE,
        "--log-level",
        "warning",
        "--health-interval",
        "0.5",
        *args,
    ]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    gateway = GatewayProcess(proc, port)
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient() as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            try:
                r = await client.get(f"http://127.0.0.1:{port}/readiness", timeout=1)
                if r.status_code == 200:
                    return gateway
            except httpx.HTTPError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                gateway.kill()
                raise RuntimeError("gateway did not become ready")
            await asyncio.sleep(0.1)
