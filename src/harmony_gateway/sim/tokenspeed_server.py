"""The `tokenspeed.grpc.scheduler.TokenSpeedScheduler` servicer of the simulated engine.

TokenSpeed's wire is SGLang's with other field numbers (see engines/tokenspeed_grpc.py); the simulator
streams as its SGLang servicer does (new ids per chunk, running counts, a stream-mode Complete that repeats
the last chunk's ids) and records PD rendezvous from `kv_bootstrap_info`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from .kv_relay import token_usage
from .server import ChoicePlan, ReceivedRequest, Run
from .servicer import (
    KV_EVENT_STREAM,
    SimServicer,
    add_with_raw_streams,
    admitted,
    fake_output_logprobs,
    model_info_fields,
    tokenizer_chunks,
    wait_prefill,
)

SERVICE_NAME = "tokenspeed.grpc.scheduler.TokenSpeedScheduler"


class SimTokenSpeedScheduler(SimServicer, pb_grpc.TokenSpeedSchedulerServicer):
    """TokenSpeedScheduler over a `SimCore`; RPCs it does not simulate answer UNIMPLEMENTED."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        ids = list(request.tokenized.input_ids)
        received = ReceivedRequest(
            request_id=request.request_id,
            input_ids=ids,
            sampling=MessageToDict(request.sampling_params, preserving_proto_field_name=True),
            stream=request.stream,
            return_logprob=request.return_logprob,
            top_logprobs_num=request.top_logprobs_num,
        )
        if request.HasField("kv_bootstrap_info"):
            info = request.kv_bootstrap_info
            received.bootstrap_host = info.bootstrap_host or None
            received.bootstrap_port = info.bootstrap_port or None
            received.bootstrap_room = info.bootstrap_room
        async with admitted(self._core, received, context) as run:
            async for response in self._generate(request, run, ids):
                yield response

    async def _generate(
        self, request: pb.GenerateRequest, run: Run, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        core = self._core
        config = core.config
        rid = request.request_id
        sp = request.sampling_params
        prompt_tokens = len(ids)
        if config.mode == "prefill":
            await wait_prefill(run, config, prompt_tokens)
            cached = run.cached_tokens
            yield pb.GenerateResponse(
                request_id=rid,
                complete=pb.GenerateComplete(
                    finish_reason="stop", prompt_tokens=prompt_tokens, cached_tokens=cached
                ),
            )
            return
        plans = core.plan(
            ids,
            n=sp.n,
            max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
        )
        want = request.return_logprob
        top = request.top_logprobs_num if want else 0
        if request.stream:
            await run.start(plans, every_token=config.tokens_per_chunk == 1)
            cached = run.cached_tokens
            async for step in run.stream_steps(plans, config.tokens_per_chunk):
                plan = step.plan
                tokens = plan.visible(step.start, step.end)
                logprobs = fake_output_logprobs(pb, tokens, step.start, top) if want else None
                chunk = pb.GenerateStreamChunk(
                    token_ids=tokens,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=step.end,
                    cached_tokens=cached,
                    output_logprobs=logprobs,
                    index=plan.index,
                )
                yield pb.GenerateResponse(request_id=rid, chunk=chunk)
                if step.last:
                    yield self._complete(rid, plan, tokens, prompt_tokens, cached, logprobs)
        else:
            await run.wait_whole(plans)
            cached = run.cached_tokens
            if not run.aborted:
                for plan in plans:
                    plan.done = True
                    tokens = plan.visible_ids
                    logprobs = fake_output_logprobs(pb, tokens, 0, top) if want else None
                    yield self._complete(rid, plan, tokens, prompt_tokens, cached, logprobs)
        for plan in plans:
            if not plan.done:
                yield pb.GenerateResponse(
                    request_id=rid,
                    complete=pb.GenerateComplete(
                        finish_reason="abort",
                        prompt_tokens=prompt_tokens,
                        cached_tokens=cached,
                        index=plan.index,
                    ),
                )

    @staticmethod
    def _complete(
        rid: str, plan: ChoicePlan, tokens: list[int], prompt_tokens: int, cached: int, logprobs: Any
    ) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason=plan.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(plan.ids),
            cached_tokens=cached,
            output_logprobs=logprobs,
            index=plan.index,
        )
        if plan.matched_token_id is not None:
            complete.matched_token_id = plan.matched_token_id
        return pb.GenerateResponse(request_id=rid, complete=complete)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        found = self._core.abort(request.request_id)
        return pb.AbortResponse(success=found, message="aborted" if found else "not found")

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:
        healthy = self._core.healthy
        return pb.HealthCheckResponse(healthy=healthy, message="ok" if healthy else "simulated unhealthy")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        keep = {f.name for f in pb.GetModelInfoResponse.DESCRIPTOR.fields}
        fields = model_info_fields(self._core.config)
        return pb.GetModelInfoResponse(**{k: v for k, v in fields.items() if k in keep})

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        core = self._core
        config = core.config
        server_args = Struct()
        server_args.update(
            {
                "disaggregation_mode": "null" if config.mode == "regular" else config.mode,
                "disaggregation_bootstrap_port": config.bootstrap_port,
                "served_model_name": config.model,
                "context_length": config.max_context_length,
                "page_size": config.block_size,
                "max_running_requests": config.max_running_requests,
            }
        )
        return pb.GetServerInfoResponse(
            server_args=server_args,
            active_requests=core.active,
            uptime_seconds=time.time() - core.started_at,
            tokenspeed_version="sim-0.1",
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetLoadsResponse:
        figures = self._core.figures()
        usage, active = token_usage(figures, "tokenspeed")
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=figures.running,
            num_waiting_reqs=figures.waiting,
            num_total_reqs=figures.running + figures.waiting,
            num_used_tokens=figures.used_tokens,
            max_total_num_tokens=figures.capacity_tokens,
            max_running_requests=figures.max_running_requests,
            num_waiting_uncached_tokens=figures.waiting_uncached_tokens,
            token_usage=usage,
            active_token_usage=active,
            gen_throughput=figures.gen_throughput,
            cache_hit_rate=figures.cache_hit_rate,
            utilization=usage,
        )
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version="sim-0.1", dp_rank_count=1, loads=[load]
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in tokenizer_chunks(self._core, context):
            yield chunk

    _unimplemented = SimServicer._unimplemented
    StartProfile = _unimplemented
    StopProfile = _unimplemented


def add_to_server(servicer: SimTokenSpeedScheduler, server: grpc.aio.Server) -> None:
    add_with_raw_streams(
        pb_grpc.add_TokenSpeedSchedulerServicer_to_server, servicer, server, SERVICE_NAME, KV_EVENT_STREAM
    )


__all__ = ["SERVICE_NAME", "SimTokenSpeedScheduler", "add_to_server"]
