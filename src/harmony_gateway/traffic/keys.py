"""API key file entries: a key, optionally with its own limits and priority.

    # one key per line; options after it override the command-line defaults for that key
    sk-team-a
    sk-batch   rate_limit=10 token_rate_limit=20000 priority=-1
    sk-interactive priority=10
    sk-ops-1   tenant=ops
    sk-ops-2   tenant=ops

`priority` is an integer: waiting requests of higher-priority keys are admitted first (default 0).
`tenant` names what the key's stored objects belong to: keys of one tenant see each other's responses,
conversations and restorable reasoning (principal.py); without it a key is a tenant of its own.
"""

from __future__ import annotations

import re
from pathlib import Path

# Re-exported: a key file entry parses into the settings record, which the middleware reads from here.
from ..settings import KeyPolicy as KeyPolicy

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
    out: dict[str, KeyPolicy] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        entry = parse_key_line(line, f"{path}:{number}: ")
        if entry is not None:
            out[entry[0]] = entry[1]
    return out
