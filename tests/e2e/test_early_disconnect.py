"""A client that leaves before the first byte of a stream: the engine request is aborted and the request
is still logged and counted, because the response closes what the request opened on every exit."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harmony_gateway.sim import SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import client_request_ids, running_gateway, test_settings, wait_until


def _requests_total(text: str, route: str) -> float:
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_requests":
            return sum(
                s.value for s in family.samples if s.name.endswith("_total") and s.labels["route"] == route
            )
    return 0.0


async def _leave_before_first_byte(port: int, path: str, body: bytes, request_id: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"x-request-id: {request_id}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await asyncio.sleep(0.15)  # the engine has not answered yet (ttft 600 ms)
    writer.close()
    await writer.wait_closed()


async def test_stream_abandoned_before_headers_is_aborted_and_counted() -> None:
    async with await start_sim_engine(SimConfig(ttft_ms=600, tokens_per_second=50)) as slow:
        async with running_gateway(test_settings(worker_urls=(slow.url,))) as gw:
            port = int(gw.url.rsplit(":", 1)[1])
            async with httpx.AsyncClient(base_url=gw.url) as http:
                before = _requests_total((await http.get("/metrics")).text, "chat")
                body = (
                    b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "[[long]] hi"}]}'
                    % MODEL.encode()
                )
                await _leave_before_first_byte(port, "/v1/chat/completions", body, "leaves-early")
                await wait_until(lambda: "leaves-early" in client_request_ids(slow.aborted), timeout=10)
                await wait_until(lambda: slow.active_requests == 0, timeout=10)
                after = _requests_total((await http.get("/metrics")).text, "chat")
                assert after == before + 1
