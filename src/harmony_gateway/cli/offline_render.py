"""Offline rendering for `harmony-gateway render`: the prompt inspector's `render_request` run against a
gateway state built in process, with no engine, no workers and an in-memory store. It builds what the
app builds, so it belongs to the command line, above the app."""

from __future__ import annotations

from typing import Any

from ..api.inspect import render_request
from ..app import build_state
from ..engines.base import ModelInfo
from ..errors import InvalidRequest
from ..pipeline.context import RequestContext
from ..routing.fleet import ModelGroup
from ..routing.registry import create_policy
from ..settings import Settings


async def render_offline(settings: Settings, payload: Any) -> dict[str, Any]:
    """`render_request` without a running gateway or engine, on a state built from `settings` (in-memory
    storage, say) and never served: the request's model is taken as a Harmony
    model with no workers (routing names none) and an unknown context length; stored responses and
    conversations are not available. MCP tools naming a `server_url` are refused, as by the route."""
    if not isinstance(payload, dict):
        raise InvalidRequest('the file must hold a JSON object: {"api": ..., "request": {...}}')
    request = payload.get("request")
    model = request.get("model") if isinstance(request, dict) else None
    if not isinstance(model, str) or not model:
        raise InvalidRequest("the request must name its model", param="request.model")
    state = build_state(settings)
    policy = settings.model_policies.get(model, settings.policy)
    state.fleet.groups[model] = ModelGroup(
        name=model,
        harmony=True,
        info=ModelInfo(served_model_name=model),
        policy=create_policy(policy, **settings.policy_options(policy)),
        prefill_policy=None,
        decode_policy=None,
    )
    await state.store.start()
    try:
        async with state.mcp:
            ctx = RequestContext(request_id="render", route="harmony_render")
            # The operator at a terminal is the admin; offline there are no workers to show anyway.
            result = await render_request(state, payload.get("api"), request, ctx, fleet=True)
    finally:
        await state.tasks.aclose()
        await state.store.close()
    result["notes"].append("rendered offline: no engine was asked, so no worker and no context length")
    return result
