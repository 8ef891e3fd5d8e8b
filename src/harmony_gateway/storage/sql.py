"""The SQL `Store`: one SQLAlchemy Core implementation for SQLite (aiosqlite) and PostgreSQL (asyncpg).

Everything that differs between the two databases lives in `_SQLite` and `_Postgres`: how the URL
becomes an engine, connection set-up, how write transactions begin, and how schema creation is
serialised between processes. Payloads are JSON text (orjson) in TEXT columns on both, so the
tables read the same everywhere. The schema is versioned in `schema_version`; `start()` applies the
missing migrations inside one transaction that excludes other starting processes.

Durability: every write commits before the coroutine returns. SQLite runs in WAL mode with
`synchronous=FULL`, which fsyncs the WAL on each commit. NORMAL would already survive a killed
process (a committed frame is in the OS page cache), but a power cut could roll back recently
acknowledged commits; a client that was handed a response id must be able to fetch it, and the
gateway writes a handful of rows per response, so the fsync is cheap by comparison. Stream events
should be appended in batches for the same reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sqlite3
import time
import zlib
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, get_args, get_origin, get_type_hints

import anyio
import orjson
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, Dialect, make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

import harmony_gateway.storage.base as base

from .. import errors
from ..types.limits import ConversationLimits, ConversationSize

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

R = TypeVar("R", bound="DataclassInstance")

#: The schema version this code writes; `start()` refuses a database with a newer one.
SCHEMA_VERSION = 3

#: How long a SQLite writer waits for another process's write lock before failing (ms).
SQLITE_BUSY_TIMEOUT_MS = 10_000


class _Json(sa.types.TypeDecorator[Any]):
    """JSON text via orjson; TEXT on every dialect so the column reads the same everywhere."""

    impl = sa.Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str | None:
        return None if value is None else orjson.dumps(value).decode()

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return None if value is None else orjson.loads(value)


#: The column type of a record field, by the field's Python type.
_COLUMN_TYPES: dict[type, Any] = {str: sa.Text, int: sa.BigInteger, float: sa.Double, bool: sa.Boolean}


class _RecordRows(Generic[R]):
    """How the rows of a table hold the records of a `base` dataclass: a column per field, named as the
    field unless `renamed` says otherwise, typed by its annotation (str TEXT, int BIGINT or as `types`
    says, float DOUBLE, bool BOOLEAN, dicts and lists JSON text), NOT NULL unless the field may be None.
    `key` names the primary key's fields.
    """

    def __init__(
        self,
        record: type[R],
        *,
        key: Collection[str],
        renamed: Mapping[str, str] | None = None,
        types: Mapping[str, Any] | None = None,
    ) -> None:
        self._record = record
        self._key = key
        self._types = types or {}
        hints = get_type_hints(record)
        #: (field, column, annotation) of each field, in the record's order.
        self._fields = [
            (f.name, (renamed or {}).get(f.name, f.name), hints[f.name]) for f in dataclasses.fields(record)
        ]

    def columns(self) -> list[sa.Column[Any]]:
        """The columns of the record's fields, for its table."""
        columns: list[sa.Column[Any]] = []
        for name, column, hint in self._fields:
            optional = type(None) in get_args(hint)
            python_type = next(a for a in get_args(hint) if a is not type(None)) if optional else hint
            python_type = get_origin(python_type) or python_type
            column_type = self._types.get(name) or _COLUMN_TYPES.get(python_type, _Json)
            columns.append(sa.Column(column, column_type, primary_key=name in self._key, nullable=optional))
        return columns

    def values(self, record: R) -> dict[str, Any]:
        """`record` as column values."""
        return {column: getattr(record, name) for name, column, _ in self._fields}

    def record(self, row: sa.Row[Any]) -> R:
        """The record a row of the table holds (other columns of the row are left out)."""
        values = row._mapping
        return self._record(**{name: values[column] for name, column, _ in self._fields})


# The current schema. Tables are created in the default schema, which `schema_translate_map`
# redirects when the store is opened with `schema=`. The tables that hold `base` records get their
# columns from the records (`_RecordRows`) and add what only the database needs.
metadata = sa.MetaData()

schema_version = sa.Table(
    "schema_version",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("applied_at", sa.Double, nullable=False),
)

_RESPONSE_ROWS = _RecordRows(base.StoredResponse, key=["id"])
responses = sa.Table(
    "responses",
    metadata,
    *_RESPONSE_ROWS.columns(),
    # Version 3: `base.replay_size`, so a chain walk weighs its ancestors without reading them.
    sa.Column("replay_size", sa.BigInteger, nullable=False, server_default="0"),
    sa.Index("ix_responses_owner_id", "owner", "id"),
    sa.Index("ix_responses_status", "status"),
    sa.Index("ix_responses_created_at", "created_at"),
)

response_events = sa.Table(
    "response_events",
    metadata,
    sa.Column("response_id", sa.Text, primary_key=True),
    sa.Column("sequence_number", sa.BigInteger, primary_key=True),
    sa.Column("event", _Json, nullable=False),
)

_CONVERSATION_ROWS = _RecordRows(base.StoredConversation, key=["id"])
conversations = sa.Table(
    "conversations",
    metadata,
    *_CONVERSATION_ROWS.columns(),
    # The next item position; kept on the conversation row so that locking the row serialises
    # appends and positions are never reused after a delete.
    sa.Column("next_position", sa.BigInteger, nullable=False),
    sa.Index("ix_conversations_owner_id", "owner", "id"),
)

_ITEM_ROWS = _RecordRows(
    base.ConversationItem, key=["conversation_id", "position"], renamed={"id": "item_id"}
)
conversation_items = sa.Table(
    "conversation_items",
    metadata,
    *_ITEM_ROWS.columns(),
    # Version 3: the item's JSON in bytes, for the conversation limits and budgeted history reads.
    sa.Column("size", sa.BigInteger, nullable=False, server_default="0"),
    sa.Index("ux_conversation_items_item_id", "conversation_id", "item_id", unique=True),
    # Covers the size walks: they never touch the item payloads (SQLite would read a large item's
    # overflow pages to reach a column stored after it).
    sa.Index("ix_conversation_items_size", "conversation_id", "position", "size"),
)


gateway_values = sa.Table(
    "gateway_values",
    metadata,
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", _Json, nullable=False),
    sa.Column("expires_at", sa.Double),
    sa.Index("ix_gateway_values_expires_at", "expires_at"),
)

# Also version 2: the worker registry `serve --workers N` processes share (routing/shared_registry.py).
_WORKER_ROWS = _RecordRows(base.StoredWorker, key=["id"])
workers = sa.Table(
    "workers",
    metadata,
    *_WORKER_ROWS.columns(),
    sa.Index("ux_workers_url_kind", "url", "kind", unique=True),
)

_HEALTH_ROWS = _RecordRows(
    base.WorkerHealth,
    key=["key"],
    # INTEGER, as version 2 created them: a probe count never needs 64 bits.
    types={"consecutive_failures": sa.Integer, "consecutive_successes": sa.Integer},
)
worker_health = sa.Table("worker_health", metadata, *_HEALTH_ROWS.columns())

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("owner", sa.Text, nullable=False),
    sa.Column("expires_at", sa.Double, nullable=False),
)


def _create_v1(conn: Connection) -> None:
    metadata.create_all(
        conn, tables=[responses, response_events, conversations, conversation_items], checkfirst=True
    )


def _create_v2(conn: Connection) -> None:
    metadata.create_all(conn, tables=[gateway_values, workers, worker_health, leases], checkfirst=True)


def _add_sizes_v3(conn: Connection) -> None:
    """`conversation_items.size` (with its covering index) and `responses.replay_size`, filled in from
    the stored JSON. A database created at version 1 by this code already has them (version 1 creates
    the current tables)."""
    schema = conn.get_execution_options().get("schema_translate_map", {}).get(None)
    inspector = sa.inspect(conn)
    quote = conn.dialect.identifier_preparer

    def octets(column: sa.ColumnElement[Any]) -> sa.ColumnElement[int]:
        if conn.dialect.name == "postgresql":
            return sa.func.octet_length(column)
        return sa.func.length(sa.cast(column, sa.LargeBinary))

    def add_column(table: sa.Table, column: str, value: sa.ColumnElement[Any]) -> None:
        if column in {c["name"] for c in inspector.get_columns(table.name, schema=schema)}:
            return
        name = quote.quote(table.name)
        if schema is not None:
            name = f"{quote.quote_schema(schema)}.{name}"
        conn.exec_driver_sql(f"ALTER TABLE {name} ADD COLUMN {column} BIGINT NOT NULL DEFAULT 0")
        conn.execute(sa.update(table).values({column: value}))

    add_column(conversation_items, "size", octets(conversation_items.c.item))
    add_column(
        responses,
        "replay_size",
        octets(responses.c.history) + octets(responses.c.input_items) + octets(responses.c.response),
    )
    for index in conversation_items.indexes:
        if index.name == "ix_conversation_items_size":
            index.create(conn, checkfirst=True)


#: version -> migration that brings the database from version - 1 to it.
_MIGRATIONS: dict[int, Callable[[Connection], None]] = {
    1: _create_v1,
    2: _create_v2,
    3: _add_sizes_v3,
}


def _migrate(conn: Connection) -> None:
    schema_version.create(conn, checkfirst=True)
    current = conn.execute(sa.select(sa.func.max(schema_version.c.version))).scalar() or 0
    if current > SCHEMA_VERSION:
        raise RuntimeError(
            f"storage schema version {current} is newer than this gateway's {SCHEMA_VERSION}; upgrade it"
        )
    for version in range(current + 1, SCHEMA_VERSION + 1):
        _MIGRATIONS[version](conn)
        conn.execute(sa.insert(schema_version).values(version=version, applied_at=time.time()))
        logger.info("storage schema migrated to version %d", version)


# -- dialects ------------------------------------------------------------------------------------

# Execution option marking a write transaction, read by the SQLite "begin" hook.
_WRITE = "harmony_gateway_write"


def _enable_wal(cursor: Any) -> None:
    """Switch the database to WAL. The switch needs the database to itself and SQLite answers "database is
    locked" at once, without its busy handler, while another connection holds it (a second process
    creating the tables): retry until the busy timeout has passed. Runs in the driver's thread."""
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class _SQLite:
    """WAL, synchronous=FULL, busy_timeout; writes take the write lock up front (BEGIN IMMEDIATE)."""

    insert = staticmethod(sqlite.insert)
    # Writers in one process queue on an asyncio lock instead of polling SQLite's busy handler.
    serialise_writes = True

    def __init__(self, url: URL, schema: str | None) -> None:
        if schema is not None:
            raise ValueError("schema= is only supported for PostgreSQL")
        if not url.database or url.database == ":memory:" or url.database.startswith("file:"):
            raise ValueError("sqlite:// needs a file path (sqlite:///relative.db or sqlite:////abs.db)")
        self.path = Path(url.database)
        self.url = url.set(drivername="sqlite+aiosqlite")

    def create_engine(self) -> AsyncEngine:
        engine = create_async_engine(self.url)

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _configure(dbapi_connection: Any, _record: Any) -> None:
            # Take transaction control away from the sqlite3 module so "begin" below decides.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            _enable_wal(cursor)
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.close()

        @sa.event.listens_for(engine.sync_engine, "begin")
        def _begin(conn: Connection) -> None:
            # A deferred transaction that later writes can fail with SQLITE_BUSY without waiting
            # (its snapshot is stale), so writers take the lock at BEGIN, where busy_timeout applies.
            mode = "IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "DEFERRED"
            conn.exec_driver_sql(f"BEGIN {mode}")

        return engine

    async def prepare(self) -> None:
        await anyio.to_thread.run_sync(lambda: self.path.parent.mkdir(parents=True, exist_ok=True))

    async def lock_schema(self, conn: AsyncConnection) -> None:
        # BEGIN IMMEDIATE already excludes every other writer, in any process.
        pass


class _Postgres:
    """asyncpg; an advisory lock serialises schema creation; appends lock the conversation row."""

    insert = staticmethod(postgresql.insert)
    serialise_writes = False

    def __init__(self, url: URL, schema: str | None) -> None:
        self.url = url.set(drivername="postgresql+asyncpg")
        self.schema = schema

    def create_engine(self) -> AsyncEngine:
        options: dict[str, Any] = {}
        if self.schema is not None:
            options["schema_translate_map"] = {None: self.schema}
        return create_async_engine(self.url, pool_pre_ping=True, execution_options=options)

    async def prepare(self) -> None:
        pass

    async def lock_schema(self, conn: AsyncConnection) -> None:
        # Concurrent CREATE TABLE / CREATE SCHEMA IF NOT EXISTS can still collide on the catalog,
        # so starting processes take turns; the lock is released at commit.
        key = zlib.crc32(f"harmony-gateway:{self.schema or ''}".encode())
        await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.literal(key, sa.BigInteger))))
        if self.schema is not None:
            await conn.execute(sa.schema.CreateSchema(self.schema, if_not_exists=True))


def _dialect_for(url: str, schema: str | None) -> _SQLite | _Postgres:
    parsed = make_url(url)
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "aiosqlite"):
        return _SQLite(parsed, schema)
    if backend in ("postgresql", "postgres") and driver in ("", "asyncpg"):
        return _Postgres(parsed, schema)
    raise ValueError(f"unsupported SQL storage URL scheme {parsed.drivername!r}")


# -- the store -----------------------------------------------------------------------------------


def _owned_conversation(conversation_id: str, owner: str) -> sa.ColumnElement[bool]:
    return sa.and_(conversations.c.id == conversation_id, conversations.c.owner == owner)


class SqlStore(base.Store):
    """A `Store` on SQLite or PostgreSQL, chosen by URL.

    Accepts `sqlite:///relative.db`, `sqlite:////absolute.db`, `postgresql://...` and
    `postgres://...` (drivers aiosqlite and asyncpg are implied). `schema` (PostgreSQL only) puts
    the tables in that schema, creating it if needed. Call `start()` before use, `close()` after.
    """

    def __init__(
        self, url: str, *, schema: str | None = None, retention_seconds: float | None = None
    ) -> None:
        self.retention_seconds = retention_seconds
        self._dialect = _dialect_for(url, schema)
        self._engine = self._dialect.create_engine()
        self._writer = self._engine.execution_options(**{_WRITE: True})
        self._write_lock: asyncio.Lock | None = asyncio.Lock() if self._dialect.serialise_writes else None

    @contextlib.asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction, committed on exit (rolled back if the block raises)."""
        try:
            async with self._write_lock or contextlib.nullcontext(), self._writer.begin() as conn:
                yield conn
        except sa.exc.StatementError as exc:
            # orjson failing on a payload surfaces here wrapped; report it as the caller's
            # TypeError, exactly as MemoryStore does.
            if isinstance(exc.orig, TypeError):
                raise exc.orig from None
            raise

    def _read(self) -> contextlib.AbstractAsyncContextManager[AsyncConnection]:
        return self._engine.connect()

    async def start(self) -> None:
        await self._dialect.prepare()
        async with self._write() as conn:
            await self._dialect.lock_schema(conn)
            await conn.run_sync(_migrate)

    async def close(self) -> None:
        await self._engine.dispose()

    # -- responses ------------------------------------------------------------------------------

    async def _put_response(self, response: base.StoredResponse) -> None:
        values = {**_RESPONSE_ROWS.values(response), "replay_size": base.replay_size(response)}
        stmt = self._dialect.insert(responses).values(values)
        stmt = stmt.on_conflict_do_update(
            index_elements=[responses.c.id],
            set_={name: stmt.excluded[name] for name in values if name != "id"},
        )
        async with self._write() as conn:
            await conn.execute(stmt)

    async def _update_response_if(
        self, response: base.StoredResponse, from_statuses: Collection[str]
    ) -> bool:
        if not from_statuses:
            return False
        values = {**_RESPONSE_ROWS.values(response), "replay_size": base.replay_size(response)}
        del values["id"]
        stmt = (
            sa.update(responses)
            .where(
                responses.c.id == response.id,
                responses.c.owner == response.owner,
                responses.c.status.in_(sorted(from_statuses)),
            )
            .values(values)
        )
        async with self._write() as conn:
            result = await conn.execute(stmt)
        return result.rowcount > 0

    async def get_response_status(self, response_id: str) -> str | None:
        query = sa.select(responses.c.status).where(responses.c.id == response_id)
        async with self._read() as conn:
            status: str | None = (await conn.execute(query)).scalar()
        return status

    async def get_response(self, response_id: str, owner: str) -> base.StoredResponse | None:
        query = sa.select(responses).where(responses.c.id == response_id, responses.c.owner == owner)
        async with self._read() as conn:
            row = (await conn.execute(query)).first()
        return _RESPONSE_ROWS.record(row) if row is not None else None

    async def delete_response(self, response_id: str, owner: str) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                sa.delete(responses).where(responses.c.id == response_id, responses.c.owner == owner)
            )
            if result.rowcount == 0:
                return False
            await conn.execute(sa.delete(response_events).where(response_events.c.response_id == response_id))
        return True

    async def _input_items(self, response_id: str, owner: str) -> list[dict[str, Any]] | None:
        query = sa.select(responses.c.input_items).where(
            responses.c.id == response_id, responses.c.owner == owner
        )
        async with self._read() as conn:
            items: list[dict[str, Any]] | None = (await conn.execute(query)).scalar()
        return items

    async def _load_recent_chain(
        self, response_id: str, owner: str, max_bytes: int | None, max_depth: int
    ) -> base.RecentChain:
        # Walk the ids and sizes in one recursive query; the depth bound also ends a cycle.
        start = sa.select(
            responses.c.id,
            responses.c.previous_response_id,
            responses.c.replay_size,
            sa.literal_column("1", sa.Integer).label("depth"),
        ).where(responses.c.id == response_id, responses.c.owner == owner)
        walk = start.cte("chain", recursive=True)
        parent = responses.alias("parent")
        walk = walk.union_all(
            sa.select(parent.c.id, parent.c.previous_response_id, parent.c.replay_size, walk.c.depth + 1)
            .join_from(walk, parent, parent.c.id == walk.c.previous_response_id)
            .where(parent.c.owner == owner, walk.c.depth < max_depth)
        )
        async with self._read() as conn:
            walked = (
                await conn.execute(sa.select(walk.c.id, walk.c.replay_size).order_by(walk.c.depth))
            ).all()
            ids: list[str] = []
            sizes: list[int] = []
            for walked_id, size in walked:
                if walked_id in ids:
                    logger.warning("previous_response_id cycle at %s; chain cut there", walked_id)
                    break
                ids.append(walked_id)
                sizes.append(int(size))
            if not ids:
                raise base.previous_response_not_found(response_id)
            kept = ids[: base.within_budget(sizes, max_bytes)]
            rows = await conn.execute(
                sa.select(responses).where(responses.c.id.in_(kept), responses.c.owner == owner)
            )
            by_id = {row.id: _RESPONSE_ROWS.record(row) for row in rows}
        chain: list[base.StoredResponse] = []
        # A response deleted between the two queries ends the walk like a missing ancestor.
        for walked_id in kept:
            if walked_id not in by_id:
                break
            chain.append(by_id[walked_id])
        if not chain:
            raise base.previous_response_not_found(response_id)
        chain.reverse()
        return base.RecentChain(chain, omitted=len(kept) < len(ids))

    async def list_responses_with_status(
        self, statuses: set[str], *, background_only: bool = True
    ) -> list[base.StoredResponse]:
        if not statuses:
            return []
        query = sa.select(responses).where(responses.c.status.in_(sorted(statuses)))
        if background_only:
            query = query.where(responses.c.background.is_(True))
        async with self._read() as conn:
            rows = await conn.execute(query.order_by(responses.c.created_at, responses.c.id))
            return [_RESPONSE_ROWS.record(row) for row in rows]

    # -- background event log -------------------------------------------------------------------

    async def _append_events(
        self, response_id: str, numbers: list[int], events: Sequence[dict[str, Any]]
    ) -> None:
        stmt = self._dialect.insert(response_events).on_conflict_do_nothing(
            index_elements=[response_events.c.response_id, response_events.c.sequence_number]
        )
        rows = [
            {"response_id": response_id, "sequence_number": number, "event": event}
            for number, event in zip(numbers, events, strict=True)
        ]
        async with self._write() as conn:
            await conn.execute(stmt, rows)

    async def list_events(self, response_id: str, *, after: int = -1) -> list[dict[str, Any]]:
        query = (
            sa.select(response_events.c.event)
            .where(response_events.c.response_id == response_id, response_events.c.sequence_number > after)
            .order_by(response_events.c.sequence_number)
        )
        async with self._read() as conn:
            return list((await conn.execute(query)).scalars())

    # -- conversations --------------------------------------------------------------------------

    @staticmethod
    async def _insert_items(
        conn: AsyncConnection, conversation_id: str, first_position: int, new: base.NewItems, sizes: list[int]
    ) -> list[base.ConversationItem]:
        now = int(time.time())
        added = [
            base.ConversationItem(item_id, conversation_id, first_position + offset, item, now)
            for offset, (item_id, item) in enumerate(zip(new.ids, new.items, strict=True))
        ]
        if added:
            await conn.execute(
                sa.insert(conversation_items),
                [{**_ITEM_ROWS.values(a), "size": size} for a, size in zip(added, sizes, strict=True)],
            )
        return added

    async def _create_conversation(
        self, conversation: base.StoredConversation, new: base.NewItems, limits: ConversationLimits | None
    ) -> list[base.ConversationItem]:
        sizes = base.item_sizes(new.items)
        if limits is not None:
            limits.check(ConversationSize(), base.size_of(sizes))
        try:
            async with self._write() as conn:
                await conn.execute(
                    sa.insert(conversations).values(
                        **_CONVERSATION_ROWS.values(conversation), next_position=len(new.ids)
                    )
                )
                return await self._insert_items(conn, conversation.id, 0, new, sizes)
        except sa.exc.IntegrityError as exc:
            raise errors.Conflict(f"Conversation '{conversation.id}' already exists.") from exc

    async def get_conversation(self, conversation_id: str, owner: str) -> base.StoredConversation | None:
        async with self._read() as conn:
            row = (
                await conn.execute(
                    sa.select(conversations).where(_owned_conversation(conversation_id, owner))
                )
            ).first()
        return _CONVERSATION_ROWS.record(row) if row is not None else None

    async def update_conversation_metadata(
        self, conversation_id: str, owner: str, metadata: dict[str, Any]
    ) -> base.StoredConversation | None:
        async with self._write() as conn:
            result = await conn.execute(
                sa.update(conversations)
                .where(_owned_conversation(conversation_id, owner))
                .values(metadata=metadata)
            )
            if result.rowcount == 0:
                return None
            row = (
                await conn.execute(sa.select(conversations).where(conversations.c.id == conversation_id))
            ).one()
        return _CONVERSATION_ROWS.record(row)

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        async with self._write() as conn:
            result = await conn.execute(
                sa.delete(conversations).where(_owned_conversation(conversation_id, owner))
            )
            if result.rowcount == 0:
                return False
            await conn.execute(
                sa.delete(conversation_items).where(conversation_items.c.conversation_id == conversation_id)
            )
        return True

    async def _add_conversation_items(
        self, conversation_id: str, owner: str, new: base.NewItems, limits: ConversationLimits | None
    ) -> list[base.ConversationItem] | None:
        sizes = base.item_sizes(new.items)
        async with self._write() as conn:
            # The row lock (FOR UPDATE on PostgreSQL; SQLite's BEGIN IMMEDIATE holds the database
            # lock) makes concurrent appenders take turns on next_position.
            next_position = (
                await conn.execute(
                    sa.select(conversations.c.next_position)
                    .where(_owned_conversation(conversation_id, owner))
                    .with_for_update()
                )
            ).scalar()
            if next_position is None:
                return None
            if not new.ids:
                return []
            existing = (
                await conn.execute(
                    sa.select(conversation_items.c.item_id).where(
                        conversation_items.c.conversation_id == conversation_id,
                        conversation_items.c.item_id.in_(new.ids),
                    )
                )
            ).scalars()
            base.check_new_item_ids(new.ids, set(existing))
            if limits is not None:
                # Under the row lock: a racing appender waits for this commit, then counts these items.
                limits.check(await self._size(conn, conversation_id), base.size_of(sizes))
            added = await self._insert_items(conn, conversation_id, next_position, new, sizes)
            await conn.execute(
                sa.update(conversations)
                .where(conversations.c.id == conversation_id)
                .values(next_position=next_position + len(new.ids))
            )
        return added

    async def count_conversation_items(self, conversation_id: str, owner: str) -> int | None:
        query = sa.select(sa.func.count()).where(conversation_items.c.conversation_id == conversation_id)
        async with self._read() as conn:
            if not await self._conversation_visible(conn, conversation_id, owner):
                return None
            return int((await conn.execute(query)).scalar() or 0)

    @staticmethod
    async def _size(conn: AsyncConnection, conversation_id: str) -> ConversationSize:
        held = (
            await conn.execute(
                sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(conversation_items.c.size), 0)).where(
                    conversation_items.c.conversation_id == conversation_id
                )
            )
        ).one()
        return ConversationSize(int(held[0]), int(held[1]))

    async def conversation_size(self, conversation_id: str, owner: str) -> ConversationSize | None:
        async with self._read() as conn:
            if not await self._conversation_visible(conn, conversation_id, owner):
                return None
            return await self._size(conn, conversation_id)

    async def _recent_conversation_items(
        self, conversation_id: str, owner: str, max_bytes: int | None
    ) -> base.RecentItems | None:
        position = conversation_items.c.position
        of_conversation = conversation_items.c.conversation_id == conversation_id
        async with self._read() as conn:
            if not await self._conversation_visible(conn, conversation_id, owner):
                return None
            # Positions and sizes only (the covering index), newest first; then the payloads of the
            # tail that fits, bounded above as well so an append in between adds nothing unbudgeted.
            sized = (
                await conn.execute(
                    sa.select(position, conversation_items.c.size)
                    .where(of_conversation)
                    .order_by(position.desc())
                )
            ).all()
            kept = base.newest_within((row.size for row in sized), max_bytes)
            if not kept:
                return base.RecentItems([], omitted=len(sized))
            rows = await conn.execute(
                sa.select(conversation_items.c.item)
                .where(of_conversation, position >= sized[kept - 1].position, position <= sized[0].position)
                .order_by(position)
            )
            items = list(rows.scalars())
        # An item deleted in between leaves a gap: it is simply not there, as it would not be later.
        return base.RecentItems(items, omitted=len(sized) - kept)

    async def _list_conversation_items(
        self, conversation_id: str, owner: str, after: str | None, limit: int, order: base.Order
    ) -> base.Page | None:
        position = conversation_items.c.position
        query = sa.select(conversation_items.c.item).where(
            conversation_items.c.conversation_id == conversation_id
        )
        async with self._read() as conn:
            if not await self._conversation_visible(conn, conversation_id, owner):
                return None
            if after is not None:
                cursor = (
                    await conn.execute(
                        sa.select(position).where(
                            conversation_items.c.conversation_id == conversation_id,
                            conversation_items.c.item_id == after,
                        )
                    )
                ).scalar()
                if cursor is None:
                    raise base.unknown_cursor(after)
                query = query.where(position > cursor if order == "asc" else position < cursor)
            query = query.order_by(position.asc() if order == "asc" else position.desc()).limit(limit + 1)
            rows = list((await conn.execute(query)).scalars())
        return base.make_page(rows, limit)

    @staticmethod
    async def _conversation_visible(conn: AsyncConnection, conversation_id: str, owner: str) -> bool:
        found = await conn.execute(
            sa.select(conversations.c.id).where(_owned_conversation(conversation_id, owner))
        )
        return found.first() is not None

    async def get_conversation_item(
        self, conversation_id: str, item_id: str, owner: str
    ) -> base.ConversationItem | None:
        query = (
            sa.select(conversation_items)
            .join(conversations, conversations.c.id == conversation_items.c.conversation_id)
            .where(_owned_conversation(conversation_id, owner), conversation_items.c.item_id == item_id)
        )
        async with self._read() as conn:
            row = (await conn.execute(query)).first()
        return _ITEM_ROWS.record(row) if row is not None else None

    async def delete_conversation_item(self, conversation_id: str, item_id: str, owner: str) -> bool:
        stmt = sa.delete(conversation_items).where(
            conversation_items.c.conversation_id == conversation_id,
            conversation_items.c.item_id == item_id,
            sa.exists().where(_owned_conversation(conversation_id, owner)),
        )
        async with self._write() as conn:
            result = await conn.execute(stmt)
        return result.rowcount > 0

    async def all_conversation_items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        query = (
            sa.select(conversation_items.c.item)
            .where(conversation_items.c.conversation_id == conversation_id)
            .order_by(conversation_items.c.position)
        )
        async with self._read() as conn:
            if not await self._conversation_visible(conn, conversation_id, owner):
                return None
            return list((await conn.execute(query)).scalars())

    # -- gateway values -------------------------------------------------------------------------

    async def put_value(self, key: str, value: dict[str, Any], *, expires_at: float | None = None) -> None:
        insert = self._dialect.insert(gateway_values).values(key=key, value=value, expires_at=expires_at)
        upsert = insert.on_conflict_do_update(
            index_elements=[gateway_values.c.key],
            set_={"value": insert.excluded.value, "expires_at": insert.excluded.expires_at},
        )
        async with self._write() as conn:
            await conn.execute(upsert)

    async def get_value(self, key: str, *, now: float) -> dict[str, Any] | None:
        query = sa.select(gateway_values.c.value).where(
            gateway_values.c.key == key,
            sa.or_(gateway_values.c.expires_at.is_(None), gateway_values.c.expires_at > now),
        )
        async with self._read() as conn:
            found: dict[str, Any] | None = (await conn.execute(query)).scalar()
        return found

    async def add_value(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        insert = self._dialect.insert(gateway_values).values(key=key, value=value, expires_at=None)
        async with self._write() as conn:
            await conn.execute(insert.on_conflict_do_nothing(index_elements=[gateway_values.c.key]))
            stored = (
                await conn.execute(sa.select(gateway_values.c.value).where(gateway_values.c.key == key))
            ).scalar()
        assert stored is not None  # inserted above, or there already
        return dict(stored)

    # -- retention ------------------------------------------------------------------------------

    async def purge_expired(self, now: float) -> int:
        async with self._write() as conn:
            await conn.execute(
                sa.delete(gateway_values).where(
                    gateway_values.c.expires_at.is_not(None), gateway_values.c.expires_at <= now
                )
            )
        if self.retention_seconds is None:
            return 0
        expired = responses.c.created_at < now - self.retention_seconds
        async with self._write() as conn:
            await conn.execute(
                sa.delete(response_events).where(
                    response_events.c.response_id.in_(sa.select(responses.c.id).where(expired))
                )
            )
            result = await conn.execute(sa.delete(responses).where(expired))
        return result.rowcount

    # -- shared worker registry -----------------------------------------------------------------

    async def add_worker(self, worker: base.StoredWorker) -> None:
        try:
            async with self._write() as conn:
                await conn.execute(sa.insert(workers).values(_WORKER_ROWS.values(worker)))
        except sa.exc.IntegrityError as exc:
            raise errors.Conflict(
                f"worker {worker.url} ({worker.kind}) is already registered", param="url"
            ) from exc

    async def delete_worker(self, worker_id: str) -> base.StoredWorker | None:
        async with self._write() as conn:
            row = (await conn.execute(sa.select(workers).where(workers.c.id == worker_id))).first()
            if row is None:
                return None
            await conn.execute(sa.delete(workers).where(workers.c.id == worker_id))
            removed = _WORKER_ROWS.record(row)
            await conn.execute(
                sa.delete(worker_health).where(
                    worker_health.c.key == base.worker_health_key(removed.kind, removed.url)
                )
            )
        return removed

    async def list_workers(self) -> list[base.StoredWorker]:
        async with self._read() as conn:
            rows = await conn.execute(sa.select(workers).order_by(workers.c.created_at, workers.c.id))
            return [_WORKER_ROWS.record(row) for row in rows]

    async def put_worker_health(self, health: Sequence[base.WorkerHealth]) -> None:
        if not health:
            return
        stmt = self._dialect.insert(worker_health)
        stmt = stmt.on_conflict_do_update(
            index_elements=[worker_health.c.key],
            set_={c.name: stmt.excluded[c.name] for c in worker_health.columns if c.name != "key"},
        )
        async with self._write() as conn:
            await conn.execute(stmt, [_HEALTH_ROWS.values(h) for h in health])

    async def list_worker_health(self) -> list[base.WorkerHealth]:
        async with self._read() as conn:
            rows = await conn.execute(sa.select(worker_health))
            return [_HEALTH_ROWS.record(row) for row in rows]

    async def acquire_lease(self, name: str, owner: str, ttl: float, now: float) -> bool:
        # One upsert that only overwrites an expired lease or our own: of two processes racing for a
        # free or expired lease, exactly one sees its name afterwards.
        stmt = self._dialect.insert(leases).values(name=name, owner=owner, expires_at=now + ttl)
        stmt = stmt.on_conflict_do_update(
            index_elements=[leases.c.name],
            set_={"owner": stmt.excluded.owner, "expires_at": stmt.excluded.expires_at},
            where=sa.or_(leases.c.owner == owner, leases.c.expires_at <= now),
        )
        async with self._write() as conn:
            await conn.execute(stmt)
            holder = (await conn.execute(sa.select(leases.c.owner).where(leases.c.name == name))).scalar()
        return holder == owner

    async def release_lease(self, name: str, owner: str) -> None:
        async with self._write() as conn:
            await conn.execute(sa.delete(leases).where(leases.c.name == name, leases.c.owner == owner))
