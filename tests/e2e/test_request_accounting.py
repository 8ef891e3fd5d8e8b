"""Every request accounted, through a real server: one line on `harmony_gateway.requests` and one count
in `gateway_requests_total` per request, whatever its status (refusals before any route ran, validation
errors, unknown models with the model asked for, a client that leaves mid-stream or while queued as
499), and per-key token counters that name the key's id, never the key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harmony_gateway.principal import key_id
from harmony_gateway.settings import KeyPolicy
from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import sims
from tests.support.servers import running_gateway, test_settings, wait_until

KEY = "sk-accounting-a"
TENANT_KEY = "sk-accounting-acme"
LIMITED_KEY = "sk-accounting-limited"
POLICIES = {KEY: KeyPolicy(), TENANT_KEY: KeyPolicy(tenant="acme"), LIMITED_KEY: KeyPolicy(rate_limit=1)}


class RequestLines(logging.Handler):
    """The request log's records as they are written (on the event loop's thread)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self._written = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._written.set()

    def of(self, request_id: str) -> list[dict[str, Any]]:
        return [r.fields for r in self.records if r.fields["request_id"] == request_id]  # type: ignore[attr-defined]

    async def wait_for(self, request_id: str) -> dict[str, Any]:
        """The one line of `request_id`, once it is written."""
        async with asyncio.timeout(10):
            while not self.of(request_id):
                self._written.clear()
                await self._written.wait()
        [line] = self.of(request_id)
        return line


@contextlib.contextmanager
def request_lines() -> Iterator[RequestLines]:
    logger = logging.getLogger("harmony_gateway.requests")
    handler, level = RequestLines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(http: httpx.AsyncClient) -> Samples:
    text = (await http.get("/metrics")).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def counted(before: Samples, after: Samples, name: str = "gateway_requests_total") -> dict[Any, float]:
    """The series of `name` that moved between two scrapes, by their labels, with how much."""
    moved = {}
    for (sample, labels), value in after.items():
        if sample == name and value != before.get((sample, labels), 0.0):
            moved[labels] = value - before.get((sample, labels), 0.0)
    return moved


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


@contextlib.asynccontextmanager
async def gateway(sim_config: SimConfig | None = None, **overrides: Any) -> AsyncIterator[Any]:
    async with sims(sim_config or SimConfig()) as (engine,):
        settings = test_settings(
            worker_urls=(engine.url,), api_keys=frozenset(POLICIES), key_policies=POLICIES, **overrides
        )
        async with running_gateway(settings) as gw:
            yield engine, gw


def chat_body(model: str = MODEL, stream: bool = False, text: str = "What is 2+2?") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": stream}


@dataclass(frozen=True)
class Case:
    """A request, what it is answered, and what its line and its count must say."""

    request_id: str
    path: str
    status: int
    route: str
    body: Any = None
    method: str = "POST"
    key: str | None = KEY
    logged_model: str = ""
    model_label: str = "unknown"


CHAT = "/v1/chat/completions"
CASES = [
    Case("bad-json", CHAT, 400, "chat", body=b"{not json"),
    Case(
        "invalid",
        CHAT,
        400,
        "chat",
        body={"model": MODEL, "messages": "hi"},
        logged_model=MODEL,
        model_label=MODEL,
    ),
    Case("unknown-model", CHAT, 404, "chat", body=chat_body("no-such-model"), logged_model="no-such-model"),
    Case("bad-key", CHAT, 401, "chat", body=chat_body(), key="sk-wrong"),
    Case("no-key", "/v1/responses", 401, "responses", body={"model": MODEL, "input": "hi"}, key=None),
    Case("missing", "/v1/responses/resp_missing", 404, "get_response", method="GET"),
    Case("nowhere", "/v1/nothing/here", 404, "unmatched", method="GET"),
    Case("too-large", CHAT, 413, "chat", body=chat_body(text="x" * 100_000)),  # over --max-body-bytes
    Case(
        "limited-1",
        CHAT,
        200,
        "chat",
        body=chat_body(),
        key=LIMITED_KEY,
        logged_model=MODEL,
        model_label=MODEL,
    ),
    Case("limited-2", CHAT, 429, "chat", body=chat_body(), key=LIMITED_KEY),
]


async def test_refusals_and_failures_are_each_one_line_and_one_count() -> None:
    with request_lines() as lines:
        async with (
            gateway(max_body_bytes=64 * 1024) as (_, gw),
            httpx.AsyncClient(base_url=gw.url, timeout=10) as http,
        ):
            before = await scrape(http)
            for case in CASES:
                headers = {"x-request-id": case.request_id}
                if case.key is not None:
                    headers["authorization"] = f"Bearer {case.key}"
                raw = isinstance(case.body, bytes)
                r = await http.request(
                    case.method,
                    case.path,
                    headers=headers,
                    content=case.body if raw else None,
                    json=None if raw else case.body,
                )
                assert r.status_code == case.status, (case.request_id, r.text)
            after = await scrape(http)
            for case in CASES:
                line = await lines.wait_for(case.request_id)
                assert (line["status"], line["model"], line["route"]) == (
                    case.status,
                    case.logged_model,
                    case.route,
                ), case.request_id
                known = case.key in POLICIES
                assert line["key_id"] == (key_id(case.key) if known and case.key else ""), case.request_id
    expected: dict[Any, float] = {}
    for case in CASES:
        series = labels(route=case.route, model=case.model_label, status=str(case.status))
        expected[series] = expected.get(series, 0.0) + 1
    assert counted(before, after) == expected
    for record in lines.records:
        message = record.getMessage()
        assert KEY not in message and LIMITED_KEY not in message


async def test_a_client_that_leaves_mid_stream_is_one_499() -> None:
    with request_lines() as lines:
        async with gateway(SimConfig(tokens_per_second=20)) as (engine, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                before = await scrape(http)
                headers = {"authorization": f"Bearer {KEY}", "x-request-id": "leaves-mid-stream"}
                body = chat_body(stream=True, text="[[long]] tell me a story")
                async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # the stream is under way: leave now
                line = await lines.wait_for("leaves-mid-stream")
                after = await scrape(http)
    assert line["status"] == 499 and line["model"] == MODEL and line["key_id"] == key_id(KEY)
    assert line["completion_tokens"] >= 1
    assert counted(before, after) == {labels(route="chat", model=MODEL, status="499"): 1.0}


async def test_a_client_that_leaves_while_queued_is_one_499() -> None:
    with request_lines() as lines:
        async with gateway(SimConfig(tokens_per_second=20), max_concurrent_requests=1, queue_size=4) as (
            _,
            gw,
        ):
            port = int(gw.url.rsplit(":", 1)[1])
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                headers = {"authorization": f"Bearer {KEY}", "x-request-id": "holds-the-slot"}
                body = chat_body(stream=True, text="[[long]] tell me a story")
                async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as held:
                    events = held.aiter_lines()  # kept: a dropped iterator closes the response
                    await anext(events)  # the slot is taken
                    before = await scrape(http)
                    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.write(
                        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                        b"authorization: Bearer " + KEY.encode() + b"\r\nx-request-id: leaves-queued\r\n"
                        b"content-length: %d\r\n\r\n" % len(raw) + raw
                    )
                    await writer.drain()
                    admission = gw.app.state.traffic.admission
                    await wait_until(lambda: admission.queued == 1)
                    writer.close()
                    await writer.wait_closed()
                    line = await lines.wait_for("leaves-queued")
                    after = await scrape(http)
    assert (line["status"], line["route"], line["key_id"]) == (499, "chat", key_id(KEY))
    assert counted(before, after) == {labels(route="chat", model="unknown", status="499"): 1.0}


async def test_tokens_are_counted_per_key_id_and_tenant() -> None:
    async with gateway() as (_, gw), httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        usage: dict[str, list[int]] = {KEY: [0, 0], TENANT_KEY: [0, 0]}
        for key in (KEY, TENANT_KEY, TENANT_KEY):
            r = await http.post(
                "/v1/chat/completions", json=chat_body(), headers={"authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200
            usage[key][0] += r.json()["usage"]["prompt_tokens"]
            usage[key][1] += r.json()["usage"]["completion_tokens"]
        # A background response's tokens are counted when it ends, after its request was answered.
        auth = {"authorization": f"Bearer {KEY}"}
        r = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "background": True}, headers=auth
        )
        assert r.status_code == 200, r.text
        response_id = r.json()["id"]
        done: dict[str, Any] = {}

        async def finished() -> bool:
            body = (await http.get(f"/v1/responses/{response_id}", headers=auth)).json()
            done.update(body)
            return body["status"] in ("completed", "failed", "cancelled")

        async with asyncio.timeout(10):
            while not await finished():
                await asyncio.sleep(0.05)
        assert done["status"] == "completed"
        usage[KEY][0] += done["usage"]["input_tokens"]
        usage[KEY][1] += done["usage"]["output_tokens"]
        text = (await http.get("/metrics")).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    for key, tenant in ((KEY, ""), (TENANT_KEY, "acme")):
        series = labels(key_id=key_id(key), tenant=tenant, model=MODEL)
        assert samples[("gateway_key_prompt_tokens_total", series)] == usage[key][0]
        assert samples[("gateway_key_completion_tokens_total", series)] == usage[key][1]
    assert KEY not in text and TENANT_KEY not in text


@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_request_is_logged_with_its_key_and_tenant(stream: bool) -> None:
    with request_lines() as lines:
        async with gateway() as (_, gw), httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
            request_id = f"served-{stream}"
            headers = {"authorization": f"Bearer {TENANT_KEY}", "x-request-id": request_id}
            r = await http.post("/v1/chat/completions", json=chat_body(stream=stream), headers=headers)
            assert r.status_code == 200
            line = await lines.wait_for(request_id)
    assert (line["status"], line["model"], line["key_id"], line["tenant"]) == (
        200,
        MODEL,
        key_id(TENANT_KEY),
        "acme",
    )
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "route", "status"),
    [
        ("/v1/chat/completions", chat_body(stream=True, text="[[long]] think hard"), "chat", 503),
        (
            "/v1/messages",
            {
                "model": MODEL,
                "max_tokens": 4000,
                "stream": True,
                "messages": [{"role": "user", "content": "[[long]] hi"}],
            },
            "messages",
            529,  # Anthropic's overloaded
        ),
    ],
)
async def test_a_stream_cut_by_the_drain_is_counted_with_its_wires_overloaded_status(
    path: str, body: dict[str, Any], route: str, status: int
) -> None:
    with request_lines() as lines:
        async with gateway(SimConfig(tokens_per_second=20)) as (_, gw):
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                before = await scrape(http)
                headers = {"authorization": f"Bearer {KEY}", "x-request-id": f"cut-{route}"}
                async with http.stream("POST", path, json=body, headers=headers) as r:
                    assert r.status_code == 200
                    events = r.aiter_lines()
                    await anext(events)  # under way
                    assert not await gw.app.state.traffic.drain(0)
                    tail = [line async for line in events]
                assert any("overloaded" in line or "shutting_down" in line for line in tail)
                line = await lines.wait_for(f"cut-{route}")
                after = await scrape(http)
    assert (line["status"], line["route"]) == (status, route)
    assert counted(before, after) == {labels(route=route, model=MODEL, status=str(status)): 1.0}
