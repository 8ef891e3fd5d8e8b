"""The I/O `serve` does before it serves: the storage opened once (reachable, its tables in place), the
DNS resolver configured, the listening sockets bound, so that a database that does not answer or a port
in use is one line (`StartupError`) before anything starts. And the lines that say what started: the
routing, the traffic limits, the keys and the address the gateway listens on."""

from __future__ import annotations

import contextlib
import errno
import socket

import anyio

from ..settings import Settings
from ..storage import default_storage_url, open_store
from .checks import StartupError, redact

#: Seconds the storage has to open at start-up (connect, create or migrate its tables).
STORAGE_CHECK_TIMEOUT = 15.0


async def check_storage(settings: Settings, timeout: float = STORAGE_CHECK_TIMEOUT) -> None:
    """Open the storage once and close it: raises StartupError naming `--storage` (its password
    hidden) when it cannot be opened within `timeout` seconds. Opening creates or migrates its tables,
    which the gateway's own opening then finds in place."""
    url = settings.storage_url or default_storage_url()
    shown = f"--storage {redact(url)}" if settings.storage_url else f"the default storage {url}"
    try:
        store = open_store(url, schema=settings.storage_schema, retention_seconds=settings.storage_retention)
    except ValueError as exc:
        raise StartupError(f"{shown}: {exc}", "storage") from None
    try:
        with anyio.fail_after(timeout):
            await store.start()
    except TimeoutError:
        raise StartupError(f"{shown}: no answer within {timeout:g} s", "storage") from None
    except Exception as exc:  # whatever the driver raises: the reason goes on the line
        raise StartupError(f"{shown}: cannot open it: {_reason(exc)}", "storage") from None
    finally:
        with contextlib.suppress(Exception):
            await store.close()


def check_resolver(settings: Settings) -> None:
    """`--worker-dns` without `--worker-dns-server` needs the system's nameservers: raises
    StartupError when /etc/resolv.conf names none."""
    if not settings.worker_dns or settings.worker_dns_server is not None:
        return
    from ..routing.dns_resolver import DnsResolver  # lazy: dnspython only with --worker-dns

    try:
        DnsResolver(None, settings.worker_dns_timeout)
    except ValueError as exc:
        raise StartupError(str(exc), "worker_dns") from None


def bind_listener(host: str, port: int, port_dest: str = "port", host_dest: str = "host") -> socket.socket:
    """A TCP socket bound to `host:port` (not listening yet: the server listens once it has started),
    inheritable by `serve --workers N`'s processes. Raises StartupError naming the option to blame."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        port_flag, host_flag = "--" + port_dest.replace("_", "-"), "--" + host_dest.replace("_", "-")
        if isinstance(exc, socket.gaierror):
            raise StartupError(f"{host_flag} {host}: cannot resolve it ({exc.strerror})", host_dest) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise StartupError(f"{host_flag} {host}: not an address of this machine", host_dest) from None
        if exc.errno == errno.EADDRINUSE:
            reason = "the port is in use (another process listens on it)"
        elif exc.errno == errno.EACCES:
            reason = "permission denied (ports below 1024 need privileges)"
        else:
            reason = exc.strerror or str(exc)
        raise StartupError(
            f"{port_flag} {port}: cannot listen on {_address(host, port)}: {reason}", port_dest
        ) from None
    sock.set_inheritable(True)
    return sock


def listen_url(settings: Settings, sock: socket.socket) -> str:
    """The gateway's base URL on `sock` (its real port when `--port 0` let the system choose)."""
    scheme = "https" if settings.ssl_certfile else "http"
    return f"{scheme}://{_address(settings.host, sock.getsockname()[1])}"


def started_lines(settings: Settings, url: str, admin_url: str | None = None) -> list[str]:
    """What the gateway runs with, once it listens: routing, traffic limits, keys, the address. (The
    lifespan says the storage, and the fleet one line per worker as it joins.)"""
    lines = [_routing_line(settings), _traffic_line(settings)]
    if settings.api_keys:  # without keys, the app's own warning says so
        lines.append(_keys_line(settings))
    return [*lines, _listen_line(url, admin_url)]


def _routing_line(settings: Settings) -> str:
    parts = [f"routing: policy {settings.policy}"]
    if settings.policy in ("cache_aware", "kv_aware"):
        parts.append(
            f"(balance above {settings.balance_abs_threshold} requests and {settings.balance_rel_threshold:g}x"
            + (
                f", cache threshold {settings.cache_threshold:g})"
                if settings.policy == "cache_aware"
                else ")"
            )
        )
    roles = [
        f"{role} {name}"
        for role, name in (("prefill", settings.prefill_policy), ("decode", settings.decode_policy))
        if name
    ]
    roles += [f"{model}: {name}" for model, name in settings.model_policies.items()]
    if roles:
        parts.append(f"[{', '.join(roles)}]")
    parts.append(f"; {settings.max_retries} retries before the first token")
    parts.append(f"; health every {settings.health_interval:g} s")
    if settings.served_model_name:
        parts.append(f"; served as {settings.served_model_name!r}")
    return " ".join(parts).replace(" ;", ";")


def _traffic_line(settings: Settings) -> str:
    parts: list[str] = []
    if settings.max_concurrent_requests:
        parts.append(
            f"at most {settings.max_concurrent_requests} requests at once, {settings.queue_size} waiting up "
            f"to {settings.queue_timeout:g} s"
        )
    budgets = [
        f"{n} {unit}/min"
        for n, unit in ((settings.rate_limit, "requests"), (settings.token_rate_limit, "tokens"))
        if n
    ]
    if budgets:
        where = f" in {redact(settings.rate_limit_store)}" if settings.rate_limit_store else ""
        parts.append(f"{' and '.join(budgets)} per key or address{where}")
    if not parts:
        parts.append("no admission cap, no rate limits")
    parts.append(f"bodies up to {_size(settings.max_body_bytes)}")
    if settings.max_connections:
        parts.append(f"{settings.max_connections} connections")
    return "traffic: " + "; ".join(parts)


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _keys_line(settings: Settings) -> str:
    line = f"auth: {len(settings.api_keys)} API keys"
    if settings.api_key_file:
        line += f" ({settings.api_key_file} read again when it changes and on SIGHUP)"
    if settings.admin_keys or settings.admin_port is not None:
        line += "; admin plane on" + (
            f" {settings.admin_host}:{settings.admin_port}" if settings.admin_port is not None else ""
        )
    return line


def _listen_line(url: str, admin_url: str | None) -> str:
    return f"listening on {url}" + (f" (admin listener {admin_url})" if admin_url else "")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: BaseException) -> str:
    """The driver's own reason, in one line: SQLAlchemy wraps it (`orig`), asyncpg may group several."""
    inner = getattr(exc, "orig", None) or exc.__cause__ or exc
    text = str(inner).strip() or type(inner).__name__
    return " ".join(text.splitlines()[0].split())
