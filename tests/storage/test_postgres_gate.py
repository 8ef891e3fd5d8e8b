"""An unreachable PostgreSQL skips the postgres cases locally and fails them under CI."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


async def run_postgres_case(ci: bool) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    # Port 1 on loopback refuses connections at once.
    env["GATEWAY_TEST_PG_URL"] = "postgresql://postgres@127.0.0.1:1/test"
    if ci:
        env["CI"] = "1"
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pytest",
        "-q",
        str(HERE / "test_store_contract.py"),
        "-k",
        "postgres and test_put_get_replace_delete",
        cwd=HERE.parent.parent,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


@pytest.mark.parametrize(("ci", "outcome"), [(False, "1 skipped"), (True, "1 error")])
async def test_unreachable_postgres(ci: bool, outcome: str) -> None:
    returncode, output = await run_postgres_case(ci)
    assert outcome in output, output
    assert "is not reachable" in output
    assert (returncode != 0) is ci
