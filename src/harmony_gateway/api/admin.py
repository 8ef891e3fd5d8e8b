"""The admin plane: who may manage workers and read topology, and the optional admin listener.

| how the request arrives              | admin routes (`/workers`, and `/metrics`, `/docs` under --protect-metrics) |
|--------------------------------------|----------------------------------------------------------------------------|
| main port, `--admin-port` set        | 403 `admin_plane_elsewhere`: they are served on the admin listener only    |
| main port, no `--admin-key`          | 403 `admin_plane_disabled`: the worker API is off                          |
| main port, `--admin-key` set         | admin key → allowed; no key → 401; a tenant key (or any key on an open     |
|                                      | gateway) → 403 `permission_denied`; an unknown key → 401                   |
| admin listener, no `--admin-key`     | allowed: reaching the listener (loopback by default) is the credential      |
| admin listener, `--admin-key` set    | as on the main port with keys: the key is required there too               |

A tenant key never opens an admin route, and an admin key is not a tenant key: the two planes stay apart.
Where the tenant plane shows fleet details (the prompt inspector's worker list), it asks `is_admin`; an
admin credential opens such a route as the `ADMIN` principal, which owns no tenant's data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import Request
from starlette.responses import JSONResponse

from ..errors import AuthenticationFailed, PermissionDenied
from ..principal import presented_key
from ..settings import Settings

#: The ASGI scope key the admin listener sets on every request it accepts.
ADMIN_LISTENER_SCOPE = "harmony_gateway.admin_listener"


def admin_listener_app(app: Any) -> Any:
    """The ASGI app of the admin listener: `app` itself (one object graph, one lifespan, run by the main
    server), with each HTTP request marked as having arrived on the admin listener."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            return  # lifespan: the main server runs it
        if getattr(app.state, "gateway", None) is None:
            starting = JSONResponse(
                {
                    "error": {
                        "message": "the gateway is starting",
                        "type": "server_error",
                        "param": None,
                        "code": "starting",
                    }
                },
                status_code=503,
            )
            await starting(scope, receive, send)
            return
        await app({**scope, ADMIN_LISTENER_SCOPE: True}, receive, send)

    return asgi


def on_admin_listener(request: Request) -> bool:
    return bool(request.scope.get(ADMIN_LISTENER_SCOPE))


def require_admin(settings: Settings, request: Request) -> None:
    """Raise unless the request holds the admin credential (see the table above)."""
    admin_listener = on_admin_listener(request)
    if settings.admin_port is not None and not admin_listener:
        raise PermissionDenied(
            "the admin API is served on the admin listener only (--admin-host/--admin-port), not on this port",
            code="admin_plane_elsewhere",
        )
    if admin_listener and not settings.admin_keys:
        return
    if not settings.admin_keys:
        raise PermissionDenied(
            "the admin API is off: start the gateway with --admin-key KEY (or --admin-port PORT for a "
            "separate admin listener) to manage workers",
            code="admin_plane_disabled",
        )
    token = presented_key(request.headers)
    if token and token in settings.admin_keys:
        return
    if not token:
        raise AuthenticationFailed(
            "this route needs the admin key: send 'Authorization: Bearer <admin key>'",
            code="missing_admin_key",
        )
    if token in settings.api_keys or not settings.api_keys:
        raise PermissionDenied("this key may not use the admin API; it needs an --admin-key key")
    raise AuthenticationFailed("Incorrect admin key: send 'Authorization: Bearer <admin key>'")


def is_admin(settings: Settings, request: Request) -> bool:
    """Whether the request holds the admin credential: `require_admin` would let it through."""
    try:
        require_admin(settings, request)
    except (AuthenticationFailed, PermissionDenied):
        return False
    return True


class _AdminServer(uvicorn.Server):
    """The admin listener's server: the main server owns the signals and the lifespan."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def admin_server(app: Any, host: str, port: int, log_level: str = "info") -> uvicorn.Server:
    """A uvicorn server for the admin listener in front of `app`; serve it once `app` has started."""
    config = uvicorn.Config(
        admin_listener_app(app),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        log_config=None,
        proxy_headers=False,  # the admin plane believes no forwarded client address
    )
    return _AdminServer(config)
