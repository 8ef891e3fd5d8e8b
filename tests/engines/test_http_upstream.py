"""The HTTP upstream client translates transport failures once, at its boundary."""

from __future__ import annotations

import socket

import httpx
import pytest

from harmony_gateway.engines.base import GenerateRequest, SamplingOptions
from harmony_gateway.engines.http_upstream import HttpUpstreamClient, map_httpx_errors
from harmony_gateway.errors import UpstreamError, UpstreamRejected, UpstreamTimeout, UpstreamUnavailable
from tests.support.openai_upstream import FakeUpstream, running_upstream


def _request(text: str, stream: bool = True) -> GenerateRequest:
    body = {"completions": {"prompt": text}}
    return GenerateRequest("r1", [], SamplingOptions(), stream=stream, upstream_body=body)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_connection_refused_is_retryable_unavailable() -> None:
    client = HttpUpstreamClient(f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(UpstreamUnavailable) as info:
        async for _ in client.generate(_request("hi")):
            pass
    assert info.value.retryable and info.value.status_code == 503
    with pytest.raises(UpstreamUnavailable):
        await client.health(1.0)
    await client.close()


@pytest.mark.parametrize(
    ("failure", "expected", "message"),
    [
        (httpx.ReadTimeout("slow"), UpstreamTimeout, "did not answer in time (ReadTimeout)"),
        (httpx.ConnectError("refused"), UpstreamUnavailable, "is unavailable: refused"),
        (httpx.RemoteProtocolError("peer closed"), UpstreamError, "broke the connection: peer closed"),
        (httpx.WriteError("reset"), UpstreamUnavailable, "is unavailable: reset"),
    ],
)
def test_each_transport_error_becomes_its_upstream_error(
    failure: httpx.TransportError, expected: type[UpstreamError], message: str
) -> None:
    with pytest.raises(UpstreamError) as info, map_httpx_errors("http://up"):
        raise failure
    assert type(info.value) is expected and message in str(info.value)
    assert info.value.__cause__ is failure


async def test_read_timeout_is_upstream_timeout() -> None:
    async with running_upstream(FakeUpstream(slow_seconds=0.8)) as up:
        client = HttpUpstreamClient(up.url, request_timeout=0.3)
        with pytest.raises(UpstreamTimeout) as info:
            async for _ in client.generate(_request("[[slow]]")):
                pass
        assert info.value.status_code == 504
        await client.close()


async def test_model_info_health_and_4xx() -> None:
    async with running_upstream(FakeUpstream(models=("a", "b"))) as up:
        client = HttpUpstreamClient(up.url + "?model=b")
        info = await client.model_info()
        assert (info.served_model_name, info.max_context_length) == ("b", 8192)
        assert await client.health(1.0)
        up.health_status = 503
        assert not await client.health(1.0)
        with pytest.raises(UpstreamRejected, match="too silly"):
            async for _ in client.generate(_request("[[http400]]", stream=False)):
                pass
        chunks = [c async for c in client.generate(_request("[[plain]]", stream=False))]
        assert [c.text for c in chunks] == ["Just plain text with no markers at all."]
        assert chunks[0].finished and chunks[0].completion_tokens == 20
        await client.close()


async def test_health_falls_back_to_models() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(404)

    client = HttpUpstreamClient("http://upstream", transport=httpx.MockTransport(handler))
    assert await client.health(1.0)
    assert client._health_path == "/v1/models"
    await client.close()
