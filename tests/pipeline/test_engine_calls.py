"""One engine request id names one engine call: a request's first call keeps its engine id, every later
call (a retry, the next generation of a tool loop) gets a new one of the same client id."""

from __future__ import annotations

import dataclasses

from harmony_gateway.pipeline.context import RequestContext
from tests.support.servers import client_request_id


def test_each_engine_call_of_a_request_has_its_own_id() -> None:
    ctx = RequestContext(request_id="client-id", route="chat")
    first = ctx.engine_id
    ids = [ctx.next_engine_id() for _ in range(3)]
    assert ids[0] == first
    assert len(set(ids)) == 3 and ctx.engine_id == ids[-1]
    assert {client_request_id(i) for i in ids} == {"client-id"}


def test_a_child_context_starts_its_own_calls_with_its_own_id() -> None:
    ctx = RequestContext(request_id="client-id", route="chat")
    ctx.next_engine_id()
    child = dataclasses.replace(ctx, engine_id=f"{ctx.engine_id}-answer0", engine_calls=0)
    assert child.next_engine_id() == f"{ctx.engine_id}-answer0"
