"""Every start-up error of the real `harmony-gateway serve` (a subprocess): found before the port is
bound, one line on stderr naming the option and its value, exit status 2, no traceback, no banner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

WORKER = ["--worker-url", "grpc://127.0.0.1:1"]
MEMORY = ["--storage", "memory://"]


def serve(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HARMONY_GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "harmony_gateway.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=90,
        env=environ | (env or {}),
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("harmony-gateway: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert proc.stdout == ""  # no banner, no examples


def key_file(tmp: Path, text: str) -> str:
    path = tmp / "keys.txt"
    path.write_text(text)
    return str(path)


#: (flags given a temporary folder, what the one line says).
CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "worker URL without a scheme": (
        lambda _: ["--worker-url", "localhost:30000", *MEMORY],
        ("--worker-url localhost:30000: has no scheme: use grpc://localhost:30000",),
    ),
    "worker URL without a port": (
        lambda _: ["--worker-url", "grpc://engine", *MEMORY],
        ("--worker-url grpc://engine: needs a host and a port",),
    ),
    "storage scheme": (
        lambda _: [*WORKER, "--storage", "mysql://db/x"],
        ("--storage mysql://db/x: unsupported scheme 'mysql'",),
    ),
    "storage unreachable": (
        lambda _: [*WORKER, "--storage", "postgresql://gw:s3cret@127.0.0.1:1/gateway"],
        ("--storage postgresql://gw:***@127.0.0.1:1/gateway: cannot open it:",),
    ),
    "storage folder not writable": (
        lambda tmp: [*WORKER, "--storage", f"sqlite:///{key_file(tmp, '')}/sub/responses.db"],
        ("--storage sqlite:///", "cannot open it"),
    ),
    "missing key file": (
        lambda tmp: [*WORKER, *MEMORY, "--api-key-file", str(tmp / "none.txt")],
        ("--api-key-file", "none.txt: cannot read it"),
    ),
    "empty key file": (
        lambda tmp: [*WORKER, *MEMORY, "--api-key-file", key_file(tmp, "# no keys yet\n")],
        (
            "--api-key-file",
            "keys.txt: holds no key",
        ),
    ),
    "malformed key file": (
        lambda tmp: [*WORKER, *MEMORY, "--api-key-file", key_file(tmp, "sk-a\nsk-b colour=blue\n")],
        ("--api-key-file", "keys.txt:2: unknown key option 'colour=blue'"),
    ),
    "missing MCP config": (
        lambda tmp: [*WORKER, *MEMORY, "--mcp-config", str(tmp / "mcp.yaml")],
        ("--mcp-config", "mcp.yaml"),
    ),
    "TLS material": (
        lambda tmp: [
            *WORKER,
            *MEMORY,
            "--ssl-certfile",
            key_file(tmp, "not a certificate"),
            "--ssl-keyfile",
            "/x",
        ],
        ("--ssl-certfile", "cannot load them"),
    ),
    "TLS key missing": (
        lambda tmp: [*WORKER, *MEMORY, "--ssl-certfile", key_file(tmp, "x")],
        ("--ssl-certfile needs --ssl-keyfile too",),
    ),
    "reasoning key file": (
        lambda tmp: [*WORKER, *MEMORY, "--reasoning-key-file", str(tmp / "reasoning.key")],
        ("--reasoning-key-file", "reasoning.key: cannot read it"),
    ),
    "tokenizer folder": (
        lambda tmp: [*WORKER, *MEMORY, "--tokenizer", f"acme/m={tmp / 'tok'}"],
        ("--tokenizer acme/m=", "no such folder"),
    ),
    "unknown policy": (
        lambda _: [*WORKER, *MEMORY, "--policy", "fastest"],
        ("--policy fastest: unknown routing policy 'fastest'; expected one of",),
    ),
    "policy option": (
        lambda _: [*WORKER, *MEMORY, "--policy", "cache_aware", "--cache-threshold", "1.5"],
        ("--cache-threshold 1.5: cache_threshold must be between 0 and 1",),
    ),
    "host not of this machine": (
        lambda _: [*WORKER, *MEMORY, "--host", "192.0.2.1", "--port", "0"],
        ("--host 192.0.2.1: not an address of this machine",),
    ),
    "config file key": (
        lambda tmp: [*WORKER, "--config", key_file(tmp, "storage: memory://\npolcy: random\n")],
        ("keys.txt: unknown option 'polcy' (did you mean 'policy'?)",),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_start_up_error_is_one_line(case: str, tmp_path: Path) -> None:
    flags, fragments = CASES[case]
    proc = serve(*flags(tmp_path))
    assert_one_line(proc, *fragments)
    assert "s3cret" not in proc.stderr


def test_an_option_from_the_environment_is_named_with_it() -> None:
    proc = serve(*WORKER, env={"HARMONY_GATEWAY_STORAGE": "mysql://db/x"})
    assert_one_line(proc, "--storage mysql://db/x: unsupported scheme", "(set by HARMONY_GATEWAY_STORAGE)")


@pytest.mark.parametrize("demo", [False, True])
def test_a_port_in_use_is_one_line_and_no_banner(demo: bool) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = ["--demo"] if demo else WORKER
        proc = serve(*flags, *MEMORY, "--port", str(port))
    assert_one_line(proc, f"--port {port}: cannot listen on 127.0.0.1:{port}: the port is in use")


def test_the_admin_port_in_use_is_named() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve(*WORKER, *MEMORY, "--port", "0", "--admin-port", str(port))
    assert_one_line(proc, f"--admin-port {port}: cannot listen on 127.0.0.1:{port}: the port is in use")
