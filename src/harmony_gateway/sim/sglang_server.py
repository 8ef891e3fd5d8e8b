"""The `sglang.grpc.scheduler.SglangScheduler` servicer of the simulated engine.

Mirrors `smg_grpc_servicer/sglang/servicer.py`: stream mode sends one `GenerateStreamChunk` per step
(`token_ids` new, counts cumulative) and, after a choice's last chunk, a `GenerateComplete` whose
`output_ids` repeat that chunk's tokens; non-stream sends one Complete per choice with every id. Errors
are gRPC status codes (INVALID_ARGUMENT for a bad request). Behaviour beyond the wire lives in `SimCore`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from .kv_relay import scheduler_load, varint
from .server import ChoicePlan, ReceivedRequest, chunk_spans
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

if TYPE_CHECKING:
    from .server import Run

SERVICE_NAME = "sglang.grpc.scheduler.SglangScheduler"
_VERSION = "sim-0.1"


def output_logprobs(tokens: list[int], first_position: int, top: int) -> pb.OutputLogProbs:
    return fake_output_logprobs(pb, tokens, first_position, top)


class SimSglangScheduler(SimServicer, pb_grpc.SglangSchedulerServicer):
    """SglangScheduler over a `SimCore`; RPCs it does not simulate answer UNIMPLEMENTED."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse | bytes]:
        ids = list(request.tokenized.input_ids)
        received = ReceivedRequest(
            metadata={k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)},
            request_id=request.request_id,
            input_ids=ids,
            sampling=MessageToDict(request.sampling_params, preserving_proto_field_name=True),
            stream=request.stream,
            return_logprob=request.return_logprob,
            top_logprobs_num=request.top_logprobs_num,
        )
        if request.HasField("disaggregated_params"):
            params = request.disaggregated_params
            received.bootstrap_host = params.bootstrap_host or None
            received.bootstrap_port = params.bootstrap_port or None
            received.bootstrap_room = params.bootstrap_room  # room 0 is a valid room
        async with admitted(self._core, received, context) as run:
            async for response in self._generate(request, run, ids):
                yield response

    async def _generate(
        self, request: pb.GenerateRequest, run: Run, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse | bytes]:
        core = self._core
        config = core.config
        rid = request.request_id
        sp = request.sampling_params
        prompt_tokens = len(ids)
        if config.mode == "prefill":
            await wait_prefill(run, config, prompt_tokens)
            cached = run.cached_tokens
            complete = pb.GenerateComplete(
                finish_reason="stop", prompt_tokens=prompt_tokens, cached_tokens=cached
            )
            if request.stream:
                chunk = pb.GenerateStreamChunk(prompt_tokens=prompt_tokens, cached_tokens=cached)
                yield pb.GenerateResponse(request_id=rid, chunk=chunk)
            yield pb.GenerateResponse(request_id=rid, complete=complete)
            return
        plans = core.plan(
            ids,
            n=sp.n,
            max_new_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
        )
        top = request.top_logprobs_num if request.return_logprob else 0
        want_logprobs = request.return_logprob
        if request.stream:
            interval = sp.stream_interval if sp.HasField("stream_interval") else 0
            size = max(1, interval if interval > 0 else config.tokens_per_chunk)
            # SGLang sends a request's first token at once, then one message per `stream_interval`.
            first_alone = interval > 0
            await run.start(plans, every_token=size == 1)
            cached = run.cached_tokens
            if not want_logprobs:
                # Pre-serialized frames: a GenerateResponse body without field 1 (request_id) plus that
                # field's bytes is the whole message, because concatenated protobuf messages merge.
                raw_id = rid.encode()
                prefix = b"\x0a" + varint(len(raw_id)) + raw_id
                frames = {
                    plan.index: self._frames(plan, size, first_alone, prompt_tokens, cached) for plan in plans
                }
                async for step in run.stream_steps(plans, size, first_alone=first_alone):
                    chunks, complete_frame = frames[step.plan.index]
                    yield prefix + chunks[step.start]
                    if step.last:
                        yield prefix + complete_frame
            else:
                async for step in run.stream_steps(plans, size, first_alone=first_alone):
                    plan = step.plan
                    tokens = plan.visible(step.start, step.end)
                    logprobs: pb.OutputLogProbs | None = output_logprobs(tokens, step.start, top)
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
                        # Real SGLang builds the Complete from the same engine output as the last chunk.
                        yield self._complete(rid, plan, tokens, prompt_tokens, cached, logprobs)
        else:
            await run.wait_whole(plans)
            cached = run.cached_tokens
            if not run.aborted:
                for plan in plans:
                    plan.done = True
                    plan.sent = len(plan.ids)
                    tokens = plan.visible_ids
                    logprobs = output_logprobs(tokens, 0, top) if want_logprobs else None
                    yield self._complete(rid, plan, tokens, prompt_tokens, cached, logprobs)
        for plan in plans:
            if not plan.done:
                yield pb.GenerateResponse(
                    request_id=rid,
                    complete=pb.GenerateComplete(
                        finish_reason="abort",
                        prompt_tokens=prompt_tokens,
                        completion_tokens=plan.sent,
                        cached_tokens=cached,
                        index=plan.index,
                    ),
                )

    def _frames(
        self, plan: ChoicePlan, size: int, first_alone: bool, prompt_tokens: int, cached: int
    ) -> tuple[dict[int, bytes], bytes]:
        key = (
            "sglang",
            tuple(plan.ids),
            plan.index,
            plan.finish_reason,
            plan.matched_token_id,
            plan.hide_last,
            size,
            first_alone,
            prompt_tokens,
            cached,
        )
        return self._core.frames.get(
            key, lambda: self._build_frames(plan, size, first_alone, prompt_tokens, cached)
        )

    def _build_frames(
        self, plan: ChoicePlan, size: int, first_alone: bool, prompt_tokens: int, cached: int
    ) -> tuple[dict[int, bytes], bytes]:
        """Serialized chunk messages by the start of their span, and the closing message."""
        chunks: dict[int, bytes] = {}
        tokens: list[int] = []
        for start, end in chunk_spans(len(plan.ids), size, first_alone=first_alone):
            tokens = plan.visible(start, end)
            chunk = pb.GenerateStreamChunk(
                token_ids=tokens,
                prompt_tokens=prompt_tokens,
                completion_tokens=end,
                cached_tokens=cached,
                index=plan.index,
            )
            chunks[start] = pb.GenerateResponse(chunk=chunk).SerializeToString()
        complete = self._complete("", plan, tokens, prompt_tokens, cached, None).SerializeToString()
        return chunks, complete

    @staticmethod
    def _complete(
        rid: str,
        plan: ChoicePlan,
        tokens: list[int],
        prompt_tokens: int,
        cached: int,
        logprobs: pb.OutputLogProbs | None,
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
        state = "aborted" if found else "not found"
        return pb.AbortResponse(success=found, message=f"Request {request.request_id} {state}")

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:
        healthy = self._core.healthy
        return pb.HealthCheckResponse(healthy=healthy, message="ok" if healthy else "simulated unhealthy")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        config = self._core.config
        return pb.GetModelInfoResponse(
            **model_info_fields(config), preferred_sampling_params="", weight_version="sim"
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        core = self._core
        config = core.config
        server_args = Struct()
        server_args.update(
            {
                # SGLang spells "no disaggregation" as "null".
                "disaggregation_mode": "null" if config.mode == "regular" else config.mode,
                "disaggregation_bootstrap_port": config.bootstrap_port,
                "model_path": config.model,
                "served_model_name": config.model,
                "context_length": config.max_context_length,
                "page_size": config.block_size,
                "max_running_requests": config.max_running_requests,
                "max_total_tokens": config.kv_capacity_tokens,
            }
        )
        if core.relay is not None:
            server_args.update({"kv_events_config": '{"publisher": "zmq"}'})
        return pb.GetServerInfoResponse(
            server_args=server_args,
            active_requests=core.active,
            is_paused=False,
            last_receive_timestamp=core.last_receive,
            uptime_seconds=time.time() - core.started_at,
            sglang_version=_VERSION,
            server_type="grpc",
            max_total_num_tokens=core.cache.capacity_blocks * config.block_size,
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetLoadsResponse:
        figures = self._core.figures()
        load = scheduler_load(pb, figures, "sglang")
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=_VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=figures.running,
                total_waiting_reqs=figures.waiting,
                total_reqs=figures.running + figures.waiting,
                avg_token_usage=load.token_usage,
                avg_throughput=figures.gen_throughput,
                avg_utilization=load.token_usage,
            ),
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in tokenizer_chunks(self._core, context):
            yield chunk

    _unimplemented = SimServicer._unimplemented
    Embed = _unimplemented
    StartProfile = _unimplemented
    StopProfile = _unimplemented
    LoadLoRAAdapter = _unimplemented
    UnloadLoRAAdapter = _unimplemented
    ListLoadedLoRAAdapters = _unimplemented


def add_to_server(servicer: SimSglangScheduler, server: grpc.aio.Server) -> None:
    """Register like the generated helper, but Generate and SubscribeKvEvents may also yield
    pre-serialized frames."""
    add_with_raw_streams(
        pb_grpc.add_SglangSchedulerServicer_to_server,
        servicer,
        server,
        SERVICE_NAME,
        {"Generate": pb.GenerateRequest.FromString, **KV_EVENT_STREAM},
    )


__all__ = ["SERVICE_NAME", "SimSglangScheduler", "add_to_server", "output_logprobs"]
