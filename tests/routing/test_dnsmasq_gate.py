"""Without dnsmasq the DNS discovery tests skip locally and fail under CI, so a CI machine that lost it
cannot pass them silently."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


async def run_without_dnsmasq(ci: bool) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["DNSMASQ_PATH"] = "/nonexistent/dnsmasq"
    if ci:
        env["CI"] = "1"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/routing/test_dns_discovery.py::test_a_large_answer_arrives_over_tcp",
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


@pytest.mark.parametrize(("ci", "outcome"), [(False, "1 skipped"), (True, "1 error")])
async def test_missing_dnsmasq(ci: bool, outcome: str) -> None:
    returncode, output = await run_without_dnsmasq(ci)
    assert outcome in output, output
    assert "dnsmasq is not installed" in output
    assert (returncode != 0) is ci
