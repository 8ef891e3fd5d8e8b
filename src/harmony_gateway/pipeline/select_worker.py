"""Stage 2, select: choose a worker (or a prefill/decode pair) for a prepared request with the model
group's routing policy. Raises NoHealthyWorker when the pool has no available worker."""

from __future__ import annotations

from collections.abc import Collection

from ..errors import NoHealthyWorker
from ..observability.tracing import traced
from ..routing.policy import RoutingPolicy, RoutingRequest
from ..routing.workers import Worker
from .context import PreparedRequest, RequestContext


def routing_request(prepared: PreparedRequest, ctx: RequestContext) -> RoutingRequest:
    return RoutingRequest(
        model=prepared.group.name,
        input_ids=prepared.input_ids,
        selection_text=prepared.selection_text,
        routing_key=ctx.routing_key,
        request_id=ctx.engine_id,
        cache_key=ctx.prompt_cache_key,
        tenant=ctx.owner,
    )


def _pick(
    policy: RoutingPolicy | None, pool: list[Worker], request: RoutingRequest, exclude: Collection[Worker]
) -> Worker:
    candidates = [w for w in pool if w not in exclude] if exclude else pool
    if not candidates or policy is None:
        raise NoHealthyWorker(f"no healthy worker serves model {request.model!r}")
    return policy.select(candidates, request)


@traced("gateway.route")
def select_worker(
    prepared: PreparedRequest, ctx: RequestContext, exclude: Collection[Worker] = ()
) -> tuple[Worker, Worker | None]:
    """Return (worker, prefill_worker): in PD mode the first is the decode worker."""
    group = prepared.group
    request = routing_request(prepared, ctx)
    if group.disaggregated:
        prefill = _pick(group.prefill_policy, group.prefill, request, exclude)
        decode = _pick(group.decode_policy, group.decode, request, exclude)
        return decode, prefill
    return _pick(group.policy, group.regular, request, exclude), None
