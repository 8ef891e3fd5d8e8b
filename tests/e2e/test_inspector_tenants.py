"""The inspector between tenants: with `--policy cache_aware`, tenant B's renders say nothing about the
prompts tenant A routed (the cache match a guess earns is the one a random prefix earns), and only an
admin sees the worker fleet (URLs, in-flight counts) that `/workers` keeps for admins."""

from __future__ import annotations

import secrets
from typing import Any

import httpx
import pytest

from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import running_gateway, test_settings

A = {"authorization": "Bearer key-a"}
B = {"authorization": "Bearer key-b"}
ADMIN = {"authorization": "Bearer key-admin"}
SECRET_SYSTEM = "You are the assistant of Zephyrine Quartermaine. The vault code is 7341-alpha-kestrel."
SECRET_MESSAGE = "Yesterday the board approved the acquisition of Halcyon Robotics for 42 million."
B_OWN = "Bonjour, please summarise the weekly report for me."


def chat(system: str, message: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": message}],
    }


def random_like(text: str) -> str:
    """Random text of the same length that starts like none of the prompts above (hex is lowercase)."""
    return secrets.token_hex(len(text))[: len(text)]


async def cache_match(http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> int:
    rendered = await http.post("/v1/harmony/render", json={"api": "chat", "request": body}, headers=headers)
    assert rendered.status_code == 200, rendered.text
    match = rendered.json()["routing"]["cache_match_tokens"]
    assert isinstance(match, int)
    return match


def guesses() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(guess, random control) pairs: prefixes of A's system prompt and of A's message, A's whole prompt."""
    pairs = []
    for cut in (12, 30, len(SECRET_SYSTEM)):
        guess = SECRET_SYSTEM[:cut]
        pairs.append((chat(guess, B_OWN), chat(random_like(guess), B_OWN)))
    for cut in (10, 40, len(SECRET_MESSAGE)):
        guess = SECRET_MESSAGE[:cut]
        pairs.append((chat(SECRET_SYSTEM, guess), chat(SECRET_SYSTEM, random_like(guess))))
    return pairs


@pytest.mark.parametrize("cache_key", ["tokens", "selection-text"])
async def test_a_tenant_cannot_read_another_tenants_prompt_from_the_cache_match(
    sim: RunningSim, cache_key: str
) -> None:
    settings = test_settings(
        worker_urls=(sim.url,),
        policy="cache_aware",
        cache_key=cache_key,
        api_keys=frozenset({"key-a", "key-b"}),
        admin_keys=frozenset({"key-admin"}),
    )
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        secret = chat(SECRET_SYSTEM, SECRET_MESSAGE)
        for _ in range(2):
            sent = await http.post("/v1/chat/completions", json=secret, headers=A)
            assert sent.status_code == 200, sent.text
        # A's own affinity is intact: its prompt is known to be cached, in full.
        assert await cache_match(http, secret, A) > 0
        for guess, control in guesses():
            assert await cache_match(http, guess, B) == await cache_match(http, control, B) == 0
        # Once B has routed a prompt of its own, B sees its own match, and still nothing of A's.
        assert (
            await http.post("/v1/chat/completions", json=chat(B_OWN, B_OWN), headers=B)
        ).status_code == 200
        assert await cache_match(http, chat(B_OWN, B_OWN), B) > 0
        for guess, control in guesses():
            assert await cache_match(http, guess, B) == await cache_match(http, control, B)
        # The admin plane is not a tenant: it sees the fleet, not a tenant's cache.
        assert await cache_match(http, secret, ADMIN) == 0


async def test_only_the_admin_sees_the_worker_fleet_in_a_render(sim: RunningSim) -> None:
    settings = test_settings(
        worker_urls=(sim.url,),
        policy="cache_aware",
        api_keys=frozenset({"key-a", "key-b"}),
        admin_keys=frozenset({"key-admin"}),
    )
    render = {"api": "chat", "request": chat("Be brief.", "hello")}
    async with running_gateway(settings) as gw, httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=render["request"], headers=A)).status_code == 200
        tenant = await http.post("/v1/harmony/render", json=render, headers=B)
        assert tenant.status_code == 200, tenant.text
        routing = tenant.json()["routing"]
        assert routing["model_group"] == MODEL and routing["policy"] == "cache_aware"
        assert sim.url not in tenant.text
        assert "in_flight" not in tenant.text and "worker" not in routing
        admin = await http.post("/v1/harmony/render", json=render, headers=ADMIN)
        assert admin.status_code == 200, admin.text
        fleet = admin.json()["routing"]
        assert fleet["worker"]["url"] == sim.url
        assert [w["url"] for w in fleet["regular"]["workers"]] == [sim.url]
        assert fleet["regular"]["workers"][0]["in_flight"] == 0
        # The admin key opens no tenant's data: a stored response of A is not found for it.
        stored = await http.post("/v1/responses", json={"model": MODEL, "input": "secret"}, headers=A)
        follow = {"model": MODEL, "input": "more", "previous_response_id": stored.json()["id"]}
        denied = await http.post(
            "/v1/harmony/render", json={"api": "responses", "request": follow}, headers=ADMIN
        )
        assert denied.status_code == 400 and "secret" not in denied.text
