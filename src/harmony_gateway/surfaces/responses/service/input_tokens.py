"""`POST /v1/responses/input_tokens`: the length of the Harmony prompt a `POST /v1/responses` with the
same fields would send, counted by preparing that request (`plan.prepare_responses`: the same chain or
conversation, the same items, tools and instructions, the same renderer), so it equals the
`usage.input_tokens` the engine then reports for a response of one generation.

Preparing it lists the request's MCP tools, as the response would (their namespaces are part of the
prompt); the connections it opens are closed before the count is answered. Approved MCP calls in the
input are not run: their results count as empty.
"""

from __future__ import annotations

from typing import Any

from ....pipeline.context import GatewayState, RequestContext
from ..plan import prepare_responses, render_turn
from ..types import InputTokensRequest, ResponsesRequest
from .compact import requested_model


async def count_input_tokens(
    state: GatewayState, req: InputTokensRequest, ctx: RequestContext
) -> dict[str, Any]:
    """OpenAI's token counts object for `req`."""
    # Only the body's own fields: an unknown one (`stream`, `background`) must not change the count.
    unknown = set(req.model_extra or ())
    fields = req.model_dump(exclude_none=True, exclude={"model", "input", *unknown})
    request = ResponsesRequest(
        **fields,
        model=requested_model(state, req.model),
        input=req.input if req.input is not None else "",
        store=False,
    )
    plan = await prepare_responses(state, request, ctx)
    try:
        if plan.approvals:  # rendered once the approved calls ran; here their results are empty
            await render_turn(state, plan)
        return {"object": "response.input_tokens", "input_tokens": len(plan.prepared.input_ids)}
    finally:
        await plan.close_tools()


__all__ = ["count_input_tokens"]
