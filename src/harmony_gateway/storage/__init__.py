"""Persistence for stored Responses, background event logs and Conversations (see `base.Store`)."""

from .base import (
    RESPONSE_STATUSES,
    ConversationItem,
    Page,
    Store,
    StoredConversation,
    StoredResponse,
    StoredWorker,
    WorkerHealth,
    worker_health_key,
)
from .memory import MemoryStore
from .registry import STORES, default_storage_url, open_store
from .sql import SCHEMA_VERSION, SqlStore

__all__ = [
    "RESPONSE_STATUSES",
    "SCHEMA_VERSION",
    "STORES",
    "ConversationItem",
    "MemoryStore",
    "Page",
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
