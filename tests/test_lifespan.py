"""The app lifespan: a failure during start-up stops what was already started."""

from __future__ import annotations

from typing import Any

import pytest

from harmony_gateway.app import create_app
from harmony_gateway.storage import registry
from harmony_gateway.storage.memory import MemoryStore
from tests.support.servers import test_settings


class _UnreadableStore(MemoryStore):
    """Starts, then fails the first query (a database that went away during start-up)."""

    opened: list[_UnreadableStore] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.closed = False
        self.opened.append(self)

    async def list_responses_with_status(self, *args: Any, **kwargs: Any) -> Any:
        raise OSError("database unreachable")

    async def close(self) -> None:
        self.closed = True


async def test_a_start_up_failure_closes_the_started_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.STORES, "unreadable", _UnreadableStore)
    monkeypatch.setattr(_UnreadableStore, "opened", [])
    app = create_app(test_settings(storage_url="unreadable://"))
    with pytest.raises(OSError, match="database unreachable"):
        async with app.router.lifespan_context(app):
            pass
    [store] = _UnreadableStore.opened
    assert store.closed
