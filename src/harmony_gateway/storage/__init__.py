"""Persistence for stored Responses, background event logs and Conversations (see `base.Store`).

The SQL backend (SQLAlchemy, ~25 MB of imports) loads only when a SQL storage URL is opened or
`SqlStore` / `SCHEMA_VERSION` is asked for."""

from typing import Any

from ..types.limits import ConversationLimits, ConversationSize
from .base import (
    RESPONSE_STATUSES,
    ConversationItem,
    Page,
    RecentChain,
    RecentItems,
    Store,
    StoredConversation,
    StoredResponse,
    StoredWorker,
    WorkerHealth,
    worker_health_key,
)
from .memory import MemoryStore
from .registry import STORES, default_storage_url, open_store


def __getattr__(name: str) -> Any:
    if name in ("SCHEMA_VERSION", "SqlStore"):
        from . import sql  # lazy: SQLAlchemy (~20 MB) only when the SQL backend is asked for

        return getattr(sql, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RESPONSE_STATUSES",
    "SCHEMA_VERSION",
    "STORES",
    "ConversationItem",
    "ConversationLimits",
    "ConversationSize",
    "MemoryStore",
    "Page",
    "RecentChain",
    "RecentItems",
    "SqlStore",
    "Store",
    "StoredConversation",
    "StoredResponse",
    "StoredWorker",
    "WorkerHealth",
    "default_storage_url",
    "open_store",
    "worker_health_key",
]
