"""Fixtures for the e2e tests: the official Anthropic SDK pointed at the session gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import pytest

from tests.support.servers import RunningGateway


@pytest.fixture
async def anthropic_client(gateway: RunningGateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=gateway.url, api_key="test", max_retries=0, timeout=30) as c:
        yield c
