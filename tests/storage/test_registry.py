"""Backend selection by URL, the default location, the public surface, and memory-store bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from harmony_gateway import storage
from harmony_gateway.storage import MemoryStore, SqlStore, StoredResponse, default_storage_url, open_store


def test_public_names() -> None:
    assert sorted(storage.__all__) == sorted(
        [
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
    )
    for name in storage.__all__:
        assert getattr(storage, name) is not None


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("memory://", MemoryStore),
        ("memory://?max_responses=5", MemoryStore),
        ("sqlite:///relative.db", SqlStore),
        ("sqlite:////tmp/absolute.db", SqlStore),
        ("sqlite+aiosqlite:////tmp/absolute.db", SqlStore),
        ("postgresql://u@localhost/db", SqlStore),
        ("postgres://u@localhost/db", SqlStore),
        ("postgresql+asyncpg://u@localhost/db", SqlStore),
    ],
)
async def test_open_store_by_scheme(url: str, kind: type) -> None:
    store = open_store(url)
    assert isinstance(store, kind)
    await store.close()  # never started: nothing was connected


def test_postgres_urls_use_asyncpg() -> None:
    for url in ("postgres://u@h/db", "postgresql://u@h/db"):
        store = open_store(url)
        assert isinstance(store, SqlStore)
        assert store._engine.url.drivername == "postgresql+asyncpg"


@pytest.mark.parametrize(
    ("url", "kwargs"),
    [
        ("redis://localhost", {}),
        ("no-scheme", {}),
        ("sqlite:///:memory:", {}),
        ("sqlite://", {}),
        ("postgresql+psycopg://u@h/db", {}),
        ("memory://?max_items=3", {}),
        ("memory://", {"schema": "x"}),
        ("sqlite:///x.db", {"schema": "x"}),
    ],
)
def test_open_store_rejects(url: str, kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        open_store(url, **kwargs)


def test_default_storage_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_storage_url() == f"sqlite:///{tmp_path}/harmony-gateway/responses.db"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unusable in ("", "relative/dir"):
        monkeypatch.setenv("XDG_DATA_HOME", unusable)
        assert default_storage_url() == f"sqlite:///{tmp_path}/home/.local/share/harmony-gateway/responses.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_storage_url().endswith("/home/.local/share/harmony-gateway/responses.db")


async def test_default_location_is_created_on_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    store = open_store(default_storage_url())
    await store.start()
    await store.close()
    assert (tmp_path / "data" / "harmony-gateway" / "responses.db").is_file()


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'r.db'}"
    store = SqlStore(url)
    await store.start()
    async with store._write() as conn:
        await conn.exec_driver_sql("INSERT INTO schema_version (version, applied_at) VALUES (99, 0)")
    await store.close()
    newer = SqlStore(url)
    with pytest.raises(RuntimeError, match="newer"):
        await newer.start()
    await newer.close()


def _response(n: int) -> StoredResponse:
    return StoredResponse(f"resp_{n}", "", n, float(n), "completed", "m", {})


async def test_memory_store_evicts_the_oldest_responses() -> None:
    store = open_store("memory://?max_responses=3")
    for n in range(5):
        await store.put_response(_response(n))
        await store.append_events(f"resp_{n}", [{"sequence_number": 0}])
    assert [await store.get_response(f"resp_{n}", "") is not None for n in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert await store.list_events("resp_0") == []
    # Replacing a response (a status update) does not make room by evicting it.
    await store.put_response(_response(2))
    assert await store.get_response("resp_2", "") is not None


async def test_memory_store_bounds_conversations() -> None:
    store = MemoryStore(max_conversations=2)
    for n in range(3):
        await store.create_conversation(storage.StoredConversation(f"conv_{n}", "", n), [{"id": f"i{n}"}])
    assert await store.get_conversation("conv_0", "") is None
    assert await store.get_conversation("conv_2", "") is not None
