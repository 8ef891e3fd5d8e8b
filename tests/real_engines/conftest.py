"""One real MLX servicer for the session, serving the tiny gpt-oss, behind a recording proxy, with a
gateway in front of it. Skipped (with the reason) when the engine environment is not installed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from harmony_gateway.sim.tiny_model import CONVERSATION_DATE
from tests.support.real_engines import (
    EngineProcess,
    RecordingProxy,
    mlx_unavailable_reason,
    start_mlx_servicer,
    tiny_model_folder,
)
from tests.support.servers import RunningGateway, running_gateway, test_settings

TINY_MODEL = "tiny-gpt-oss"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = mlx_unavailable_reason()
    if reason is None:
        return
    for item in items:
        if "real_engines" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return tiny_model_folder()


@pytest.fixture(scope="session")
async def mlx_engine(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[EngineProcess]:
    engine = await start_mlx_servicer(tiny_model, tmp_path_factory.mktemp("mlx"))
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
async def mlx_proxy(mlx_engine: EngineProcess) -> AsyncIterator[RecordingProxy]:
    proxy = RecordingProxy(f"127.0.0.1:{mlx_engine.port}")
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def real_settings(url: str, **overrides: object) -> object:
    return test_settings(
        worker_urls=(url,),
        engine="auto",
        conversation_start_date=CONVERSATION_DATE,
        health_interval=1.0,
        health_timeout=5.0,
        **overrides,
    )


@pytest.fixture(scope="session")
async def mlx_gateway(mlx_proxy: RecordingProxy) -> AsyncIterator[RunningGateway]:
    async with running_gateway(real_settings(mlx_proxy.url)) as gw:  # type: ignore[arg-type]
        yield gw


@pytest.fixture
async def mlx_client(mlx_gateway: RunningGateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mlx_gateway.base_url, api_key="x", max_retries=0, timeout=60) as c:
        yield c
