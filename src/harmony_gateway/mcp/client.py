"""One connection to one MCP server, over streamable HTTP (falling back to SSE), SSE or stdio, using the
official `mcp` SDK client.

Each `McpConnection` runs in its own task, spawned into a task group the caller owns (the `McpPool`'s,
which lives in the app lifespan): the SDK's transports are anyio context managers that must be entered and
left by one task, while the requests that list and call tools run in other tasks. `open()` waits for the
MCP handshake and raises `McpServerUnavailable` (HTTP 424, as OpenAI answers an unreachable MCP server)
when it fails or takes longer than the connect timeout; `close()` ends the task and waits for it.

Errors:

    McpServerUnavailable (GatewayError, 424)  connect, handshake or tool listing failed: fails the request
    McpToolFailed (Exception)                 one tool call failed (transport error, protocol error,
                                              timeout): recoverable, shown to the model as the call's error

A failed call's `error` takes the shape the openai SDK types (`McpToolCallError`):
`{"type": "mcp_protocol_error", "code", "message"}` (a JSON-RPC error), `{"type": "http_error", "code",
"message"}` (transport failures and timeouts, with an HTTP-like status: 502, 504) or
`{"type": "mcp_tool_execution_error", "content": [...]}` (the tool itself reported an error).

Headers (authorization included) and stdio environments are never logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio

from ..errors import GatewayError
from ..observability.tracing import traced
from .config import ServerConfig

log = logging.getLogger(__name__)

Spawn = Callable[..., Any]
MAX_TOOL_PAGES = 20


class McpServerUnavailable(
    GatewayError, status_code=424, error_type="external_connector_error", code="mcp_server_unavailable"
):
    """Raised when an MCP server cannot be connected to or its tools cannot be listed (before generation)."""


class McpToolFailed(Exception):
    """Raised when one tool call fails; recoverable: the error becomes the call's output for the model.

    `broken` is True when the connection itself is gone (the pool reconnects on its next use)."""

    def __init__(
        self, message: str, *, broken: bool = False, error_type: str = "http_error", code: int = 502
    ) -> None:
        super().__init__(message)
        self.message = message
        self.broken = broken
        self.error_type = error_type
        self.code = code

    @property
    def timed_out(self) -> bool:
        return self.error_type == "http_error" and self.code == 504

    def to_error(self) -> dict[str, Any]:
        return {"type": self.error_type, "code": self.code, "message": self.message}


@dataclass(frozen=True, slots=True)
class McpTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None

    @property
    def read_only(self) -> bool:
        return bool((self.annotations or {}).get("readOnlyHint"))

    def to_item(self) -> dict[str, Any]:
        """The tool as listed in an `mcp_list_tools` output item."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "annotations": self.annotations,
        }

    @classmethod
    def from_item(cls, data: dict[str, Any]) -> McpTool:
        return cls(
            name=str(data.get("name") or ""),
            description=str(data.get("description") or ""),
            input_schema=data.get("input_schema") or {"type": "object", "properties": {}},
            annotations=data.get("annotations"),
        )


@dataclass(frozen=True, slots=True)
class ToolResult:
    text: str
    is_error: bool = False
    #: The result's content blocks as JSON (for `mcp_tool_execution_error.content`).
    content: tuple[dict[str, Any], ...] = ()


def result_text(result: Any) -> str:
    """Text of a CallToolResult: text blocks joined by newlines; structured content when there is no text."""
    pieces: list[str] = []
    for block in getattr(result, "content", None) or ():
        kind = getattr(block, "type", None)
        if kind == "text":
            pieces.append(block.text)
        elif kind == "resource":
            resource = block.resource
            text = getattr(resource, "text", None)
            pieces.append(text if isinstance(text, str) else f"[resource {resource.uri}]")
        elif kind == "resource_link":
            pieces.append(f"[resource link {block.uri}]")
        elif kind in ("image", "audio"):
            pieces.append(f"[{kind} content ({getattr(block, 'mime_type', '') or 'binary'}) omitted]")
    structured = getattr(result, "structured_content", None)
    if not pieces and structured is not None:
        pieces.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(pieces)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        return _describe(exc.exceptions[0])
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:300] if text else type(exc).__name__


def safe_url(url: str | None) -> str:
    """The URL without credentials, path parameters or query, for logs and error messages."""
    if not url:
        return ""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


@dataclass(eq=False)
class McpConnection:
    """A live MCP client session to one server, owned by a task spawned with `open(spawn)`."""

    server: ServerConfig
    connect_timeout: float = 10.0
    #: Read timeout of the HTTP transports: a tool call holds a response open for up to the tool timeout.
    read_timeout: float = 300.0
    transport_used: str | None = None
    _session: Any = None
    _error: str | None = None
    _ready: anyio.Event = field(default_factory=anyio.Event)
    _closing: anyio.Event = field(default_factory=anyio.Event)
    _done: anyio.Event = field(default_factory=anyio.Event)
    _scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    _broken: bool = False

    @property
    def label(self) -> str:
        return self.server.label

    @property
    def alive(self) -> bool:
        return self._session is not None and not self._broken and not self._closing.is_set()

    def _attempts(self) -> list[str]:
        transport = self.server.transport
        if transport != "streamable_http" or self.server.configured:
            return [transport]
        # Request-declared servers: streamable HTTP first, SSE as the fallback (an /sse URL: SSE first).
        path = urlsplit(self.server.url or "").path.rstrip("/")
        return ["sse", "streamable_http"] if path.endswith("/sse") else ["streamable_http", "sse"]

    async def open(self, spawn: Spawn) -> None:
        """Start the connection task and wait for the MCP handshake; raises McpServerUnavailable."""
        attempts = len(self._attempts())
        spawn(self._run)
        try:
            with anyio.move_on_after(self.connect_timeout * attempts + 1.0):
                await self._ready.wait()
        except BaseException:
            # The caller is gone (cancelled): nobody will close a session that connects after this.
            await self.close()
            raise
        if self._session is None:
            error = self._error or f"no MCP handshake within {self.connect_timeout:g} s"
            await self.close()
            raise McpServerUnavailable(f"cannot connect to MCP server {self.label!r}: {error}", param="tools")

    def _transport(self, kind: str) -> contextlib.AbstractAsyncContextManager[Any]:
        server = self.server
        if kind == "stdio":
            # lazy: the MCP SDK (~30 MB, 0.3 s) loads with the first MCP connection, never without one
            from mcp.client.stdio import StdioServerParameters, stdio_client

            assert server.command is not None
            params = StdioServerParameters(
                command=server.command, args=list(server.args), env=server.env or None, cwd=server.cwd
            )
            return stdio_client(params)
        assert server.url is not None
        if kind == "sse":
            from mcp.client.sse import sse_client  # lazy: the MCP SDK, with the first MCP connection

            return sse_client(
                server.url,
                headers=dict(server.headers),
                timeout=self.connect_timeout,
                sse_read_timeout=self.read_timeout,
            )
        return self._streamable_http(server.url, dict(server.headers))

    @contextlib.asynccontextmanager
    async def _streamable_http(self, url: str, headers: dict[str, str]) -> Any:
        # lazy: httpx2 and the MCP SDK, only for an MCP server over streamable HTTP
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        timeout = httpx2.Timeout(self.connect_timeout, read=self.read_timeout)
        async with httpx2.AsyncClient(headers=headers, timeout=timeout) as http:
            async with streamable_http_client(url, http_client=http) as streams:
                yield streams

    async def _run(self) -> None:
        from mcp.client.session import ClientSession  # lazy: the MCP SDK, with the first MCP connection

        where = safe_url(self.server.url) if self.server.url else f"stdio:{self.server.command}"
        try:
            with self._scope:
                for kind in self._attempts():
                    try:
                        async with contextlib.AsyncExitStack() as stack:
                            read, write = await stack.enter_async_context(self._transport(kind))
                            session = await stack.enter_async_context(ClientSession(read, write))
                            with anyio.fail_after(self.connect_timeout):
                                await session.initialize()
                            self._session = session
                            self.transport_used = kind
                            log.info("connected to MCP server %s at %s (%s)", self.label, where, kind)
                            self._ready.set()
                            await self._closing.wait()
                            return
                    except Exception as exc:
                        if self._session is not None:
                            log.warning("MCP server %s connection ended: %s", self.label, _describe(exc))
                            return
                        self._error = (
                            f"no MCP handshake within {self.connect_timeout:g} s"
                            if isinstance(exc, TimeoutError)
                            else _describe(exc)
                        )
                        log.info("MCP server %s at %s over %s: %s", self.label, where, kind, self._error)
                        if isinstance(exc, TimeoutError):
                            return
        finally:
            self._session = None
            self._broken = True
            self._ready.set()
            self._done.set()

    async def close(self) -> None:
        """End the connection task and wait for it (bounded); safe to call more than once."""
        self._closing.set()
        if self._session is None:
            self._scope.cancel()  # still connecting: nothing to close gracefully
        with anyio.move_on_after(5.0, shield=True):
            await self._done.wait()
        if not self._done.is_set():
            self._scope.cancel()
            with anyio.move_on_after(1.0, shield=True):
                await self._done.wait()

    def _require_session(self) -> Any:
        session = self._session
        if session is None or self._broken:
            raise McpToolFailed(f"the connection to MCP server {self.label!r} is closed", broken=True)
        return session

    async def list_tools(self, timeout: float) -> list[McpTool]:
        """Every tool of the server (all pages); raises McpServerUnavailable."""
        try:
            session = self._require_session()
            tools: list[McpTool] = []
            cursor = None
            with anyio.fail_after(timeout):
                for _ in range(MAX_TOOL_PAGES):
                    if cursor is None:
                        page = await session.list_tools()
                    else:
                        # lazy: the MCP SDK's types, only for a server that pages its tool list
                        from mcp_types import PaginatedRequestParams

                        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
                    for tool in page.tools:
                        annotations = (
                            tool.annotations.model_dump(exclude_none=True) if tool.annotations else None
                        )
                        tools.append(
                            McpTool(tool.name, tool.description or "", dict(tool.input_schema), annotations)
                        )
                    cursor = page.next_cursor
                    if cursor is None:
                        break
            return tools
        except McpToolFailed as exc:
            raise McpServerUnavailable(exc.message, param="tools") from None
        except TimeoutError:
            self._broken = True
            raise McpServerUnavailable(
                f"MCP server {self.label!r} did not list its tools within {timeout:g} s", param="tools"
            ) from None
        except Exception as exc:
            self._broken = True
            raise McpServerUnavailable(
                f"MCP server {self.label!r} failed to list its tools: {_describe(exc)}", param="tools"
            ) from None

    @traced("gateway.mcp.call")
    async def call_tool(self, name: str, arguments: dict[str, Any], timeout: float) -> ToolResult:
        """Run one tool; raises McpToolFailed on timeout, protocol or transport errors."""
        from mcp.shared.exceptions import MCPError  # lazy: the MCP SDK, with the first MCP connection

        session = self._require_session()
        try:
            with anyio.fail_after(timeout):
                result = await session.call_tool(name, arguments)
        except TimeoutError:
            raise McpToolFailed(f"tool {name!r} timed out after {timeout:g} s", code=504) from None
        except MCPError as exc:
            raise McpToolFailed(exc.error.message, error_type="mcp_protocol_error", code=exc.code) from None
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
            self._broken = True
            raise McpToolFailed(
                f"the connection to MCP server {self.label!r} broke: {_describe(exc)}", broken=True
            ) from None
        except Exception as exc:
            raise McpToolFailed(f"tool {name!r} failed: {_describe(exc)}") from None
        content = tuple(
            block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in result.content or ()
        )
        return ToolResult(result_text(result), bool(result.is_error), content)
