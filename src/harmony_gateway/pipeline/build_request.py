"""Stage 3, build: the engine request for the chosen worker(s), with PD bootstrap fields."""

from __future__ import annotations

import random
from dataclasses import replace

from ..engines.base import BootstrapInfo, GenerateRequest
from ..routing.workers import Worker
from .context import PreparedRequest, RequestContext


def bootstrap_for(prefill: Worker, default_port: int) -> BootstrapInfo:
    """One random room shared by both sides; host and port are the prefill worker's."""
    host = prefill.url.split("://", 1)[-1].rsplit(":", 1)[0]
    port = prefill.bootstrap_port or default_port
    return BootstrapInfo(host=host, port=port, room=random.randrange(0, 2**31 - 1))


def build_generate_request(
    prepared: PreparedRequest,
    ctx: RequestContext,
    *,
    stream: bool,
    bootstrap: BootstrapInfo | None = None,
    input_ids: list[int] | None = None,
    stream_interval: int | None = None,
) -> GenerateRequest:
    sampling = prepared.sampling
    if stream and stream_interval and sampling.stream_interval is None:
        # Fewer, larger engine messages: each gRPC message costs a Python client far more than a token.
        sampling = replace(sampling, stream_interval=stream_interval)
    return GenerateRequest(
        request_id=ctx.engine_id,
        input_ids=prepared.input_ids if input_ids is None else input_ids,
        sampling=sampling,
        stream=stream,
        original_text=prepared.original_text,
        return_logprob=prepared.return_logprob,
        top_logprobs_num=prepared.top_logprobs,
        bootstrap=bootstrap,
        upstream_body=prepared.upstream_body,
    )
