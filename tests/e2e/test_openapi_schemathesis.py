"""Schemathesis against the gateway's own OpenAPI document, on a running gateway and the simulated engine.

Every operation in /openapi.json gets a fixed number of generated requests (derandomized, so each run sends
the same ones). The checks: no 5xx, the status code is one the spec lists, and the body and content type
match what it documents. The spec is read the way a client would (with the admin key, since
--protect-metrics is on), so the request bodies it describes are the ones exercised.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from harmony_gateway.settings import Timeouts
from harmony_gateway.sim import SimConfig
from tests.conftest import MODEL
from tests.e2e._fleet import sims
from tests.support.servers import running_gateway
from tests.support.servers import test_settings as gateway_settings

TENANT, ADMIN = "sk-tenant", "sk-admin"
MAX_EXAMPLES = 6
#: The whole run's budget; it takes about a third of it on an idle machine.
BUDGET_SECONDS = 60.0
ADMIN_PATHS = ("/workers", "/metrics")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def fuzz_operations(base_url: str, spec: dict[str, Any]) -> list[str]:
    """Run every operation's cases; returns the operations exercised."""
    schema = schemathesis.openapi.from_dict(spec)
    exercised: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        admin = operation.path.startswith(ADMIN_PATHS)
        fuzz_operation(base_url, operation, {"authorization": f"Bearer {ADMIN if admin else TENANT}"})
        exercised.append(f"{operation.method.upper()} {operation.path}")
    return exercised


def fuzz_operation(base_url: str, operation: Any, auth: dict[str, str]) -> None:
    strategy = operation.as_strategy(generation_mode=GenerationMode.POSITIVE) | operation.as_strategy(
        generation_mode=GenerationMode.NEGATIVE
    )

    @given(case=strategy)
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case) -> None:
        case.headers = {**(case.headers or {}), **auth}
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # The served model, so generated requests reach the engine instead of ending in a 404.
            case.body["model"] = MODEL
        response = case.call(base_url=base_url, timeout=30)
        case.validate_response(response, checks=CHECKS)

    run()


async def test_generated_requests_match_the_openapi_spec() -> None:
    async with sims(SimConfig(tokens_per_second=None, output_tokens=8)) as (engine,):
        gateway = gateway_settings(
            worker_urls=(engine.url,),
            api_keys=frozenset({TENANT}),
            admin_keys=frozenset({ADMIN}),
            protect_metrics=True,
            timeouts=Timeouts(connect=1.0, first_token=10.0, total=20.0),
        )
        async with running_gateway(gateway) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as http:
                r = await http.get("/openapi.json", headers={"authorization": f"Bearer {ADMIN}"})
                assert r.status_code == 200
                spec = r.json()
            chat = spec["paths"]["/v1/chat/completions"]["post"]
            assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ChatCompletionRequest"
            )
            assert {"400", "401", "403", "404", "413", "429", "502", "503"} <= set(chat["responses"])
            started = time.monotonic()
            # Schemathesis calls are blocking: off the loop, which serves the gateway and the engine.
            exercised = await asyncio.wait_for(
                asyncio.to_thread(fuzz_operations, gw.url, spec), BUDGET_SECONDS
            )
            elapsed = time.monotonic() - started
    assert "POST /v1/chat/completions" in exercised and "POST /workers" in exercised
    assert len(exercised) == sum(len(ops) for ops in spec["paths"].values())
    assert elapsed < BUDGET_SECONDS
