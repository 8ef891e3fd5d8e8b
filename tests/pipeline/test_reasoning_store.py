"""`ReasoningVault`: AEAD sealing of reasoning, HMAC thinking signatures, restorable analyses with a TTL."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harmony_gateway.errors import InvalidRequest
from harmony_gateway.pipeline.reasoning_store import (
    KEY_NAME,
    MAX_RECALLED_TURNS,
    RECALL_IDS_PER_TURN,
    ReasoningVault,
    reasoning_vault,
    recall_analyses,
)
from harmony_gateway.storage.memory import MemoryStore

KEY = b"k" * 32


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_seal_open_round_trip(text: str) -> None:
    vault = ReasoningVault(KEY, MemoryStore(), owner="")
    sealed = vault.seal(text)
    assert sealed != vault.seal(text)  # a fresh nonce each time
    assert vault.open(sealed, param="p") == text


@pytest.mark.parametrize("blob", ["", "hg1.", "hg1.AAAA", "plain text", 42, None])
def test_junk_blobs_are_400_naming_the_param(blob: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        ReasoningVault(KEY, MemoryStore(), owner="").open(blob, param="input[3].encrypted_content")
    assert info.value.param == "input[3].encrypted_content"


def test_another_key_cannot_open_or_sign() -> None:
    mine, theirs = (
        ReasoningVault(KEY, MemoryStore(), owner=""),
        ReasoningVault(b"x" * 32, MemoryStore(), owner=""),
    )
    with pytest.raises(InvalidRequest):
        theirs.open(mine.seal("secret plan"), param="p")
    assert mine.verify("thought", mine.sign("thought"))
    assert not theirs.verify("thought", mine.sign("thought"))
    assert not mine.verify("thought", None)


async def test_remember_and_recall_by_call_id() -> None:
    store = MemoryStore()
    vault = ReasoningVault(KEY, store, owner="")
    await vault.remember(["call_a", "call_b"], "the analysis")
    assert await vault.recall(["call_x", "call_b"]) == "the analysis"
    assert await vault.recall(["call_x"]) is None
    await store.purge_expired(time.time() + 25 * 3600)  # past the TTL
    assert await vault.recall(["call_a"]) is None


@dataclass(eq=False)
class _Settings:
    reasoning_key: str | None = None


@dataclass(eq=False)
class _State:
    """The two fields of `GatewayState` the vault reads (one object per gateway process)."""

    store: Any
    settings: _Settings = field(default_factory=_Settings)


async def test_generated_key_is_kept_in_the_storage() -> None:
    store = MemoryStore()
    one = await reasoning_vault(_State(store), "")
    two = await reasoning_vault(_State(store), "")  # another process on the same storage
    assert two.open(one.seal("shared"), param="p") == "shared"
    assert await store.get_value(KEY_NAME, now=time.time()) is not None


def test_a_blob_or_signature_does_not_cross_tenants() -> None:
    store = MemoryStore()
    alice = ReasoningVault(KEY, store, owner="owner-alice")
    bob = ReasoningVault(KEY, store, owner="owner-bob")
    with pytest.raises(InvalidRequest) as info:
        bob.open(alice.seal("alice's plan"), param="input[1].encrypted_content")
    assert info.value.param == "input[1].encrypted_content" and "alice" not in info.value.message
    assert alice.open(alice.seal("alice's plan"), param="p") == "alice's plan"
    assert not bob.verify("thought", alice.sign("thought"))
    assert alice.verify("thought", alice.sign("thought"))


async def test_tenant_and_call_id_cannot_be_shifted_into_each_other() -> None:
    store = MemoryStore()
    await ReasoningVault(KEY, store, owner="ab").remember(["c"], "ab's analysis")
    assert await ReasoningVault(KEY, store, owner="a").recall(["bc"]) is None
    assert ReasoningVault(KEY, store, owner="a").sign("bc") != ReasoningVault(KEY, store, owner="ab").sign(
        "c"
    )


class _CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    async def get_value(self, key: str, *, now: float) -> dict[str, Any] | None:
        self.lookups += 1
        return await super().get_value(key, now=now)


async def test_restoring_a_request_costs_a_bounded_number_of_lookups() -> None:
    """A request listing 60,000 tool calls, in one turn or in as many, is not 60,000 storage lookups;
    the newest turns are still restored by any of their first ids."""
    store = _CountingStore()
    state = _State(store)
    vault = await reasoning_vault(state, "tenant")
    await vault.remember(["call_last"], "the newest analysis")
    store.lookups = 0
    one_turn = {1: [f"call_{i}" for i in range(60_000)]}
    assert await recall_analyses(state, "tenant", one_turn) == {}
    assert store.lookups <= RECALL_IDS_PER_TURN
    store.lookups = 0
    many_turns = {i: [f"call_{i}"] for i in range(60_000)}
    many_turns[60_000] = ["call_x", "call_last"]
    assert await recall_analyses(state, "tenant", many_turns) == {60_000: "the newest analysis"}
    assert store.lookups <= MAX_RECALLED_TURNS + 1
