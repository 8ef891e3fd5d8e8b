"""What the real `harmony-gateway serve` says when it starts: one line per worker (URL → engine protocol →
model), an unreachable worker named as such, the storage, the routing, the traffic limits and the listen
address; the demo's banner only once the port is bound and the gateway answers."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import sims
from tests.support.processes import free_port

pytestmark = pytest.mark.timeout(90)


class Output:
    """The merged stdout and stderr of a gateway process, read line by line as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[str] = []

    async def until(self, fragment: str, timeout: float = 45.0) -> list[str]:
        """Lines up to the first that holds `fragment` (all of them when it is already there)."""
        async with asyncio.timeout(timeout):
            while not any(fragment in line for line in self.lines):
                assert self.proc.stdout is not None
                raw = await self.proc.stdout.readline()
                if not raw:
                    raise AssertionError(f"the gateway exited before {fragment!r}:\n" + "\n".join(self.lines))
                self.lines.append(raw.decode().rstrip("\n"))
        return self.lines


@asynccontextmanager
async def serve(*flags: str) -> AsyncIterator[Output]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HARMONY_GATEWAY_")}
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "harmony_gateway.cli", "serve", "--log-level", "info", *flags),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=environ,
    )
    try:
        yield Output(proc)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def index(lines: list[str], fragment: str) -> int:
    return next(i for i, line in enumerate(lines) if fragment in line)


async def test_the_start_up_says_what_started() -> None:
    port, dead = free_port(), free_port()
    async with sims(SimConfig(engine="vllm")) as (engine,):
        flags = ["--port", str(port), "--worker-url", engine.url, "--worker-url", f"grpc://127.0.0.1:{dead}"]
        flags += ["--storage", "memory://", "--policy", "cache_aware", "--health-interval", "0.2"]
        flags += ["--max-concurrent-requests", "4", "--rate-limit", "60", "--api-key", "sk-1"]
        async with serve(*flags) as output:
            lines = await output.until("listening on")
            text = "\n".join(lines)
            assert f"worker w1 {engine.url} → vllm → {MODEL} (Harmony)" in text, text
            assert f"worker w2 grpc://127.0.0.1:{dead} is unreachable: " in text
            assert "; trying again in 0.2 s" in text
            assert "storing responses in memory://" in text
            assert (
                "routing: policy cache_aware (balance above 32 requests and 1.5x, cache threshold 0.5)"
                in text
            )
            assert (
                "traffic: at most 4 requests at once, 64 waiting up to 30 s; 60 requests/min per key" in text
            )
            assert "auth: 1 API keys" in text
            assert lines[-1].endswith(f"listening on http://127.0.0.1:{port}")
            # The unreachable worker is tried again after twice as long each time, and named each time.
            later = await output.until("still unreachable after 3 tries")
            assert "trying again in 0.4 s" in "\n".join(later)
            # Clients are told the worker is unreachable, not that it is still starting.
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    headers={"authorization": "Bearer sk-1"},
                    json={"model": "other", "messages": [{"role": "user", "content": "hi"}]},
                )
            assert r.status_code == 503
            assert "a worker is unreachable" in r.json()["error"]["message"]
            assert str(dead) not in r.text  # worker addresses stay in the gateway's log


async def test_the_demo_banner_comes_once_the_port_is_bound() -> None:
    port = free_port()
    async with serve("--demo", "--port", str(port), "--storage", "memory://") as output:
        lines = await output.until("Press Ctrl+C to stop.")
        listening = index(lines, f"listening on http://127.0.0.1:{port}")
        assert index(lines, f"Playground: http://127.0.0.1:{port}/") > listening
        async with httpx.AsyncClient(timeout=10) as http:  # it answers what the banner shows
            assert (await http.get(f"http://127.0.0.1:{port}/readiness")).status_code == 200


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


async def test_the_gateway_serves_https_with_its_own_certificate(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    port = free_port()
    flags = ["--demo", "--port", str(port), "--storage", "memory://"]
    async with serve(*flags, "--tls-cert-path", str(cert), "--ssl-keyfile", str(key)) as output:
        await output.until(f"listening on https://127.0.0.1:{port}")
        trust = ssl.create_default_context(cafile=str(cert))
        async with httpx.AsyncClient(verify=trust, timeout=10) as http:
            assert (await http.get(f"https://127.0.0.1:{port}/health")).status_code == 200
