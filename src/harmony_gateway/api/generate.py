"""Raw-prompt routes: SGLang's native `POST /generate` and OpenAI's legacy `POST /v1/completions`.

Thin handlers like `api/routes.py`: errors are the app's OpenAI-shaped errors (SGLang clients read the
status and `error.message`); mid-stream errors are a `data: {"error": ...}` frame, then `[DONE]`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..observability.metrics import finish_request
from ..pipeline.generate import run_completions, run_generate
from .routes import gateway, json_body, json_response, new_context, run_logged, sse_response
from .schemas.generate import CompletionRequest, GenerateRequest

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = gateway(request)
    ctx = new_context(request, "generate", state)
    raw = await json_body(request)
    if state.settings.log_prompts:
        ctx.log_extra["prompt"] = raw.get("text") if raw.get("text") is not None else raw.get("input_ids")
    body = GenerateRequest.model_validate(raw)
    result = await run_logged(ctx, run_generate(state, body, ctx))
    if isinstance(result, (dict, list)):
        finish_request(ctx)
        return json_response(result, ctx)
    return sse_response(result, ctx)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = gateway(request)
    ctx = new_context(request, "completions", state)
    raw = await json_body(request)
    if state.settings.log_prompts:
        ctx.log_extra["prompt"] = raw.get("prompt")
    body = CompletionRequest.model_validate(raw)
    result = await run_logged(ctx, run_completions(state, body, ctx))
    if isinstance(result, dict):
        finish_request(ctx)
        return json_response(result, ctx)
    return sse_response(result, ctx)
