"""The total engine timeout ends a slow generation as UpstreamTimeout: a 504 before any byte was sent, an
SSE error frame after, never a bare cancellation; the engine request is aborted."""

from __future__ import annotations

import httpx
import openai
import pytest

from harmony_gateway.settings import Timeouts
from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import running_gateway, test_settings, wait_until

SLOW = [{"role": "user", "content": "[[long]] take a while"}]


async def test_total_timeout_is_a_504_or_an_error_frame() -> None:
    async with await start_sim_engine(SimConfig(tokens_per_second=40)) as slow:
        settings = test_settings(worker_urls=(slow.url,), timeouts=Timeouts(total=1.0), max_retries=0)
        async with running_gateway(settings) as gw:
            async with openai.AsyncOpenAI(base_url=gw.base_url, api_key="k", max_retries=0) as client:
                with pytest.raises(openai.InternalServerError) as info:
                    await client.chat.completions.create(model=MODEL, messages=SLOW)
                assert info.value.status_code == 504
            async with httpx.AsyncClient(base_url=gw.base_url, timeout=20) as http:
                body = {"model": MODEL, "messages": SLOW, "stream": True}
                async with http.stream(
                    "POST", "/chat/completions", json=body, headers={"x-request-id": "slow-1"}
                ) as r:
                    assert r.status_code == 200
                    text = (await r.aread()).decode()
            assert '"code":"upstream_timeout"' in text and text.rstrip().endswith("data: [DONE]")
            await wait_until(lambda: slow.active_requests == 0, timeout=10)
