"""Storage backends by URL scheme, and the default storage location.

Adding a backend is one module plus one line in `STORES`; `open_store` looks the scheme up there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from .base import Store
from .memory import DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_RESPONSES, MemoryStore

StoreFactory = Callable[..., Store]


def _open_memory(url: str, *, schema: str | None = None, retention_seconds: float | None = None) -> Store:
    """`memory://`, optionally `?max_responses=N&max_conversations=N`."""
    if schema is not None:
        raise ValueError("schema= is only supported for PostgreSQL")
    query = dict(parse_qsl(urlsplit(url).query))
    unknown = set(query) - {"max_responses", "max_conversations"}
    if unknown:
        raise ValueError(f"unknown memory:// options: {', '.join(sorted(unknown))}")
    return MemoryStore(
        retention_seconds=retention_seconds,
        max_responses=int(query.get("max_responses", DEFAULT_MAX_RESPONSES)),
        max_conversations=int(query.get("max_conversations", DEFAULT_MAX_CONVERSATIONS)),
    )


def _open_sql(url: str, *, schema: str | None = None, retention_seconds: float | None = None) -> Store:
    """SQLite and PostgreSQL (`sql.SqlStore`), imported on first use."""
    from .sql import SqlStore  # lazy: SQLAlchemy (~20 MB) only with a SQL storage URL

    return SqlStore(url, schema=schema, retention_seconds=retention_seconds)


#: URL scheme -> factory(url, *, schema, retention_seconds).
STORES: dict[str, StoreFactory] = {
    "memory": _open_memory,
    "sqlite": _open_sql,
    "sqlite+aiosqlite": _open_sql,
    "postgresql": _open_sql,
    "postgres": _open_sql,
    "postgresql+asyncpg": _open_sql,
}


def open_store(url: str, *, schema: str | None = None, retention_seconds: float | None = None) -> Store:
    """The store for `url`, not yet started: the caller awaits `start()` and later `close()`.

    `schema` (PostgreSQL only) keeps the tables in that schema. `retention_seconds` makes
    `purge_expired` delete older responses. Raises ValueError for an unknown scheme or option.

        open_store("memory://")
        open_store("sqlite:////var/lib/harmony-gateway/responses.db")   # absolute path: four slashes
        open_store("postgres://gw@db/gateway", schema="gateway")
    """
    scheme, sep, _ = url.partition("://")
    factory = STORES.get(scheme.lower()) if sep else None
    if factory is None:
        raise ValueError(f"unsupported storage URL {url!r}; schemes: {', '.join(sorted(STORES))}")
    return factory(url, schema=schema, retention_seconds=retention_seconds)


def default_storage_url() -> str:
    """`sqlite:///` + `$XDG_DATA_HOME/harmony-gateway/responses.db` (`~/.local/share` when unset).

    A relative XDG_DATA_HOME is ignored, as the XDG base directory spec requires.
    """
    data_home = os.environ.get("XDG_DATA_HOME", "")
    base = Path(data_home) if data_home and os.path.isabs(data_home) else Path.home() / ".local" / "share"
    return f"sqlite:///{base / 'harmony-gateway' / 'responses.db'}"
