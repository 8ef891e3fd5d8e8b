"""A real DNS server for tests: Debian's dnsmasq on a free loopback port (UDP and TCP), as a child process.

It reads nothing of the system (no resolv.conf, no /etc/hosts, no /etc/dnsmasq.conf), writes no system
file (its pid file is in the test's folder), forwards nothing, and answers NXDOMAIN for unknown names
under `test.`. A and AAAA records come from a hosts file the test rewrites (`set_hosts`, reloaded with
SIGHUP, returns once dnsmasq answers with them); SRV records are configuration, which dnsmasq reads only at start, so `set_srv` restarts it on
the same port. `pause()` (SIGSTOP) makes every lookup time out until `resume()`. Without dnsmasq the
tests skip locally and fail under CI (`make test` installs it), as the PostgreSQL and Redis ones do.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import pwd
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path

import pytest

from harmony_gateway.routing.dns_resolver import DnsResolver

DOMAIN = "test"


def dnsmasq_path() -> str | None:
    """DNSMASQ_PATH when set (as CHROMIUM_PATH for the browser tests), else dnsmasq on PATH or in sbin."""
    configured = os.environ.get("DNSMASQ_PATH")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None
    )


def require_dnsmasq() -> str:
    path = dnsmasq_path()
    if path is not None:
        return path
    message = "dnsmasq is not installed: `make test` installs it (apt-get install dnsmasq-base)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def free_udp_and_tcp_port() -> int:
    """A port free on 127.0.0.1 for both UDP and TCP."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
            udp.bind(("127.0.0.1", 0))
            port = int(udp.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
                try:
                    tcp.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no port free for both UDP and TCP on 127.0.0.1")


class Dnsmasq:
    """One dnsmasq process, known by its PID; `stop()` ends exactly that process."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.port = free_udp_and_tcp_port()
        self.hosts = folder / "hosts"
        self.conf = folder / "dnsmasq.conf"
        self.log = folder / "dnsmasq.log"
        self.hosts.write_text("")
        self.conf.write_text("")
        self.process: subprocess.Popen[bytes] | None = None
        self._names: set[str] = set()
        self._log_file = self.log.open("ab")

    @property
    def server(self) -> str:
        """The `--worker-dns-server` value."""
        return f"127.0.0.1:{self.port}"

    def resolver(self, timeout: float = 1.0) -> DnsResolver:
        return DnsResolver(self.server, timeout)

    async def start(self) -> None:
        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(os.getgid()).gr_name
        self.process = subprocess.Popen(
            [
                self.binary,
                "--keep-in-foreground",
                f"--conf-file={self.conf}",
                "--no-resolv",
                "--no-hosts",
                "--no-poll",
                f"--addn-hosts={self.hosts}",
                f"--local=/{DOMAIN}/",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                f"--port={self.port}",
                f"--pid-file={self.folder / 'dnsmasq.pid'}",
                # As root it would switch to an unprivileged user that cannot read the test's folder.
                f"--user={user}",
                f"--group={group}",
                "--cache-size=0",
                "--log-facility=-",
                "--log-queries",
            ],
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )
        # Ready once it answers (NXDOMAIN for a name it does not know).
        probe = self.resolver(timeout=0.5)

        async def answers() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.log.read_text()}")
            try:
                await probe.addresses(f"ready.{DOMAIN}", "A")
            except Exception:
                return False
            return True

        await wait_async(answers, timeout=15.0)

    async def set_hosts(self, records: Iterable[tuple[str, str]]) -> None:
        """Replace every A/AAAA record with `(address, name)` pairs; returns once dnsmasq answers with
        them (it rereads the file on SIGHUP), for the names set now and those set before."""
        records = list(records)
        text = "".join(f"{address} {name}\n" for address, name in records)
        tmp = self.hosts.with_suffix(".new")
        tmp.write_text(text)
        tmp.replace(self.hosts)
        assert self.process is not None
        self.process.send_signal(signal.SIGHUP)
        expected: dict[str, set[str]] = {name: set() for name in self._names}
        for address, name in records:
            expected.setdefault(name, set()).add(address)
        self._names = set(expected)
        resolver = self.resolver(timeout=0.5)

        async def answered() -> bool:
            for name, addresses in expected.items():
                found = await resolver.addresses(name, "A") + await resolver.addresses(name, "AAAA")
                if {str(a) for a in found} != addresses:
                    return False
            return True

        await wait_async(answered)

    async def set_srv(self, records: Sequence[tuple[str, str, int]]) -> None:
        """Replace every SRV record with `(name, target, port)` triples: dnsmasq restarts to read them."""
        self.conf.write_text("".join(f"srv-host={name},{target},{port}\n" for name, target, port in records))
        self.stop()
        await self.start()

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGCONT)  # a paused process would not act on SIGTERM
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def close(self) -> None:
        self.stop()
        self._log_file.close()


async def wait_async(
    predicate: Callable[[], Awaitable[bool]], timeout: float = 10.0, interval: float = 0.05
) -> None:
    """`tests.support.servers.wait_until` for an async predicate: a bounded poll, never a fixed sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def running_dnsmasq(folder: Path) -> AsyncIterator[Dnsmasq]:
    server = Dnsmasq(require_dnsmasq(), folder)
    try:
        await server.start()
        yield server
    finally:
        server.close()


__all__ = ["DOMAIN", "Dnsmasq", "require_dnsmasq", "running_dnsmasq", "wait_async"]
