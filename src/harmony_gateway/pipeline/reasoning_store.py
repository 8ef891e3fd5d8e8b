"""Reasoning that survives the turn for stateless clients.

gpt-oss is trained to see the current turn's analysis until the turn ends in a final answer; clients that
keep no server state lose it between tool calls unless they can send it back. `ReasoningVault` gives them
three ways, all under one gateway key:

- Responses `include: ["reasoning.encrypted_content"]`: each reasoning item carries `encrypted_content`,
  the analysis text under AES-256-GCM (AEAD: a changed or foreign blob fails to open, which is a 400
  naming the input param). Versioned `hg1.` + base64url(nonce || ciphertext || tag).
- Chat Completions and Anthropic Messages clients that send the assistant's tool calls back without the
  reasoning: the analysis the gateway produced for a turn is kept in the storage under each tool call id it
  issued (`remember`), with a TTL, and restored by those ids (`recall`). Storage is shared, so any replica
  restores it; what the client sends always wins. The ids are unguessable (96 random bits) and only the
  client that received them knows them, so they are the lookup key on their own.
- Anthropic `thinking` blocks carry a `signature`: HMAC-SHA256 of the thinking text.

The key comes from `--reasoning-key` / HARMONY_GATEWAY_REASONING_KEY (any string, stretched with
SHA-256); without one, 32 random bytes are generated once and kept in the storage (`add_value`, first
writer wins), so restarts and replicas on the same storage share it. Encryption and signing keys are
derived from it separately (HMAC-SHA256 with distinct labels); `subkey` derives keys for other uses of
the gateway key (MCP approval request ids) the same way.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import InvalidRequest
from ..harmony import token_parser as tp

log = logging.getLogger(__name__)

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
KEY_NAME = "gateway:reasoning-key"
#: How long the analysis behind an issued tool call stays restorable.
RECALL_TTL_SECONDS = 24 * 3600.0
#: Longest analysis kept for restoring (characters); longer ones are cut from the front.
MAX_RECALL_CHARS = 64_000
_PREFIX = "hg1."
_AAD = b"harmony-gateway reasoning v1"
_NONCE = 12


class ReasoningVault:
    """Seals, opens and signs reasoning with one key; remembers analyses by tool call id in `store`."""

    def __init__(self, key: bytes, store: Any) -> None:
        self._aead = AESGCM(hmac.new(key, b"encrypt", hashlib.sha256).digest())
        self._mac_key = hmac.new(key, b"sign", hashlib.sha256).digest()
        self._key = key
        self._store = store

    def subkey(self, purpose: bytes) -> bytes:
        """A key for another use of the gateway key, independent of the reasoning keys: HMAC-SHA256 of
        `purpose` (a label no other use shares) under the gateway key."""
        return hmac.new(self._key, purpose, hashlib.sha256).digest()

    # -- encrypted_content ------------------------------------------------------------------------
    def seal(self, text: str) -> str:
        nonce = os.urandom(_NONCE)
        blob = nonce + self._aead.encrypt(nonce, text.encode(), _AAD)
        return _PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("=")

    def open(self, sealed: Any, *, param: str) -> str:
        """The analysis text in `sealed`; InvalidRequest naming `param` if it was not sealed with this key."""
        if not isinstance(sealed, str) or not sealed.startswith(_PREFIX):
            raise InvalidRequest("encrypted_content was not produced by this gateway", param=param)
        try:
            raw = base64.urlsafe_b64decode(sealed[len(_PREFIX) :] + "=" * (-len(sealed) % 4))
            text = self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], _AAD)
            return text.decode()
        except (InvalidTag, ValueError, binascii.Error, UnicodeDecodeError):
            raise InvalidRequest(
                "encrypted_content could not be decrypted: it was changed, or sealed with another key",
                param=param,
            ) from None

    # -- Anthropic thinking signatures ------------------------------------------------------------
    def sign(self, text: str) -> str:
        return base64.urlsafe_b64encode(
            hmac.new(self._mac_key, text.encode(), hashlib.sha256).digest()
        ).decode()

    def verify(self, text: str, signature: Any) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(text), signature)

    # -- restoring by tool call id ----------------------------------------------------------------
    async def remember(self, call_ids: Iterable[str], analysis: str) -> None:
        if not analysis:
            return
        value = {"analysis": analysis[-MAX_RECALL_CHARS:]}
        expires = time.time() + RECALL_TTL_SECONDS
        for call_id in call_ids:
            await self._store.put_value(_recall_key(call_id), value, expires_at=expires)

    async def recall(self, call_ids: Iterable[str]) -> str | None:
        """The analysis remembered under the first of `call_ids` that has one."""
        now = time.time()
        for call_id in call_ids:
            found = await self._store.get_value(_recall_key(call_id), now=now)
            if found is not None:
                return str(found.get("analysis") or "") or None
        return None


def _recall_key(call_id: str) -> str:
    # Stored hashed: the storage never holds a usable call id.
    return "reasoning:" + hashlib.sha256(call_id.encode()).hexdigest()


_vaults: weakref.WeakKeyDictionary[Any, ReasoningVault] = weakref.WeakKeyDictionary()
_locks: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


async def reasoning_vault(state: Any) -> ReasoningVault:
    """The gateway's vault (built on first use: the generated key may have to be read from storage)."""
    vault = _vaults.get(state)
    if vault is not None:
        return vault
    lock = _locks.setdefault(state, asyncio.Lock())
    async with lock:
        vault = _vaults.get(state)
        if vault is None:
            vault = _vaults[state] = ReasoningVault(await _gateway_key(state), state.store)
    return vault


async def _gateway_key(state: Any) -> bytes:
    configured = state.settings.reasoning_key
    if configured:
        return hashlib.sha256(configured.encode()).digest()
    fresh = base64.b64encode(os.urandom(32)).decode()
    stored = await state.store.add_value(KEY_NAME, {"key": fresh})
    return base64.b64decode(stored["key"])


def turn_remembering(state: Any) -> Callable[[Any], Awaitable[None]]:
    """The `PreparedRequest.after_turn` hook of Chat and Messages requests: once a choice has finished,
    keep the analysis of a turn that called tools under the call ids it issued. Storage trouble is logged,
    never fails the response."""

    async def remember_turn(choice: Any) -> None:
        messages = getattr(getattr(choice, "parser", None), "messages", None)
        if not messages:
            return  # text output (HTTP upstreams, other models): no issued call ids
        calls = [m.call_id for m in messages if m.kind == tp.FUNCTION_CALL and m.call_id]
        analysis = "\n".join(
            m.text for m in messages if m.kind == tp.REASONING and not m.recipient and m.text
        )
        if not calls or not analysis:
            return
        try:
            await (await reasoning_vault(state)).remember(calls, analysis)
        except Exception as exc:
            log.warning("could not keep the analysis of tool calls %s: %s", calls, exc)

    return remember_turn


async def recall_analyses(state: Any, turns: dict[int, list[str]]) -> dict[int, str]:
    """Remembered analysis per assistant turn (index → text) for turns given as index → their call ids."""
    if not turns:
        return {}
    try:
        vault = await reasoning_vault(state)
        found = {i: await vault.recall(ids) for i, ids in turns.items()}
    except Exception as exc:
        log.warning("could not restore the analysis of earlier tool calls: %s", exc)
        return {}
    return {i: text for i, text in found.items() if text}


def wants_encrypted_reasoning(include: Any) -> bool:
    return ENCRYPTED_INCLUDE in (include or ())


async def vault_for(state: Any, include: Any, *item_lists: Iterable[Any]) -> ReasoningVault | None:
    """The vault when a Responses request needs it: it asks for encrypted reasoning, or replays some."""
    needed = wants_encrypted_reasoning(include) or any(
        isinstance(item, dict)
        and item.get("type") == "reasoning"
        and item.get("encrypted_content") is not None
        for items in item_lists
        for item in items
    )
    return await reasoning_vault(state) if needed else None


__all__ = [
    "ENCRYPTED_INCLUDE",
    "RECALL_TTL_SECONDS",
    "ReasoningVault",
    "reasoning_vault",
    "recall_analyses",
    "turn_remembering",
    "vault_for",
    "wants_encrypted_reasoning",
]
