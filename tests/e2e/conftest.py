"""Fixtures for the e2e tests: the official Anthropic SDK pointed at the session gateway, and a docs MCP
server on loopback per test module (with the calls it received)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest

from tests.mcp.servers import RunningMcp, build_docs_server, serve_mcp
from tests.support.servers import RunningGateway


@pytest.fixture
async def anthropic_client(gateway: RunningGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="test", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
async def docs_calls() -> list[tuple[str, dict[str, Any]]]:
    return []


@pytest.fixture(scope="module")
async def docs(docs_calls: list[tuple[str, dict[str, Any]]]) -> AsyncIterator[RunningMcp]:
    async with serve_mcp(build_docs_server(docs_calls)) as running:
        yield running
