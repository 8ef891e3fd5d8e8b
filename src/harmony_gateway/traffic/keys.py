"""API keys: the key file's entries (a key, optionally with its own limits, priority and tenant), and
the `KeyRing` of keys in force, which re-reads the file without a restart.

    # one key per line; options after it override the command-line defaults for that key
    sk-team-a
    sk-batch   rate_limit=10 token_rate_limit=20000 priority=-1
    sk-interactive priority=10
    sk-ops-1   tenant=ops
    sk-ops-2   tenant=ops

`priority` is an integer: waiting requests of higher-priority keys are admitted first (default 0).
`tenant` names what the key's stored objects belong to: keys of one tenant see each other's responses,
conversations and restorable reasoning (principal.py); without it a key is a tenant of its own.
Blank lines and lines starting with `#` are skipped.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from collections.abc import Mapping
from pathlib import Path

import anyio
from anyio.abc import TaskStatus

# Re-exported: a key file entry parses into the settings record, which the middleware reads from here.
from ..settings import KeyPolicy as KeyPolicy
from ..settings import Settings

log = logging.getLogger(__name__)

_INT_FIELDS = {"rate_limit", "token_rate_limit", "priority"}
_FIELDS = _INT_FIELDS | {"tenant"}
_TENANT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def parse_key_line(line: str, where: str = "") -> tuple[str, KeyPolicy] | None:
    """`KEY [name=value ...]` → (key, policy); None for blank lines and comments. Raises ValueError."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    key, *options = line.split()
    values: dict[str, int] = {}
    tenant: str | None = None
    for option in options:
        name, sep, raw = option.partition("=")
        name = name.replace("-", "_")
        if not sep or name not in _FIELDS:
            raise ValueError(f"{where}unknown key option {option!r}; expected {', '.join(sorted(_FIELDS))}")
        if name == "tenant":
            if not _TENANT_NAME.fullmatch(raw):
                raise ValueError(f"{where}tenant expects 1 to 64 letters, digits or _.:-, got {raw!r}")
            tenant = raw
            continue
        try:
            values[name] = int(raw)
        except ValueError:
            raise ValueError(f"{where}{name} expects an integer, got {raw!r}") from None
        if name != "priority" and values[name] < 1:
            raise ValueError(f"{where}{name} must be 1 or more")
    return key, KeyPolicy(**values, tenant=tenant)


def read_key_file(path: str) -> dict[str, KeyPolicy]:
    """Every entry of the key file at `path`: key → policy. Raises OSError (and UnicodeDecodeError)
    for a file it cannot read, ValueError naming `path:line` for a malformed entry."""
    out: dict[str, KeyPolicy] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        entry = parse_key_line(line, f"{path}:{number}: ")
        if entry is not None:
            out[entry[0]] = entry[1]
    return out


#: Seconds between two looks at the key file (`KeyRing.watch`): a key added or revoked there is in
#: force this long after the file changed, at most.
KEY_FILE_POLL_INTERVAL = 1.0


class KeyRing:
    """The tenant keys in force: the inline ones (`--api-key`, `HARMONY_GATEWAY_API_KEY`) and the key
    file's, which `reload` reads again without a restart (`watch` does on change, the app on SIGHUP).

    `api_keys` and `key_policies` are what `principal.authenticate` reads; each reload replaces both at
    once, so a request sees either the old set or the new one. A reload that fails (an unreadable or
    malformed file) or that would leave no key at all keeps the keys in force and logs why: a gateway
    that started with keys never opens itself to every request. A key given inline and in the file
    counts as the file's (revoking it there revokes it)."""

    def __init__(
        self,
        inline: frozenset[str] = frozenset(),
        file: str | None = None,
        policies: Mapping[str, KeyPolicy] | None = None,
    ) -> None:
        self.inline = inline
        self.file = file
        self.api_keys: frozenset[str] = inline | frozenset(policies or ())
        self.key_policies: Mapping[str, KeyPolicy] = dict(policies or {})
        self._seen = _signature(file) if file else None

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """The ring of the settings: their keys, the file's as read at start-up among them."""
        file_keys = frozenset(settings.key_policies) if settings.api_key_file else frozenset()
        return cls(settings.api_keys - file_keys, settings.api_key_file, settings.key_policies)

    @property
    def has_limits(self) -> bool:
        """Some key has a rate or token limit of its own."""
        return any(p.rate_limit or p.token_rate_limit for p in self.key_policies.values())

    def reload(self) -> bool:
        """Read the key file again; True when its keys are now in force (see the class docstring for
        when the old ones stay). Blocking file I/O: call it from a thread."""
        if self.file is None:
            return False
        self._seen = _signature(self.file)
        try:
            policies = read_key_file(self.file)
        except (OSError, UnicodeDecodeError) as exc:
            log.error("API key file %s: cannot read it (%s); the keys in force stay", self.file, exc)
            return False
        except ValueError as exc:
            log.error("API key file: %s; the keys in force stay", exc)
            return False
        keys = self.inline | frozenset(policies)
        if not keys:
            log.error(
                "API key file %s holds no key; the %d keys in force stay", self.file, len(self.api_keys)
            )
            return False
        added, removed = len(keys - self.api_keys), len(self.api_keys - keys)
        self.key_policies, self.api_keys = policies, keys
        log.info(
            "API key file %s reloaded: %d keys (%d added, %d revoked)", self.file, len(keys), added, removed
        )
        return True

    def changed(self) -> bool:
        """The key file is not the one last read (another inode, size or modification time): an edit,
        or a Kubernetes Secret's new version swapped in under the same path."""
        return self.file is not None and _signature(self.file) != self._seen

    async def watch(self, interval: float = KEY_FILE_POLL_INTERVAL) -> None:
        """Reload the key file whenever it changes, until cancelled (a lifespan task)."""
        while True:
            await anyio.sleep(interval)
            if await anyio.to_thread.run_sync(self.changed):
                await anyio.to_thread.run_sync(self.reload)

    async def reload_on_hangup(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Reload the key file on every SIGHUP, until cancelled (a lifespan task, started with
        `TaskGroup.start`: SIGHUP is handled once that returns). Signal handlers belong to the main
        thread: elsewhere (an app served from another thread) it returns at once and only `watch`
        reloads."""
        if threading.current_thread() is not threading.main_thread():
            task_status.started()
            return
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            task_status.started()
            async for _ in signals:
                log.info("SIGHUP: reading the API key file %s again", self.file)
                await anyio.to_thread.run_sync(self.reload)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)
