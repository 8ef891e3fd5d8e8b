"""`harmony-gateway render`: prints the exact Harmony prompt a saved request would send, rendered
locally or by a running gateway's POST /v1/harmony/render."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import GatewayError
from ..observability.logging import configure_logging
from ..settings import Settings
from .config import client_key


class RenderFailed(Exception):
    """The request could not be rendered; the message says why (the gateway's error message)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE", help="the saved request (JSON); - reads standard input")
    p.add_argument(
        "--api",
        default=None,
        help="the API of a bare request body (a surface the inspector renders, such as chat)",
    )
    p.add_argument("--gateway", default=None, help="ask this running gateway (http://host:port) instead")
    p.add_argument(
        "--api-key", default=None, help="the key for --gateway (default: $HARMONY_GATEWAY_API_KEY)"
    )
    p.add_argument("--json", action="store_true", help="print the whole JSON answer")
    p.add_argument(
        "--conversation-start-date", default=None, help="the date in the system message (default: today, UTC)"
    )


def run(args: argparse.Namespace) -> int:
    """Print the rendering; the exit status: 0, 1 when it cannot be rendered, 2 when FILE is unreadable."""
    configure_logging("warning")
    try:
        raw = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        payload = json.loads(raw)
    except (OSError, ValueError) as exc:
        print(f"harmony-gateway render: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    if args.api is not None:
        payload = {"api": args.api, "request": payload}
    try:
        result = asyncio.run(_render(args, payload))
    except RenderFailed as exc:
        print(f"harmony-gateway render: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2, ensure_ascii=False))
    else:
        print(format_render(result))
    return 0


async def _render(args: argparse.Namespace, payload: Any) -> dict[str, Any]:
    if args.gateway:
        return await _render_remotely(args.gateway, args.api_key, payload)
    # lazy: offline rendering builds the request pipeline (FastAPI schemas, storage, MCP)
    from .offline_render import render_offline

    settings = Settings(conversation_start_date=args.conversation_start_date, storage_url="memory://")
    try:
        return await render_offline(settings, payload)
    except (GatewayError, ValidationError, BaseExceptionGroup) as exc:
        raise RenderFailed(_render_error(exc)) from None


async def _render_remotely(gateway: str, api_key: str | None, payload: Any) -> dict[str, Any]:
    # lazy: httpx (~20 MB) only for --gateway, so a serving gateway's process never loads it
    import httpx

    key = api_key or client_key(os.environ)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.post(
                gateway.rstrip("/") + "/v1/harmony/render", json=payload, headers=headers
            )
    except httpx.HTTPError as exc:
        raise RenderFailed(f"cannot reach {gateway}: {exc}") from None
    body: dict[str, Any] = (
        response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    )
    if response.status_code != 200:
        message = (body.get("error") or {}).get("message") or response.text
        raise RenderFailed(f"{response.status_code}: {message}")
    return body


def _render_error(exc: BaseException) -> str:
    """One line for an offline rendering failure (the MCP pool's task group wraps errors in groups)."""
    # lazy: the API's error mapping imports the HTTP app's modules (FastAPI)
    from ..api.error_responses import validation_error_to_invalid

    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    if isinstance(exc, ValidationError):
        exc = validation_error_to_invalid(exc)
    if isinstance(exc, GatewayError):
        where = f" ({exc.param})" if exc.param else ""
        return f"{exc.message}{where}"
    return f"{type(exc).__name__}: {exc}"


def format_render(result: dict[str, Any]) -> str:
    """The prompt as text, then its messages, stop ids, sampling and routing, for a terminal."""
    lines = [result.get("prompt_text", ""), ""]
    lines.append(f"{result['token_count']} tokens for {result['model']} ({result['api']})")
    for m in result.get("messages", []):
        head = m["role"] + (f" ({m['channel']})" if m.get("channel") else "")
        head += f" to={m['recipient']}" if m.get("recipient") else ""
        lines.append(f"  {m['token_count']:>6}  {head}")
    lines.append(f"token ids: {result['token_ids']}")
    lines.append(f"stop token ids: {result['stop_token_ids']}")
    sampling = {k: v for k, v in result["sampling"].items() if v is not None and v != [] and v is not False}
    lines.append(f"sampling: {sampling}")
    if result.get("constraint"):
        lines.append(f"constraint ({result['constraint']['type']}): {result['constraint']['value']}")
    routing = result.get("routing") or {}
    worker = routing.get("worker")
    choice = ""
    if "worker" in routing:  # only an admin's answer names the worker
        choice = " would pick " + (f"{worker['id']} ({worker['url']})" if worker else "no worker")
    lines.append(
        f"routing: {routing.get('policy')}{choice}"
        + (
            f", cached prefix {routing['cache_match_tokens']} tokens"
            if routing.get("cache_match_tokens")
            else ""
        )
    )
    lines.extend(f"note: {note}" for note in result.get("notes", []))
    return "\n".join(lines)
