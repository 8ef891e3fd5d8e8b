"""Raw-prompt routes: SGLang's native `POST /generate` and OpenAI's legacy `POST /v1/completions`.

Thin handlers like `api/routes.py`: errors are the app's OpenAI-shaped errors (SGLang clients read the
status and `error.message`); mid-stream errors are a `data: {"error": ...}` frame, then `[DONE]`.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..surfaces.completions.run import plan_completions
from ..surfaces.completions.types import CompletionRequest
from ..surfaces.generate.run import plan_generate
from ..surfaces.generate.types import GenerateRequest
from ..wire import OPENAI
from .routes import serve_pipeline

router = APIRouter()


@router.post("/generate")
async def generate(request: Request) -> Response:
    return await serve_pipeline(
        request, "generate", GenerateRequest, plan_generate, ("text", "input_ids"), wire=OPENAI
    )


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await serve_pipeline(
        request, "completions", CompletionRequest, plan_completions, ("prompt",), wire=OPENAI
    )
