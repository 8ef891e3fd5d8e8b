"""Reasoning that survives the turn for stateless clients, bound to the tenant it was produced for.

gpt-oss is trained to see the current turn's analysis until the turn ends in a final answer; clients that
keep no server state lose it between tool calls unless they can send it back. `ReasoningVault` gives them
three ways, all under one gateway key and all bound to the tenant (`ctx.owner`, "" on an open gateway)
the vault was opened for (`reasoning_vault(state, owner)`), so one tenant's values are worthless to another:

- Responses `include: ["reasoning.encrypted_content"]`: each reasoning item carries `encrypted_content`,
  the analysis text under AES-256-GCM whose associated data names the purpose, its version and the tenant
  (AEAD: a changed blob, or one sealed for another key or tenant, fails to open, which is a 400 naming the
  input param). Versioned `hg1.` + base64url(nonce || ciphertext || tag).
- Responses compaction items (`POST /v1/responses/compact`, `context_management`): the model's summary of
  a conversation, sealed the same way under a purpose of its own (`seal_summary`, `open_summary`).
- Chat Completions and Anthropic Messages clients that send the assistant's tool calls back without the
  reasoning: the analysis the gateway produced for a turn is kept in the storage under (tenant, each tool
  call id it issued) (`remember`), with a TTL, and restored by those ids for that tenant only (`recall`):
  a call id is no secret once a tenant has shown it to anyone, so the id alone is not a key. Storage is
  shared, so any replica restores it; what the client sends always wins.
- Anthropic `thinking` blocks carry a `signature`: `hgt1.` + HMAC-SHA256 over the tenant and the thinking
  text. A block sent back with a signature of that form must verify for the tenant (else 400 naming it);
  other signatures (none, another provider's) mark the client's own thinking and are rendered as such.

The key comes from `--reasoning-key-file`, HARMONY_GATEWAY_REASONING_KEY or `--reasoning-key` (any
string, stretched with SHA-256); without one, 32 random bytes are generated once and kept in the storage
(`add_value`, first writer wins), so restarts and replicas on the same storage share it. Encryption and
signing keys are derived from it separately (HMAC-SHA256 with distinct labels); `subkey` derives keys for
other uses of the gateway key (MCP approval request ids) the same way.
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
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest
from ..harmony import token_parser as tp
from .context import FinishedChoice, GatewayState

log = logging.getLogger(__name__)

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
KEY_NAME = "gateway:reasoning-key"
#: How long the analysis behind an issued tool call stays restorable.
RECALL_TTL_SECONDS = 24 * 3600.0
#: Longest analysis kept for restoring (characters); longer ones are cut from the front.
MAX_RECALL_CHARS = 64_000
_PREFIX = "hg1."
#: What a thinking signature made by this gateway starts with (`ReasoningVault.sign`).
SIGNATURE_PREFIX = "hgt1."
_NONCE = 12
# Purpose and version of each tenant-bound value: the same tenant's encrypted_content, thinking signature
# and reasoning record are never interchangeable, and a later format can change without colliding.
_SEAL_PURPOSE = b"harmony-gateway encrypted_content v2"
_SIGN_PURPOSE = b"harmony-gateway thinking signature v2"
_RECALL_PURPOSE = b"harmony-gateway reasoning record v2"
_SUMMARY_PURPOSE = b"harmony-gateway compaction summary v1"


class ReasoningVault:
    """Seals, opens and signs reasoning for one tenant (`owner`) with the gateway key; remembers analyses
    in `store` under (tenant, tool call id). Everything it makes is worthless to another tenant's vault."""

    def __init__(self, key: bytes, store: Any, *, owner: str) -> None:
        self._encrypt_key = hmac.new(key, b"encrypt", hashlib.sha256).digest()
        self._aead: Any = None
        self._mac_key = hmac.new(key, b"sign", hashlib.sha256).digest()
        self._key = key
        self._store = store
        self._owner = owner

    def subkey(self, purpose: bytes) -> bytes:
        """A key for another use of the gateway key, independent of the reasoning keys: HMAC-SHA256 of
        `purpose` (a label no other use shares) under the gateway key."""
        return hmac.new(self._key, purpose, hashlib.sha256).digest()

    # -- encrypted_content ------------------------------------------------------------------------
    def _cipher(self) -> Any:
        if self._aead is None:
            # lazy: cryptography (~7 MB of native code) only once a reasoning item is sealed or opened
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM

            self._aead = AESGCM(self._encrypt_key)
        return self._aead

    def seal(self, text: str) -> str:
        """A reasoning item's `encrypted_content`: its analysis text, sealed for this tenant."""
        return self._seal(text, _SEAL_PURPOSE)

    def open(self, sealed: Any, *, param: str) -> str:
        """The analysis text in `sealed`; InvalidRequest naming `param` if it was not sealed with this key
        for this tenant."""
        return self._open(sealed, _SEAL_PURPOSE, param)

    def seal_summary(self, text: str) -> str:
        """A compaction item's `encrypted_content`: the model's summary of a conversation, sealed for this
        tenant under a purpose of its own (a reasoning blob never opens as a summary, nor the reverse)."""
        return self._seal(text, _SUMMARY_PURPOSE)

    def open_summary(self, sealed: Any, *, param: str) -> str:
        """The summary in a compaction item's `sealed` content; InvalidRequest naming `param` if it was not
        sealed as a summary with this key for this tenant."""
        return self._open(sealed, _SUMMARY_PURPOSE, param)

    def _seal(self, text: str, purpose: bytes) -> str:
        nonce = os.urandom(_NONCE)
        blob = nonce + self._cipher().encrypt(nonce, text.encode(), self._bound(purpose))
        return _PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("=")

    def _open(self, sealed: Any, purpose: bytes, param: str) -> str:
        if not isinstance(sealed, str) or not sealed.startswith(_PREFIX):
            raise InvalidRequest("encrypted_content was not produced by this gateway", param=param)
        cipher = self._cipher()
        from cryptography.exceptions import InvalidTag  # lazy: loaded with the cipher just above

        try:
            raw = base64.urlsafe_b64decode(sealed[len(_PREFIX) :] + "=" * (-len(sealed) % 4))
            text: bytes = cipher.decrypt(raw[:_NONCE], raw[_NONCE:], self._bound(purpose))
            return text.decode()
        except (InvalidTag, ValueError, binascii.Error, UnicodeDecodeError):
            raise InvalidRequest(
                "encrypted_content could not be decrypted: it was changed, sealed with another key, "
                "or issued to another API key",
                param=param,
            ) from None

    # -- Anthropic thinking signatures ------------------------------------------------------------
    def sign(self, text: str) -> str:
        mac = hmac.new(self._mac_key, self._bound(_SIGN_PURPOSE) + text.encode(), hashlib.sha256)
        return SIGNATURE_PREFIX + base64.urlsafe_b64encode(mac.digest()).decode().rstrip("=")

    def verify(self, text: str, signature: Any) -> bool:
        return isinstance(signature, str) and hmac.compare_digest(self.sign(text), signature)

    # -- restoring by tool call id ----------------------------------------------------------------
    async def remember(self, call_ids: Iterable[str], analysis: str) -> None:
        if not analysis:
            return
        value = {"analysis": analysis[-MAX_RECALL_CHARS:]}
        expires = time.time() + RECALL_TTL_SECONDS
        for call_id in call_ids:
            await self._store.put_value(self._record_key(call_id), value, expires_at=expires)

    async def recall(self, call_ids: Iterable[str]) -> str | None:
        """The analysis remembered for this tenant under the first of `call_ids` that has one."""
        now = time.time()
        for call_id in call_ids:
            found = await self._store.get_value(self._record_key(call_id), now=now)
            if found is not None:
                return str(found.get("analysis") or "") or None
        return None

    def _bound(self, purpose: bytes) -> bytes:
        """`purpose` and the tenant, each length-prefixed so no (tenant, value) pair reads as another."""
        owner = self._owner.encode()
        return b"".join(len(part).to_bytes(4, "big") + part for part in (purpose, owner))

    def _record_key(self, call_id: str) -> str:
        # Stored hashed: the storage never holds a usable call id, and one tenant's record cannot be found
        # (or overwritten) under another tenant's key for the same id.
        digest = hashlib.sha256(self._bound(_RECALL_PURPOSE) + call_id.encode())
        return "reasoning:" + digest.hexdigest()


_keys: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()
_locks: weakref.WeakKeyDictionary[Any, asyncio.Lock] = weakref.WeakKeyDictionary()


async def reasoning_vault(state: GatewayState, owner: str) -> ReasoningVault:
    """The vault of tenant `owner` (`ctx.owner`). The gateway key is read once per gateway, on first use:
    a generated key may have to be read from the storage."""
    key = _keys.get(state)
    if key is None:
        async with _locks.setdefault(state, asyncio.Lock()):
            key = _keys.get(state)
            if key is None:
                key = _keys[state] = await _gateway_key(state)
    return ReasoningVault(key, state.store, owner=owner)


async def _gateway_key(state: GatewayState) -> bytes:
    configured = state.settings.reasoning_key
    if configured:
        return hashlib.sha256(configured.encode()).digest()
    fresh = base64.b64encode(os.urandom(32)).decode()
    stored = await state.store.add_value(KEY_NAME, {"key": fresh})
    return base64.b64decode(stored["key"])


def turn_remembering(state: GatewayState, owner: str) -> Callable[[FinishedChoice], Awaitable[None]]:
    """The `PreparedRequest.after_turn` hook of Chat and Messages requests: once a choice has finished,
    keep the analysis of a turn that called tools under tenant `owner` and the call ids it issued.
    Storage trouble is logged, never fails the response."""

    async def remember_turn(choice: FinishedChoice) -> None:
        parser = choice.parser
        if not isinstance(parser, tp.HarmonyOutputParser) or not parser.messages:
            return  # text output (HTTP upstreams, other models): no issued call ids
        messages = parser.messages
        calls = [m.call_id for m in messages if m.kind == tp.FUNCTION_CALL and m.call_id]
        analysis = "\n".join(
            m.text for m in messages if m.kind == tp.REASONING and not m.recipient and m.text
        )
        if not calls or not analysis:
            return
        try:
            await (await reasoning_vault(state, owner)).remember(calls, analysis)
        except Exception as exc:
            log.warning("could not keep the analysis of tool calls %s: %s", calls, exc)

    return remember_turn


@dataclass(frozen=True, slots=True)
class AssistantTurn:
    """What restoring reasoning needs of one assistant message of a request's history, whatever its wire:
    its position, the call ids it issued, whether it holds answer text, and whether the client sent its
    reasoning back."""

    index: int
    call_ids: list[str]
    answers: bool
    has_reasoning: bool


def restorable_turns(turns: Iterable[AssistantTurn]) -> dict[int, list[str]]:
    """Tool-call turns whose analysis the model still needs but the client did not send, by index, with
    their call ids: those after the last final answer (Harmony drops older analysis anyway)."""
    found: dict[int, list[str]] = {}
    for turn in turns:
        if not turn.call_ids:
            if turn.answers:
                found.clear()  # a final answer: the analysis before it is dropped
            continue
        if not turn.has_reasoning:
            found[turn.index] = turn.call_ids
    return found


#: Bounds on the storage lookups restoring one request's reasoning (`recall_analyses`).
MAX_RECALLED_TURNS = 256
RECALL_IDS_PER_TURN = 4


async def recall_analyses(state: GatewayState, owner: str, turns: dict[int, list[str]]) -> dict[int, str]:
    """Analysis remembered for tenant `owner` per assistant turn (index → text), for turns given as
    index → their call ids. At most the newest `MAX_RECALLED_TURNS` turns are looked up, by their first
    `RECALL_IDS_PER_TURN` ids: a turn's analysis is kept under each of its ids, and a request is not
    free to make one storage lookup per call it lists."""
    if not turns:
        return {}
    newest = sorted(turns)[-MAX_RECALLED_TURNS:]
    try:
        vault = await reasoning_vault(state, owner)
        found = {i: await vault.recall(turns[i][:RECALL_IDS_PER_TURN]) for i in newest}
    except Exception as exc:
        log.warning("could not restore the analysis of earlier tool calls: %s", exc)
        return {}
    return {i: text for i, text in found.items() if text}


def wants_encrypted_reasoning(include: Any) -> bool:
    return ENCRYPTED_INCLUDE in (include or ())


#: Responses item types whose `encrypted_content` this gateway sealed.
_SEALED_ITEMS = frozenset({"reasoning", "compaction"})


async def vault_for(
    state: GatewayState, owner: str, include: Any, *item_lists: Iterable[Any]
) -> ReasoningVault | None:
    """Tenant `owner`'s vault when a Responses request needs it: it asks for encrypted reasoning, or
    replays some, or a compaction item."""
    needed = wants_encrypted_reasoning(include) or any(
        isinstance(item, dict)
        and item.get("type") in _SEALED_ITEMS
        and item.get("encrypted_content") is not None
        for items in item_lists
        for item in items
    )
    return await reasoning_vault(state, owner) if needed else None


__all__ = [
    "ENCRYPTED_INCLUDE",
    "RECALL_TTL_SECONDS",
    "SIGNATURE_PREFIX",
    "ReasoningVault",
    "reasoning_vault",
    "recall_analyses",
    "turn_remembering",
    "vault_for",
    "wants_encrypted_reasoning",
]
