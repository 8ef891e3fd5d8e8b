"""Every route fuzzed over loopback: bad input gets the route's error shape with the right status, never a
500, a traceback or a hang, and the gateway keeps answering afterwards.

Each route gets four kinds of request, drawn by hypothesis (a bounded number per route):

- a valid body with one field replaced by random JSON (null, huge and negative numbers, nested lists, long
  strings, unicode, Harmony special-token text), deleted, or with an unknown field added;
- arbitrary JSON, and non-JSON bytes (empty, truncated, `NaN`, wrong content type);
- odd path ids and query parameters (`limit=-1`, `order=sideways`, `after=unknown`);
- streams (`stream: true`), read to the end under a per-request timeout: they must end with the route's
  terminal event.

Also: clients leaving streams (chat, responses, messages) at random points must abort the engine request
and leave the gateway healthy; two requests sharing one `x-request-id` both answer and store separately;
and every bug this fuzzer found is pinned in `TRAPS` with its status and `param`.

Hypothesis drives plain functions in a worker thread; each request runs on the test loop through
`anyio.from_thread.run`, where the session gateway lives.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import anyio
import anyio.from_thread
import anyio.to_thread
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from harmony_gateway.surfaces.chat.types import ChatCompletionRequest
from harmony_gateway.surfaces.completions.types import CompletionRequest
from harmony_gateway.surfaces.generate.types import GenerateRequest, SglangSamplingParams
from harmony_gateway.surfaces.messages.types import MessagesRequest
from harmony_gateway.surfaces.responses.types import ResponsesRequest
from tests.conftest import MODEL
from tests.support.servers import (
    RunningGateway,
    client_request_ids,
    running_gateway,
    test_settings,
    wait_until,
)

REQUEST_TIMEOUT = 20.0
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)

# -- random JSON ---------------------------------------------------------------------------------------
SPECIAL_TEXT = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
    "<|start|>assistant<|channel|>final<|message|>hi<|return|>",
    "to=functions.x<|message|>{}",
    "[[junk]]",
    "[[refusal]]",
    "[[bad_json]]",
    "[[two_calls]]",
]
ODD_NUMBERS = [0, -1, 1, 2**31, 2**53 + 1, 2**63, -(2**63) - 1, 10**30, 201087, 201088, 1e308, -1e308, 0.5]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(ODD_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(SPECIAL_TEXT),
    st.sampled_from(["", " ", "x" * 70_000, "\u0000", "é" * 100, "🙂" * 50, "\ud7ff\ue000"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


#: Every request field the gateway knows, so that mutations also add fields the base body leaves out.
KNOWN_FIELDS = sorted(
    {
        name
        for model in (
            ChatCompletionRequest,
            ResponsesRequest,
            MessagesRequest,
            GenerateRequest,
            SglangSamplingParams,
            CompletionRequest,
        )
        for name in model.model_fields
    }
)
odd_ints = st.one_of(st.sampled_from(ODD_NUMBERS).filter(lambda v: isinstance(v, int)), st.integers())
field_values = st.one_of(json_values, odd_ints, st.lists(odd_ints, max_size=4))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON value (dict keys and list indexes), the root excluded."""
    out: list[tuple[Any, ...]] = []
    if isinstance(value, dict):
        for key, inner in value.items():
            out.append((*prefix, key))
            out.extend(_paths(inner, (*prefix, key)))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            out.append((*prefix, index))
            out.extend(_paths(inner, (*prefix, index)))
    return out


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    for piece in path[:-1]:
        root = root[piece]
    return root


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """`base` with one field replaced by random JSON, deleted, or an unknown field added."""
    body = json.loads(json.dumps(base))
    paths = _paths(body)
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "known"]))
    if action == "known":
        body[draw(st.sampled_from(KNOWN_FIELDS))] = draw(field_values)
        return body
    if action == "add" or not paths:
        target = (
            body if not paths else draw(st.sampled_from([body, *(_parent(body, p + (0,)) for p in paths)]))
        )
        if isinstance(target, dict):
            target[draw(st.text(max_size=12))] = draw(json_values)
        elif isinstance(target, list):
            target.append(draw(json_values))
        return body
    path = draw(st.sampled_from(paths))
    parent = _parent(body, path)
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(json_values)
    return body


raw_bodies = st.one_of(
    st.just(b""),
    st.binary(max_size=64),
    st.sampled_from([b"{", b"[]", b"null", b"42", b'"x"', b'{"a": NaN}', b"\xff\xfe{}", b"{}" * 3]),
    json_values.map(lambda v: json.dumps(v).encode()),
)


# -- the routes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    method: str
    path: str  # may name {response_id}, {conversation_id}, {item_id}, {worker_id}, {model}
    body: dict[str, Any] | None = None
    anthropic: bool = False
    streams: bool = False
    query: bool = False
    terminal: frozenset[str] = field(default_factory=frozenset)

    @property
    def name(self) -> str:
        return f"{self.method} {self.path}"


USER = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
DONE_ONLY = frozenset({"[DONE]"})
RESPONSES_END = frozenset({"response.completed", "response.failed", "response.incomplete", "error"})
MESSAGES_END = frozenset({"message_stop", "error"})

ROUTES = [
    Route(
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "max_tokens": 64, "tools": [WEATHER], "stop": ["zzz"]},
        streams=True,
        terminal=DONE_ONLY,
    ),
    Route(
        "POST",
        "/v1/responses",
        {
            "model": MODEL,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "instructions": "Be brief.",
            "max_output_tokens": 64,
            "tools": [
                {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
            ],
            "reasoning": {"effort": "low"},
            "store": True,
        },
        streams=True,
        terminal=RESPONSES_END,
    ),
    Route("GET", "/v1/responses/{response_id}", query=True),
    Route("DELETE", "/v1/responses/{response_id}"),
    Route("POST", "/v1/responses/{response_id}/cancel"),
    Route("GET", "/v1/responses/{response_id}/input_items", query=True),
    Route(
        "POST",
        "/v1/conversations",
        {"items": [{"type": "message", "role": "user", "content": "Hi"}], "metadata": {"topic": "x"}},
    ),
    Route("GET", "/v1/conversations/{conversation_id}"),
    Route("POST", "/v1/conversations/{conversation_id}", {"metadata": {"topic": "y"}}),
    Route("DELETE", "/v1/conversations/{conversation_id}"),
    Route("GET", "/v1/conversations/{conversation_id}/items", query=True),
    Route(
        "POST",
        "/v1/conversations/{conversation_id}/items",
        {"items": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "More"}]}]},
    ),
    Route("GET", "/v1/conversations/{conversation_id}/items/{item_id}"),
    Route("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}"),
    Route(
        "POST",
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 64,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
        },
        anthropic=True,
        streams=True,
        terminal=MESSAGES_END,
    ),
    Route(
        "POST",
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "system": "Be brief."},
        anthropic=True,
    ),
    Route(
        "POST",
        "/generate",
        {
            "text": "<|start|>user<|message|>Hi<|end|>",
            "sampling_params": {"max_new_tokens": 16, "stop": ["zzz"]},
        },
        streams=True,
        terminal=DONE_ONLY,
    ),
    Route(
        "POST",
        "/generate",
        {"input_ids": [200006, 1428, 200008, 12194, 200007], "sampling_params": {"max_new_tokens": 16}},
        streams=True,
        terminal=DONE_ONLY,
    ),
    Route(
        "POST",
        "/v1/completions",
        {"model": MODEL, "prompt": "<|start|>user<|message|>Hi<|end|>", "max_tokens": 16, "logprobs": 2},
        streams=True,
        terminal=DONE_ONLY,
    ),
    Route("GET", "/v1/models"),
    Route("GET", "/v1/models/{model}"),
    Route("GET", "/workers"),
]
WORKER_ROUTES = [
    Route("POST", "/workers", {"url": "grpc://127.0.0.1:9", "kind": "regular", "engine": "sglang"}),
    Route("DELETE", "/workers/{worker_id}"),
]

ODD_IDS = st.one_of(
    st.sampled_from(["unknown", "resp_unknown", "conv_unknown", "msg_unknown", "..", "%", "a" * 3000, " "]),
    st.text(min_size=1, max_size=30),
)
ODD_QUERY = st.dictionaries(
    st.sampled_from(["limit", "order", "after", "stream", "starting_after", "include[]", "x"]),
    st.sampled_from(
        ["-1", "0", "1", "100", "101", "1e3", "abc", "", "sideways", "asc", "desc", "unknown", "true"]
    ),
    max_size=4,
)


# -- one request and its checks --------------------------------------------------------------------------
@dataclass
class Ids:
    response_id: str
    conversation_id: str
    item_id: str
    worker_id: str = "unknown"
    model: str = MODEL


def sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        if data:
            events.append((name, "\n".join(data)))
    return events


def check_error(route: Route, response: httpx.Response, note: str) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{note}: error body is not JSON: {response.text[:300]!r}")
    if route.anthropic:
        assert body.get("type") == "error", note
        error = body["error"]
    else:
        error = body.get("error")
        assert isinstance(error, dict), note
        assert "param" in error and "code" in error, note
        assert error["code"] is None or isinstance(error["code"], str), note
        assert error["param"] is None or isinstance(error["param"], str), note
    assert isinstance(error.get("message"), str) and error["message"], note
    assert isinstance(error.get("type"), str) and error["type"], note


def check_stream(route: Route, response: httpx.Response, note: str) -> None:
    events = sse_events(response.text)
    assert events, f"{note}: empty stream"
    last_name, last_data = events[-1]
    if route.terminal == DONE_ONLY:
        assert last_data == "[DONE]", f"{note}: stream ended with {last_data[:200]!r}"
        for _, data in events[:-1]:
            json.loads(data)
        return
    kinds = [json.loads(data).get("type", name) for name, data in events]
    assert kinds[-1] in route.terminal, f"{note}: stream ended with {kinds[-1]!r}"


def check(route: Route, response: httpx.Response, note: str) -> None:
    note = f"{route.name} {note} -> {response.status_code} {response.text[:400]!r}"
    assert response.status_code != 500, note
    assert response.status_code < 500 or response.status_code == 503 and route.path == "/workers", note
    assert not 300 <= response.status_code < 400, note
    assert response.headers.get("x-request-id"), note
    if response.status_code >= 400:
        check_error(route, response, note)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(route, response, note)
    else:
        response.json()


def url_of(route: Route, ids: Ids, override: str | None = None) -> str:
    values = {k: quote(v, safe="") for k, v in vars(ids).items()}
    if override is not None:
        for key in ("response_id", "conversation_id", "item_id", "worker_id", "model"):
            if "{" + key + "}" in route.path:
                values[key] = quote(override, safe="")
                break
    return route.path.format(**values)


async def send(
    http: httpx.AsyncClient,
    route: Route,
    url: str,
    content: bytes | None,
    *,
    content_type: str = "application/json",
    params: dict[str, str] | None = None,
) -> httpx.Response:
    headers = {"content-type": content_type} if content is not None else {}
    with anyio.fail_after(REQUEST_TIMEOUT):
        return await http.request(route.method, url, content=content, headers=headers, params=params)


async def assert_healthy(http: httpx.AsyncClient) -> None:
    """The gateway still answers a normal request (nothing is wedged)."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 32}
    with anyio.fail_after(REQUEST_TIMEOUT):
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


async def fresh_ids(http: httpx.AsyncClient) -> Ids:
    r = await http.post("/v1/responses", json={"model": MODEL, "input": "remember me", "store": True})
    assert r.status_code == 200, r.text
    c = await http.post(
        "/v1/conversations", json={"items": [{"type": "message", "role": "user", "content": "kept"}]}
    )
    assert c.status_code == 200, c.text
    conversation_id = c.json()["id"]
    items = (await http.get(f"/v1/conversations/{conversation_id}/items")).json()
    return Ids(r.json()["id"], conversation_id, items["data"][0]["id"])


def run_in_thread(fn: Callable[[], None]) -> Any:
    return anyio.to_thread.run_sync(fn)


@pytest.fixture
async def http(gateway: RunningGateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=REQUEST_TIMEOUT) as c:
        yield c


async def fuzz_route(http: httpx.AsyncClient, route: Route, ids: Ids) -> None:
    body_requests: list[Any] = []
    if route.body is not None:
        base = dict(route.body)
        body_requests.append(mutated(base).map(lambda b: ("json", b)))
        body_requests.append(raw_bodies.map(lambda b: ("raw", b)))
        if route.streams:
            body_requests.append(mutated({**base, "stream": True}).map(lambda b: ("json", b)))
    path_requests = [
        st.tuples(st.just("path"), st.one_of(st.none(), ODD_IDS), ODD_QUERY if route.query else st.just({}))
    ]

    @FUZZ
    @given(st.one_of(*body_requests, *path_requests))
    def one(case: tuple[Any, ...]) -> None:
        async def go() -> None:
            kind = case[0]
            if kind == "json":
                content = json.dumps(case[1]).encode()
                response = await send(http, route, url_of(route, ids), content)
                check(route, response, f"body={content[:300]!r}")
            elif kind == "raw":
                for content_type in ("application/json", "text/plain"):
                    response = await send(http, route, url_of(route, ids), case[1], content_type=content_type)
                    check(route, response, f"raw={case[1][:100]!r} ({content_type})")
            else:
                content = json.dumps(route.body).encode() if route.body is not None else None
                url = url_of(route, ids, case[1])
                response = await send(http, route, url, content, params=case[2])
                check(route, response, f"url={url[:200]} params={case[2]}")

        anyio.from_thread.run(go)

    await run_in_thread(one)
    await assert_healthy(http)


# -- the tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
async def test_fuzz_route(http: httpx.AsyncClient, route: Route) -> None:
    await fuzz_route(http, route, await fresh_ids(http))


async def test_fuzz_worker_routes(sim: RunningSim) -> None:
    """On a gateway of its own: fuzzed registrations must not leave the shared fleet with stray workers."""
    async with (
        running_gateway(
            test_settings(
                worker_urls=(sim.url,), admin_keys=frozenset({"sk-admin"}), worker_allow_hosts=("127.0.0.1",)
            )
        ) as gw,
        httpx.AsyncClient(
            base_url=gw.url, timeout=REQUEST_TIMEOUT, headers={"authorization": "Bearer sk-admin"}
        ) as http,
    ):
        ids = await fresh_ids(http)
        for route in WORKER_ROUTES:
            await fuzz_route(http, route, ids)
        listed = (await http.get("/workers")).json()["data"]
        assert any(w["url"] == sim.url for w in listed)


async def test_huge_bodies(http: httpx.AsyncClient) -> None:
    """A few MB of text in a field, or a few MB of JSON nesting, is a 4xx or an answer, never a 500."""
    huge_text = "word " * 700_000
    cases: list[tuple[Route, bytes]] = []
    for route in ROUTES:
        if route.body is None:
            continue
        body = json.loads(json.dumps(route.body))
        for key in ("messages", "input", "prompt", "text", "items", "metadata"):
            if key in body:
                body[key] = huge_text if key != "metadata" else {"k": huge_text}
                break
        cases.append((route, json.dumps(body).encode()))
    cases.append((ROUTES[0], b"[" * 200_000 + b"]" * 200_000))
    cases.append((ROUTES[0], b'{"model": "' + b"m" * 3_000_000 + b'"}'))
    ids = await fresh_ids(http)
    for route, content in cases:
        response = await send(http, route, url_of(route, ids), content)
        check(route, response, f"huge body of {len(content)} bytes")
    await assert_healthy(http)


def _nested(depth: int, leaf: Any = "x") -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("depth", [60, 300])
async def test_deep_nesting_in_a_field(http: httpx.AsyncClient, depth: int) -> None:
    """Deep JSON in a stored, echoed or ignored field is a 400 naming it (orjson writes 254 levels at most)."""
    ids = await fresh_ids(http)
    for route in (r for r in ROUTES if r.body is not None):
        for extra in ({"metadata": {"a": _nested(depth)}}, {"unknown": _nested(depth)}):
            body = {**(route.body or {}), **extra}
            response = await send(http, route, url_of(route, ids), json.dumps(body).encode())
            check(route, response, f"{list(extra)} nested {depth} deep")
            if depth > 128:
                assert response.status_code == 400, response.text
    await assert_healthy(http)


# -- streams: a client leaving at a random point -----------------------------------------------------
STREAMS = {
    "chat": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Tell me [[long]]"}]},
    ),
    "responses": ("/v1/responses", {"model": MODEL, "input": "Tell me [[long]]", "store": True}),
    "messages": (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 2000,
            "thinking": {"type": "enabled", "budget_tokens": 1024},  # the long analysis streams
            "messages": [{"role": "user", "content": "Tell me [[long]]"}],
        },
    ),
}


@pytest.fixture(scope="module")
async def slow_gateway() -> AsyncIterator[tuple[RunningSim, RunningGateway]]:
    async with (
        await start_sim_engine(SimConfig(port=0, model=MODEL, tokens_per_second=150)) as engine,
        running_gateway(test_settings(worker_urls=(engine.url,))) as gw,
    ):
        yield engine, gw


@pytest.mark.parametrize("kind", sorted(STREAMS))
async def test_client_leaving_a_stream_at_random_points(
    kind: str, slow_gateway: tuple[RunningSim, RunningGateway]
) -> None:
    engine, gw = slow_gateway
    path, body = STREAMS[kind]
    rng = random.Random(kind)
    async with httpx.AsyncClient(base_url=gw.url, timeout=REQUEST_TIMEOUT) as http:
        for leave_after in sorted(rng.sample(range(0, 40), 4)):
            request_id = f"leave{kind}{leave_after}{uuid.uuid4().hex[:8]}"
            with anyio.fail_after(REQUEST_TIMEOUT):
                async with http.stream(
                    "POST", path, json={**body, "stream": True}, headers={"x-request-id": request_id}
                ) as response:
                    assert response.status_code == 200
                    assert response.headers["x-request-id"] == request_id
                    seen = 0
                    async for line in response.aiter_lines():
                        if seen >= leave_after:
                            break
                        if line.startswith("data:"):
                            seen += 1
            await wait_until(lambda rid=request_id: rid in client_request_ids(engine.aborted), timeout=5)
        await wait_until(lambda: engine.active_requests == 0, timeout=5)
        await assert_healthy(http)


async def test_client_leaving_before_the_first_byte(slow_gateway: tuple[RunningSim, RunningGateway]) -> None:
    engine, gw = slow_gateway
    async with httpx.AsyncClient(base_url=gw.url, timeout=REQUEST_TIMEOUT) as http:
        for kind, (path, body) in sorted(STREAMS.items()):
            request_id = f"early{kind}{uuid.uuid4().hex[:8]}"
            with anyio.move_on_after(0.2):
                await http.post(path, json={**body, "stream": True}, headers={"x-request-id": request_id})
            await wait_until(lambda rid=request_id: rid in client_request_ids(engine.aborted), timeout=5)
        await wait_until(lambda: engine.active_requests == 0, timeout=5)
        await assert_healthy(http)


async def test_concurrent_identical_request_ids(
    http: httpx.AsyncClient, gateway: RunningGateway, sim: RunningSim
) -> None:
    """Two requests with one x-request-id, at once, on every generating route: both answer, nothing stored
    by one is overwritten by the other."""
    request_id = "dup" + uuid.uuid4().hex
    headers = {"x-request-id": request_id}
    bodies = [
        ("/v1/chat/completions", {"model": MODEL, "messages": USER}),
        ("/v1/responses", {"model": MODEL, "input": "first twin", "store": True}),
        ("/v1/messages", {"model": MODEL, "max_tokens": 200, "messages": USER}),
        ("/v1/completions", {"model": MODEL, "prompt": "<|start|>user<|message|>Hi<|end|>", "max_tokens": 8}),
        ("/generate", {"text": "<|start|>user<|message|>Hi<|end|>"}),
    ]
    for path, body in bodies:
        for stream in (False, True):
            twin = json.loads(json.dumps(body).replace("first twin", "second twin"))
            with anyio.fail_after(REQUEST_TIMEOUT):
                first, second = await asyncio.gather(
                    http.post(path, json={**body, "stream": stream}, headers=headers),
                    http.post(path, json={**twin, "stream": stream}, headers=headers),
                )
            for response in (first, second):
                assert response.status_code == 200, (path, response.text)
                assert response.headers["x-request-id"] == request_id
            if path == "/v1/responses" and not stream:
                ids = {first.json()["id"], second.json()["id"]}
                assert len(ids) == 2, "two responses were stored under one id"
                for response_id in ids:
                    stored = await http.get(f"/v1/responses/{response_id}")
                    assert stored.status_code == 200, stored.text
                inputs = [(await http.get(f"/v1/responses/{rid}/input_items")).text for rid in sorted(ids)]
                assert sorted("first twin" in text for text in inputs) == [False, True]
                assert sorted("second twin" in text for text in inputs) == [False, True]
    await wait_until(lambda: sim.active_requests == 0, timeout=5)
    await assert_healthy(http)


# -- known traps, each pinned ----------------------------------------------------------------------------
DEEP = _deep_schema(60)  # openai-harmony cannot render it (serde_json's recursion limit)
#: A run of letters openai-harmony's pre-tokenizer cannot split: it panics at about a million characters.
HUGE_WORD = "x" * 1_000_000
HUGE_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "description": HUGE_WORD}}}
TRAPS: list[tuple[str, dict[str, Any], int, str | None]] = [
    # (path, body, status, param)
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "stop_token_ids": [-1]},
        400,
        "stop_token_ids[0]",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "stop_token_ids": [2**40]},
        400,
        "stop_token_ids[0]",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "top_k": 2**40}, 400, "top_k"),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "seed": 2**70}, 400, "seed"),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": USER,
            "tools": [WEATHER, {"type": "function", "function": {"name": "deep", "parameters": DEEP}}],
        },
        400,
        "tools[1]",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 3, "stream": True}, 200, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 10**9}, 200, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": "s"}]}, 200, None),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "tool", "content": "r", "tool_call_id": "x"}]},
        400,
        "messages[0].tool_call_id",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": USER, "stop": [""]}, 400, "stop"),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "deep", "parameters": DEEP}]},
        400,
        "tools[0]",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [
                {
                    "type": "namespace",
                    "name": "ns",
                    "tools": [{"type": "function", "name": "d", "parameters": DEEP}],
                }
            ],
        },
        400,
        "tools[0].tools[0]",
    ),
    ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [{"type": []}]}, 400, "tools[0].type"),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": 5}]},
        400,
        "tools[0].tools",
    ),
    ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": 5}}, 400, "text.format"),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": [], "role": "user", "content": "x"}]},
        400,
        "input[0].type",
    ),
    ("/v1/responses", {"model": MODEL, "input": [{"role": ["user"], "content": "x"}]}, 400, "input[0].role"),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": [{"type": {}}]}]},
        400,
        "input[0].content[0].type",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": "x", "id": 5}]},
        400,
        "input[0].id",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "function_call_output", "output": "x"}]},
        400,
        "input[0].call_id",
    ),
    ("/v1/conversations", {"items": [{"type": [], "role": "user", "content": "x"}]}, 400, "items[0].type"),
    # Shapes that were 500s: each is a 400 naming the field.
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tool_choice": {"type": "allowed_tools", "allowed_tools": {"tools": 5}},
        },
        400,
        "tool_choice.allowed_tools.tools",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "tool_choice": {"type": "allowed_tools", "tools": [{"name": 5}]}},
        400,
        "tool_choice.tools[0].name",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": USER, "tool_choice": {"type": "allowed_tools", "allowed_tools": []}},
        400,
        "tool_choice.allowed_tools",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "mcp_call", "server_label": "s", "name": "n", "arguments": 5}]},
        400,
        "input[0].arguments",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": [{"type": "mcp_call", "server_label": ["s"], "name": "n", "arguments": "{}"}],
        },
        400,
        "input[0].server_label",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "mcp_approval_request", "server_label": "s", "name": {}}]},
        400,
        "input[0].name",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": {}}]}],
        },
        400,
        "input[0].content[0].text",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}]},
        400,
        "input[0].summary[0].text",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "reasoning", "summary": [], "encrypted_content": 5}]},
        400,
        "input[0].encrypted_content",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"type": "code_interpreter_call", "code": 5}]},
        400,
        "input[0].code",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f", "description": 5}]},
        400,
        "tools[0].description",
    ),
    # openai-harmony's own BPE is quadratic in a run's length: tool text it encodes holds no run over 256.
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "description": "你" * 20_000}],
        },
        400,
        "tools[0]",
    ),
    # Lengths openai-harmony cannot take (it panics on a run of about a million characters): capped.
    ("/v1/responses", {"model": MODEL, "input": "hi", "instructions": HUGE_WORD}, 400, "instructions"),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "description": HUGE_WORD}],
        },
        400,
        "tools[0].description",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "namespace", "name": "ns", "description": HUGE_WORD, "tools": []}],
        },
        400,
        "tools[0].description",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "f", "parameters": HUGE_SCHEMA}],
        },
        400,
        "tools[0].parameters",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "schema": HUGE_SCHEMA}}},
        400,
        "text.format.schema",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "description": HUGE_WORD}}],
        },
        400,
        "tools[0].function.description",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": USER,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE_SCHEMA}}],
        },
        400,
        "tools[0].function.parameters",
    ),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": USER,
            "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": HUGE_SCHEMA}},
        },
        400,
        "response_format.json_schema.schema",
    ),
    # Raw prompts take the fast encoder (split at special tokens), which encodes a run of any length
    # in linear time: a million letters are 125,000 tokens, served.
    ("/generate", {"text": HUGE_WORD, "sampling_params": {"max_new_tokens": 4}}, 200, None),
    ("/v1/completions", {"model": MODEL, "prompt": HUGE_WORD, "max_tokens": 4}, 200, None),
    # Text with characters the fast encoder splits differently still takes openai-harmony's encoder,
    # quadratic in a run's length: a run over 256 characters there is the request's 400.
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "\u088f" + HUGE_WORD}]},
        400,
        None,
    ),
    # Instructions from system messages reach the developer message through the fast encoder.
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "system", "content": HUGE_WORD}, *USER], "max_tokens": 4},
        200,
        None,
    ),
    (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 10,
            "messages": USER,
            "tools": [{"name": "f", "description": HUGE_WORD, "input_schema": {"type": "object"}}],
        },
        400,
        "tools[0].description",
    ),
    (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 10,
            "messages": USER,
            "tools": [{"name": "f", "input_schema": HUGE_SCHEMA}],
        },
        400,
        "tools[0].input_schema",
    ),
    (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 10, "messages": USER, "system": HUGE_WORD},
        200,
        None,
    ),
    ("/generate", {"input_ids": [201088]}, 400, "input_ids"),
    ("/generate", {"input_ids": [1, -1]}, 400, "input_ids"),
    ("/generate", {"input_ids": [2**32]}, 400, "input_ids"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"stop_token_ids": [-1]}},
        400,
        "sampling_params.stop_token_ids[0]",
    ),
    (
        "/generate",
        {"text": "a", "sampling_params": {"min_new_tokens": 2**40}},
        400,
        "sampling_params.min_new_tokens",
    ),
    ("/generate", {"text": "a", "sampling_params": {"top_k": 2**40}}, 400, "sampling_params.top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": [201088]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "a", "stop_token_ids": [2**33]}, 400, "stop_token_ids[0]"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 10, "messages": USER, "top_k": 2**40}, 400, None),
    (
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": 10,
            "messages": USER,
            "tools": [{"name": "deep", "input_schema": DEEP}],
        },
        400,
        None,
    ),
    (
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": USER, "tools": [{"name": "deep", "input_schema": DEEP}]},
        400,
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), TRAPS, ids=lambda v: str(v)[:60])
async def test_known_traps(
    http: httpx.AsyncClient, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    route = next(r for r in ROUTES if r.path == path and r.method == "POST")
    with anyio.fail_after(REQUEST_TIMEOUT):
        response = await http.post(path, json=body)
    check(route, response, json.dumps(body)[:200])
    assert response.status_code == status, response.text
    assert status < 400 or len(response.content) < 4096, "an error must not echo the request back"
    if status >= 400 and not route.anthropic:
        assert response.json()["error"]["param"] == param
    elif status >= 400 and param is not None:  # Anthropic errors name the field in their message
        assert param in response.json()["error"]["message"], response.text
    elif status >= 400:
        assert (
            "tools[0]" in response.json()["error"]["message"]
            or "top_k" in response.json()["error"]["message"]
        )


# -- every field of a full request, each odd JSON shape in turn -------------------------------------------
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "where"}},
    "required": ["city"],
}
#: Requests using every field and item kind a client may send (client-side tools only: nothing dials out).
FULL_BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": "Mind the units."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Think."}],
                "content": [{"type": "reasoning_text", "text": "Call the tool."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "cold"},
            {
                "type": "mcp_call",
                "id": "mcp_1",
                "server_label": "docs",
                "name": "search",
                "arguments": "{}",
                "output": "found",
                "error": None,
                "status": "completed",
            },
            {"type": "mcp_list_tools", "id": "mcpl_1", "server_label": "docs", "tools": [{"name": "search"}]},
            {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "diff"},
            {"type": "custom_tool_call_output", "call_id": "c2", "output": "applied"},
            {
                "type": "code_interpreter_call",
                "id": "ci_1",
                "code": "1+1",
                "outputs": [{"type": "logs", "logs": "2"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Cold."}]},
            {"type": "message", "role": "user", "content": "Thanks"},
        ],
        "tools": [
            {"type": "function", "name": "get_weather", "description": "weather", "parameters": SCHEMA},
            {"type": "custom", "name": "patch", "description": "apply a diff"},
            {
                "type": "namespace",
                "name": "ns",
                "description": "grouped",
                "tools": [{"type": "function", "name": "f"}],
            },
        ],
        "tool_choice": {
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
        "reasoning": {"effort": "low", "summary": "auto"},
        "max_output_tokens": 64,
        "max_tool_calls": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "parallel_tool_calls": True,
        "metadata": {"k": "v"},
        "include": ["reasoning.encrypted_content"],
        "truncation": "disabled",
        "user": "u",
        "store": False,
    },
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Call the tool.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "cold"},
            {"role": "user", "content": "Thanks", "name": "ann"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": "w", "parameters": SCHEMA},
            }
        ],
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [WEATHER]}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
        "stream_options": {"include_usage": True},
        "stop": ["zzz"],
        "max_tokens": 64,
        "temperature": 0.5,
        "reasoning_effort": "low",
        "seed": 7,
        "user": "u",
    },
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "cold"}]},
        ],
        "tools": [{"name": "get_weather", "description": "weather", "input_schema": SCHEMA}],
        "tool_choice": {"type": "auto"},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "stop_sequences": ["zzz"],
        "temperature": 0.5,
        "metadata": {"user_id": "u"},
    },
}
#: Second requests for the shapes the first ones leave out (other tool choices, item and block kinds).
MORE_BODIES: dict[str, dict[str, Any]] = {
    "/v1/responses": {
        "model": MODEL,
        "input": [
            {"type": "local_shell_call", "call_id": "s1", "action": {"type": "exec", "command": ["ls"]}},
            {"type": "local_shell_call_output", "call_id": "s1", "output": "a.txt"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"role": "user", "content": [{"type": "input_text", "text": "Go on"}]},
        ],
        "tools": [{"type": "local_shell"}, {"type": "function", "name": "get_weather", "parameters": SCHEMA}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_object"}},
        "max_output_tokens": 64,
        "store": False,
    },
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "user", "content": "Please"},
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_object"},
        "max_completion_tokens": 64,
        "stop": "zzz",
    },
    "/v1/messages": {
        "model": MODEL,
        "max_tokens": 64,
        "system": "Be brief.",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Hm.", "signature": "x"},
                    {"type": "text", "text": "Cold."},
                ],
            },
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [{"name": "get_weather", "input_schema": SCHEMA}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "output_config": {"effort": "low"},
    },
}
#: Numbers, objects and lists where strings are expected, and the reverse.
ODD_SHAPES: list[Any] = [5, -1.5, True, None, "", "x", {}, {"x": 1}, [], [5], [{}]]


@pytest.mark.parametrize(
    ("path", "base"),
    [*FULL_BODIES.items(), *MORE_BODIES.items()],
    ids=[f"{p}-{n}" for n in ("full", "more") for p in FULL_BODIES],
)
async def test_every_field_in_every_odd_shape(
    http: httpx.AsyncClient, path: str, base: dict[str, Any]
) -> None:
    """Each field of a full request (at any depth) replaced by each odd shape: an answer or a 4xx naming
    the problem, never a 5xx. Failures are collected so that one run lists them all."""
    route = next(r for r in ROUTES if r.path == path and r.method == "POST")
    response = await send(http, route, path, json.dumps(base).encode())
    assert response.status_code == 200, response.text
    failures: list[str] = []
    for where in _paths(base):
        for shape in ODD_SHAPES:
            body = json.loads(json.dumps(base))
            _parent(body, where)[where[-1]] = shape
            response = await send(http, route, path, json.dumps(body).encode())
            try:
                check(route, response, f"{where} = {shape!r}")
            except AssertionError as exc:
                failures.append(str(exc).splitlines()[0][:300])
    assert not failures, "\n".join(failures)
    await assert_healthy(http)


async def test_previous_response_still_in_progress(slow_gateway: tuple[RunningSim, RunningGateway]) -> None:
    """Continuing from a background response that has not finished is a 409 (its output is not known yet),
    and the running response is untouched."""
    _, gw = slow_gateway
    async with httpx.AsyncClient(base_url=gw.url, timeout=REQUEST_TIMEOUT) as http:
        running = (
            await http.post(
                "/v1/responses", json={"model": MODEL, "input": "Tell me [[long]]", "background": True}
            )
        ).json()
        response = await http.post(
            "/v1/responses", json={"model": MODEL, "input": "next", "previous_response_id": running["id"]}
        )
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["param"] == "previous_response_id" and error["code"] == "previous_response_in_progress"
        cancelled = await http.post(f"/v1/responses/{running['id']}/cancel")
        assert cancelled.json()["status"] == "cancelled"
        sync = (await http.post("/v1/responses", json={"model": MODEL, "input": "hi"})).json()
        refused = await http.post(f"/v1/responses/{sync['id']}/cancel")
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"
