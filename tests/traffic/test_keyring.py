"""`KeyRing`: the tenant keys in force, the key file read again on change; a reload that fails or would
leave no key keeps the keys in force."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from harmony_gateway.principal import authenticate
from harmony_gateway.settings import Settings
from harmony_gateway.traffic.keys import KeyPolicy, KeyRing, read_key_file


def ring_for(path: Path, *inline: str) -> KeyRing:
    policies = read_key_file(str(path))
    settings = Settings(
        api_keys=frozenset(inline) | frozenset(policies), key_policies=policies, api_key_file=str(path)
    )
    return KeyRing.from_settings(settings)


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_reload_replaces_the_file_keys_and_keeps_the_inline_ones(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("sk-a tenant=ops\nsk-b rate_limit=5\n")
    ring = ring_for(path, "sk-inline")
    assert ring.api_keys == {"sk-a", "sk-b", "sk-inline"} and ring.has_limits
    assert not ring.changed()
    path.write_text("sk-c priority=3\n")
    assert ring.changed()
    assert ring.reload()
    assert not ring.changed()
    assert ring.api_keys == {"sk-c", "sk-inline"} and not ring.has_limits
    assert ring.key_policies == {"sk-c": KeyPolicy(priority=3)}
    assert authenticate(ring, bearer("sk-a")) is None
    principal = authenticate(ring, bearer("sk-c"))
    assert principal is not None and principal.key_id


@pytest.mark.parametrize(
    "change",
    ["sk-x colour=blue\n", "# nothing left\n", None],
    ids=["malformed", "no key", "gone"],
)
def test_a_failed_reload_keeps_the_keys_in_force(
    tmp_path: Path, change: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("sk-a\n")
    ring = ring_for(path)
    if change is None:
        path.unlink()
    else:
        path.write_text(change)
    assert ring.changed()
    assert not ring.reload()
    assert ring.api_keys == {"sk-a"}
    assert authenticate(ring, bearer("sk-a")) is not None  # never open to everyone
    assert "keys in force stay" in caplog.text
    assert not ring.changed()  # not read again until it changes again
    path.write_text("sk-b\n")
    assert ring.reload() and ring.api_keys == {"sk-b"}


async def test_watch_reloads_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text("sk-a\n")
    ring = ring_for(path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(ring.watch, 0.01)
        replacement = tmp_path / "keys.new"
        replacement.write_text("sk-b\n")
        os.replace(replacement, path)
        with anyio.fail_after(5):
            while ring.api_keys != {"sk-b"}:
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()


def test_without_a_file_the_keys_are_fixed() -> None:
    ring = KeyRing.from_settings(Settings(api_keys=frozenset({"sk-a"})))
    assert ring.api_keys == {"sk-a"} and not ring.changed() and not ring.reload()
