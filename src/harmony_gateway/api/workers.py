"""Worker management and metrics endpoints: `GET/POST /workers`, `DELETE /workers/{id}`, `GET /metrics`.

`POST /workers` registers a worker and probes it (model info, health) before answering, so the worker takes
traffic as soon as the 201 arrives if it was healthy; an unreachable worker is still registered (healthy
false) and the health checker keeps probing it. Under `serve --workers N` (N > 1) the processes share
the registered workers through storage (routing/shared_registry.py): a change answered by one process
reaches the others within about a second. The worker endpoints are the admin plane (api/admin.py): they
need the admin credential, and a registered URL must pass the worker host policy (routing/url_policy.py:
never a link-local or metadata address; only listed hosts under `--worker-allow-hosts`).
`/metrics` is open, for Prometheus, unless `--protect-metrics` puts it behind the admin credential too.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..errors import InvalidRequest
from ..netguard import HostAllowList
from ..routing.shared_registry import publish_worker, remove_worker, sync_workers
from ..routing.url_policy import check_worker_url
from ..routing.workers import WorkerKind
from .admin import require_admin
from .routes import gateway, json_body, json_response

router = APIRouter()

_KINDS = ", ".join(k.value for k in WorkerKind)


def _field(body: dict[str, Any], name: str, default: str | None = None) -> str | None:
    value = body.get(name, default)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{name}' must be a string", param=name)
    return value


@router.get("/workers")
async def list_workers(request: Request) -> Response:
    state = gateway(request)
    require_admin(state.settings, request)
    await sync_workers(state.fleet)
    return json_response({"object": "list", "data": [w.to_dict() for w in state.fleet.all_workers()]})


@router.post("/workers")
async def create_worker(request: Request) -> Response:
    state = gateway(request)
    require_admin(state.settings, request)
    body = await json_body(request)
    url = _field(body, "url")
    if not url:
        raise InvalidRequest("'url' is required, e.g. grpc://host:port", param="url")
    allow = HostAllowList(state.settings.worker_allow_hosts)
    await check_worker_url(url, allow)
    kind_name = _field(body, "kind", WorkerKind.REGULAR.value)
    try:
        kind = WorkerKind(kind_name or "")  # null is an unknown kind too
    except ValueError:
        raise InvalidRequest(
            f"unknown worker kind {kind_name!r}; expected one of {_KINDS}", param="kind"
        ) from None
    engine = _field(body, "engine")
    worker = await state.fleet.admit(url, kind, engine)
    await publish_worker(state.fleet, worker)
    return json_response(worker.to_dict(), status=201)


@router.delete("/workers/{worker_id}")
async def delete_worker(worker_id: str, request: Request) -> Response:
    state = gateway(request)
    require_admin(state.settings, request)
    worker = await remove_worker(state.fleet, worker_id)
    return json_response({"id": worker.id, "object": "worker", "deleted": True})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = gateway(request)
    if state.settings.protect_metrics:
        require_admin(state.settings, request)
    if state.metrics is None:
        return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)
