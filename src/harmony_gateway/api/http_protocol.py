"""uvicorn's httptools protocol with the limits it lacks: a deadline for the request head and bounds on
its headers.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a connection that never
finishes its request head (a slowloris client, one header byte a second, or a socket opened and left
silent) is held forever, and httptools accepts headers of any size and number. Here:

- the head of a request (request line and headers) must arrive within `header_timeout` seconds of the
  connection opening, or of its first byte on a kept-alive connection (between requests uvicorn's
  keep-alive timeout closes an idle connection); past that the gateway answers 408, as nginx's
  `client_header_timeout` does, and closes the connection;
- more than `max_header_bytes` of header names and values, or more than `max_headers` headers, is
  answered 431 and the connection closed.

Both answers are OpenAI error objects. The class is built per configuration by `guarded_protocol`.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ..settings import Settings

DEFAULT_HEADER_TIMEOUT = 10.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADERS = 128

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0
        self._refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # answered and closing: nothing more is parsed
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        if not self._refused:  # a header refusal stops the parser, which reports it as a parse error
            super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self.max_header_bytes or len(self.headers) >= self.max_headers:
            self._refuse(
                431,
                f"the request headers exceed this gateway's limits ({self.max_headers} headers, "
                f"{self.max_header_bytes} bytes)",
                "request_header_fields_too_large",
            )
            raise ValueError("request headers too large")  # stops httptools' parse of this request
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served: its head arrived
        self._refuse(
            408,
            f"the request head did not arrive within {self.header_timeout:g} s",
            "request_timeout",
        )

    def _refuse(self, status: int, message: str, code: str) -> None:
        self._refused = True
        self._disarm_head_timer()
        if self.transport.is_closing():
            return
        body = orjson.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        )
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status])
        self.transport.write(
            head
            + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()


def server_options(settings: Settings, *, processes: int = 1) -> dict[str, Any]:
    """The uvicorn options every way of serving the gateway uses (`serve`, `serve --workers N`, tests).

    Several processes get the module's own class, which pickles by name into them (a class built per
    configuration does not); each process sets its limits with `configure_shared_protocol`."""
    if processes > 1:
        configure_shared_protocol(settings)
        http: type[HttpToolsProtocol] = GuardedHttpToolsProtocol
    else:
        http = guarded_protocol(
            header_timeout=settings.header_timeout,
            max_header_bytes=settings.max_header_bytes,
            max_headers=settings.max_headers,
        )
    return {
        "http": http,
        # The Responses API's WebSocket mode (api/responses_socket.py) on websockets' sans-I/O protocol,
        # the one uvicorn implementation that is not deprecated; an HTTP request pays nothing for it
        # (httptools flags an upgrade itself). A message over the limit closes the socket (1009) from its
        # frame header, before its payload is buffered. No per-message compression: the events are
        # small and many, and deflating each one costs the gateway's CPU for little on the wire (the
        # official SDK does not ask for it either).
        "ws": "websockets-sansio",
        "ws_max_size": settings.ws_max_message_bytes,
        "ws_per_message_deflate": False,
        "timeout_keep_alive": settings.keep_alive_timeout,
        "limit_concurrency": settings.max_connections,
        # Forwarded headers only from the configured proxies; uvicorn would trust 127.0.0.1 by default.
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": list(settings.forwarded_allow_ips) or None,
        # HTTPS when both are set (cli/checks.py refuses one without the other).
        "ssl_certfile": settings.ssl_certfile,
        "ssl_keyfile": settings.ssl_keyfile,
    }


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to the hard limit (often 1024 → 1M): every idle
    socket holds one, and a low soft limit lets a few thousand of them refuse real requests. Returns
    the limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


class GuardedHttpToolsProtocol(_GuardedHttpToolsProtocol):
    """The class `serve --workers N` hands its processes; `configure_shared_protocol` sets its limits."""


def configure_shared_protocol(settings: Settings) -> None:
    GuardedHttpToolsProtocol.header_timeout = settings.header_timeout
    GuardedHttpToolsProtocol.max_header_bytes = settings.max_header_bytes
    GuardedHttpToolsProtocol.max_headers = settings.max_headers


def guarded_protocol(
    *,
    header_timeout: float = DEFAULT_HEADER_TIMEOUT,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
    max_headers: int = DEFAULT_MAX_HEADERS,
) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with these limits."""
    return type(
        "GuardedHttpToolsProtocol",
        (_GuardedHttpToolsProtocol,),
        {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes, "max_headers": max_headers},
    )


__all__ = [
    "DEFAULT_HEADER_TIMEOUT",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_HEADER_BYTES",
    "GuardedHttpToolsProtocol",
    "configure_shared_protocol",
    "guarded_protocol",
    "raise_open_file_limit",
    "server_options",
]
