"""Reasoning records on every storage backend: the analysis kept under a tool call id is found only by the
tenant it was kept for (`ReasoningVault.remember` / `recall`)."""

from __future__ import annotations

from harmony_gateway.pipeline.reasoning_store import ReasoningVault
from harmony_gateway.storage import Store

KEY = b"k" * 32


async def test_a_call_id_recalls_only_for_its_tenant(store: Store) -> None:
    alice = ReasoningVault(KEY, store, owner="owner-alice")
    bob = ReasoningVault(KEY, store, owner="owner-bob")
    await alice.remember(["call_shared"], "alice's analysis")
    assert await bob.recall(["call_shared"]) is None
    await bob.remember(["call_shared"], "bob's analysis")  # the same id does not overwrite alice's record
    assert await alice.recall(["call_shared"]) == "alice's analysis"
    assert await bob.recall(["call_shared"]) == "bob's analysis"


async def test_the_open_gateway_tenant_is_a_tenant_too(store: Store) -> None:
    keyed = ReasoningVault(KEY, store, owner="owner-alice")
    await keyed.remember(["call_x"], "alice's analysis")
    assert await ReasoningVault(KEY, store, owner="").recall(["call_x"]) is None
