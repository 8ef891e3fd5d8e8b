"""Helpers for the multi-worker e2e tests: several simulated engines and raw HTTP chat calls."""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine
from tests.conftest import MODEL
from tests.support.servers import RunningGateway, client_request_id, wait_until

_ids = itertools.count()


@contextlib.asynccontextmanager
async def sims(*configs: SimConfig) -> AsyncIterator[list[RunningSim]]:
    started: list[RunningSim] = []
    try:
        for config in configs:
            started.append(await start_sim_engine(config))
        yield started
    finally:
        for sim in started:
            await sim.stop()


async def all_workers_up(gateway: RunningGateway) -> None:
    """Wait until every configured worker takes traffic: a gateway is ready once one does, and a test
    about how requests spread over several must not start while the others' first probes are pending."""
    await wait_until(lambda: all(w.available() for w in gateway.state.fleet.all_workers()))


def next_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"


async def chat(
    http: httpx.AsyncClient,
    text: str = "What is 2+2?",
    *,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
    stream: bool = False,
    **body: Any,
) -> httpx.Response:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream, **body}
    hdrs = {"x-request-id": request_id or next_request_id(), **(headers or {})}
    return await http.post("/v1/chat/completions", json=payload, headers=hdrs)


def served_by(request_id: str, engines: Sequence[RunningSim]) -> list[int]:
    """Indexes of the engines that received `request_id`."""
    return [
        i
        for i, sim in enumerate(engines)
        if any(client_request_id(r.request_id) == request_id for r in sim.requests)
    ]


def answer_text(response: httpx.Response) -> str:
    """The assistant content of a chat response, streamed (SSE) or not."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return str(response.json()["choices"][0]["message"]["content"])
    parts = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                parts.append(choice["delta"].get("content") or "")
    return "".join(parts)
