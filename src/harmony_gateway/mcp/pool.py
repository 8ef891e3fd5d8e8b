"""MCP connections for the gateway: pooled sessions to the servers of `--mcp-config`, and one-request
connections to servers a request names by `server_url`.

`McpPool` is an async context manager entered once, in the app lifespan. It owns one task group in which
every connection task runs, so no connection outlives the app. Configured servers are connected at
start-up in the background (a failure there is logged, not fatal) and re-connected on first use after
their connection dropped; a request-declared server is connected by `connect()` and closed by the
request when its tool loop ends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import anyio

from ..netguard import HostAllowList
from ..settings import Settings
from .client import McpConnection, McpServerUnavailable
from .config import McpConfig, ServerConfig, load_mcp_config

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """The bounds of MCP work, in seconds and characters: connecting to a server, listing its tools,
    one tool call, and the tool output fed back to the model (the rest is cut)."""

    connect_timeout: float = 10.0
    tool_timeout: float = 30.0
    list_timeout: float = 10.0
    max_output_chars: int = 64_000


class McpPool:
    """Pooled connections to configured servers plus per-request connections, in one task group."""

    def __init__(self, config: McpConfig | None = None, settings: Settings | None = None) -> None:
        settings = settings or Settings()
        self.config = config or McpConfig()
        self.limits = PoolLimits(
            connect_timeout=settings.timeouts.connect,
            tool_timeout=settings.mcp_tool_timeout,
            list_timeout=settings.timeouts.connect,
            max_output_chars=settings.mcp_max_output_chars,
        )
        self.allow_hosts = HostAllowList(settings.mcp_allow_hosts)
        self._pooled: dict[str, McpConnection] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._tg: Any = None

    async def __aenter__(self) -> McpPool:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for label in self.config.servers:
            self._tg.start_soon(self._warm, label)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for connection in list(self._pooled.values()):
            await connection.close()
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(*exc)
        self._tg = None

    def _new(self, server: ServerConfig) -> McpConnection:
        read_timeout = max(300.0, self.limits.tool_timeout + 30.0)
        return McpConnection(server, connect_timeout=self.limits.connect_timeout, read_timeout=read_timeout)

    def _spawn(self, fn: Any) -> None:
        if self._tg is None:
            raise McpServerUnavailable("the MCP pool is not running", param="tools")
        self._tg.start_soon(fn)

    async def _warm(self, label: str) -> None:
        try:
            await self.get(label)
        except McpServerUnavailable as exc:
            log.warning("MCP server %s is not reachable yet: %s", label, exc.message)

    async def get(self, label: str) -> McpConnection:
        """The pooled connection to a configured server, (re)connected when needed."""
        lock = self._locks.setdefault(label, anyio.Lock())
        async with lock:
            connection = self._pooled.get(label)
            if connection is not None and connection.alive:
                return connection
            if connection is not None:
                log.info("re-connecting to MCP server %s", label)
                await connection.close()
            connection = self._new(self.config.servers[label])
            await connection.open(self._spawn)
            self._pooled[label] = connection
            return connection

    async def connect(self, server: ServerConfig) -> McpConnection:
        """A new connection for one request; the caller closes it."""
        connection = self._new(server)
        await connection.open(self._spawn)
        return connection


def open_mcp_pool(settings: Settings) -> McpPool:
    """The pool for the app: its config file is read here (start-up, so a bad file fails fast)."""
    config = load_mcp_config(settings.mcp_config) if settings.mcp_config else None
    return McpPool(config, settings)
