"""Logging set-up: plain text or one JSON object per line (`--log-json`), the per-request line, and the
one line an unexpected failure gets (`log_failure`).

Every request but the probes and the playground's files gets exactly one line on
`harmony_gateway.requests` (and one count in `gateway_requests_total`), whatever its status: its
status, the model it asked for, the id of its key (never the key), tokens and latency. A client that
leaves before its answer ended is logged with `CLIENT_CLOSED`."""

from __future__ import annotations

import logging
import sys
import time

import orjson

from .observed import ObservedRequest

request_log = logging.getLogger("harmony_gateway.requests")

#: The status a request is logged and counted with when its client left before the answer ended
#: (nginx's "client closed request"); the client never sees it.
CLIENT_CLOSED = 499
#: Characters of the model a request asked for that its log line keeps (clients choose that text).
MAX_LOGGED_MODEL_CHARS = 256


def requested_model(body: object) -> str:
    """The `model` a request body names ("" when it names none), cut to MAX_LOGGED_MODEL_CHARS."""
    model = body.get("model") if isinstance(body, dict) else None
    return model[:MAX_LOGGED_MODEL_CHARS] if isinstance(model, str) else ""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if extra:
            payload.update(extra)
        if record.exc_info:
            payload["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(payload, default=str).decode()


def configure_logging(level: str = "info", json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "grpc", "mcp", "sqlalchemy.engine"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def log_request(ctx: ObservedRequest) -> None:
    """One line per request: id, route, model (the one served, else the one asked for), key id, worker,
    status, tokens, latency (no prompt text)."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    latency_ms = (time.perf_counter() - ctx.started) * 1000
    principal = ctx.principal
    model = ctx.model or ctx.requested_model
    fields = {
        "request_id": ctx.request_id,
        "route": ctx.route,
        "model": model,
        "key_id": principal.key_id,
        "tenant": principal.tenant_name,
        "worker": ctx.worker.public_url if ctx.worker is not None else None,
        "worker_id": ctx.worker.id if ctx.worker is not None else None,
        "status": ctx.status,
        "prompt_tokens": ctx.prompt_tokens,
        "completion_tokens": ctx.completion_tokens,
        "retries": ctx.retries,
        "latency_ms": round(latency_ms, 2),
        **ctx.log_extra,
    }
    if ctx.prefill_worker is not None:
        fields["prefill_worker"] = ctx.prefill_worker.public_url
    if ctx.first_token_at is not None:
        fields["ttft_ms"] = round((ctx.first_token_at - ctx.started) * 1000, 2)
    request_log.info(
        "%s %s model=%s key=%s worker=%s status=%s tokens=%s/%s %.1fms",
        ctx.request_id,
        ctx.route,
        model,
        principal.key_id or "-",
        fields["worker"],
        ctx.status,
        ctx.prompt_tokens,
        ctx.completion_tokens,
        latency_ms,
        extra={"fields": fields},
    )


#: Characters of an exception's message a failure line keeps (messages may quote a whole request field).
FAILURE_MESSAGE_CHARS = 300


def log_failure(logger: logging.Logger, what: str, exc: BaseException) -> None:
    """One error line for an unexpected failure: what failed (with its request or response id), the
    exception's type and its message, cut to FAILURE_MESSAGE_CHARS; the traceback only at debug level,
    so a failing dependency cannot flood the log."""
    message = str(exc).replace("\n", "\\n")  # one line, whatever the exception says
    if len(message) > FAILURE_MESSAGE_CHARS:
        message = message[:FAILURE_MESSAGE_CHARS] + "…"
    logger.error("%s failed: %s: %s", what, type(exc).__name__, message)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("traceback of the failure of %s", what, exc_info=exc)
