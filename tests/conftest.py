"""Shared fixtures: one simulated gpt-oss engine and one gateway in front of it, for the session."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.support.servers import RunningGateway, running_gateway, test_settings

MODEL = "openai/gpt-oss-20b"


@pytest.fixture(scope="session")
async def sim() -> AsyncIterator[RunningSim]:
    engine = await start_sim_engine(SimConfig(port=0, model=MODEL))
    try:
        yield engine
    finally:
        await engine.stop()


@pytest.fixture(scope="session")
async def gateway(sim: RunningSim) -> AsyncIterator[RunningGateway]:
    async with running_gateway(test_settings(worker_urls=(sim.url,))) as gw:
        yield gw


@pytest.fixture
async def client(gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="test", max_retries=0, timeout=30) as c:
        yield c
