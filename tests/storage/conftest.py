"""Backends for the storage contract suite: memory, SQLite in tmp_path, PostgreSQL in a fresh schema.

PostgreSQL comes from `GATEWAY_TEST_PG_URL` (default: the local test server). When it cannot be
reached the postgres cases skip, except under CI (`CI` set), where they fail: a CI run that
silently skipped them would prove nothing about PostgreSQL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from harmony_gateway.storage import Store, open_store

PG_URL = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")

_pg_error: list[str | None] = []


async def _postgres_unreachable() -> str | None:
    """Why PostgreSQL cannot be used, or None; probed once per session."""
    if not _pg_error:
        try:
            conn = await asyncpg.connect(PG_URL, timeout=3)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            _pg_error.append(f"{type(exc).__name__}: {exc}")
        else:
            await conn.close()
            _pg_error.append(None)
    return _pg_error[0]


async def require_postgres() -> None:
    reason = await _postgres_unreachable()
    if reason is None:
        return
    message = f"PostgreSQL at {PG_URL} is not reachable ({reason})"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture
async def pg_schema() -> AsyncIterator[str]:
    """A fresh schema `hg_test_<random>`, dropped with everything in it afterwards."""
    await require_postgres()
    name = f"hg_test_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(PG_URL)
    try:
        await conn.execute(f'CREATE SCHEMA "{name}"')
        yield name
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
        await conn.close()


@dataclass
class Backend:
    """One database; `open()` returns another started store on it (memory: a new, empty one)."""

    name: str
    url: str
    schema: str | None = None
    _opened: list[Store] = field(default_factory=list)

    def store(self, **kwargs: object) -> Store:
        """A store on this database, not started, closed at teardown."""
        store = open_store(self.url, schema=self.schema, **kwargs)  # type: ignore[arg-type]
        self._opened.append(store)
        return store

    async def open(self, **kwargs: object) -> Store:
        store = self.store(**kwargs)
        await store.start()
        return store

    async def close_all(self) -> None:
        for store in self._opened:
            await store.close()


BACKENDS = ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
SQL_BACKENDS = BACKENDS[1:]


def _backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "memory":
        return Backend("memory", "memory://")
    if request.param == "sqlite":
        return Backend("sqlite", f"sqlite:///{tmp_path / 'responses.db'}")
    return Backend("postgres", PG_URL, request.getfixturevalue("pg_schema"))


# The spec fixtures are synchronous so that they may pull in the async pg_schema fixture for the
# postgres case only; the async ones close every store before the schema is dropped.


@pytest.fixture(params=BACKENDS)
def backend_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return _backend(request, tmp_path)


@pytest.fixture(params=SQL_BACKENDS)
def sql_backend_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return _backend(request, tmp_path)


@pytest.fixture
async def backend(backend_spec: Backend) -> AsyncIterator[Backend]:
    """Each backend in turn: memory, SQLite in tmp_path, PostgreSQL in a fresh schema."""
    try:
        yield backend_spec
    finally:
        await backend_spec.close_all()


@pytest.fixture
async def sql_backend(sql_backend_spec: Backend) -> AsyncIterator[Backend]:
    """The backends where several stores (and processes) share one database."""
    try:
        yield sql_backend_spec
    finally:
        await sql_backend_spec.close_all()


@pytest.fixture
async def store(backend: Backend) -> Store:
    return await backend.open()
