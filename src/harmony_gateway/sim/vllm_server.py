"""The `vllm.grpc.engine.VllmEngine` servicer of the simulated engine.

Mirrors `smg_grpc_servicer/vllm/servicer.py` (vLLM runs with `output_kind=DELTA` when streaming):
- stream: per step one `GenerateStreamChunk` with the NEW `token_ids` and `completion_tokens` equal to the
  number of tokens in this chunk (a delta count, not cumulative); when a choice finishes, a
  `GenerateComplete` follows whose `output_ids` are that last delta again and whose `completion_tokens` is
  the delta's length. Clients accumulate both ids and counts from the chunks.
- non-stream: one Complete per choice with every id and the total count.
- `matched_token_id` is set only for a stop listed in `stop_token_ids`: vLLM checks the model's primary EOS
  (`<|return|>` for gpt-oss) first and then reports no stop reason.
- `GenerateResponse` carries no request id; `Abort` takes several ids and answers an empty message.
- PD uses `kv_transfer_params_json`: a prefill-mode sim answers with the params a decode worker needs.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from .kv_relay import scheduler_load
from .server import ChoicePlan, PromptRejected, ReceivedRequest, parse_kv_transfer_params
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

SERVICE_NAME = "vllm.grpc.engine.VllmEngine"
_VERSION = "sim-0.1"
_ALL_LOGPROBS = 5  # `logprobs=-1` means "all"; a handful is enough for a fake vocabulary


def output_logprobs(tokens: list[int], first_position: int, top: int) -> pb.OutputLogProbs:
    return fake_output_logprobs(pb, tokens, first_position, top)


class SimVllmEngine(SimServicer, pb_grpc.VllmEngineServicer):
    """VllmEngine over a `SimCore`; RPCs it does not simulate answer UNIMPLEMENTED."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request.WhichOneof("input") != "tokenized":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the simulated engine needs tokenized input"
            )
        ids = list(request.tokenized.input_ids)
        sp = request.sampling_params
        received = ReceivedRequest(
            metadata={k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)},
            request_id=request.request_id,
            input_ids=ids,
            sampling=MessageToDict(sp, preserving_proto_field_name=True),
            stream=request.stream,
            return_logprob=sp.HasField("logprobs"),
            top_logprobs_num=max(sp.logprobs, 0) if sp.HasField("logprobs") else 0,
        )
        try:
            received.kv_transfer_params = self._kv_params(request)
        except PromptRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        async with admitted(self._core, received, context) as run:
            async for response in self._generate(request, run, ids):
                yield response

    @staticmethod
    def _kv_params(request: pb.GenerateRequest) -> dict[str, Any] | None:
        if request.HasField("kv_transfer_params_json"):
            return parse_kv_transfer_params(request.kv_transfer_params_json)
        if request.HasField("kv_transfer_params"):
            legacy = request.kv_transfer_params
            return {"remote_host": legacy.remote_host, "remote_port": legacy.remote_port}
        return None

    async def _generate(
        self, request: pb.GenerateRequest, run: Run, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        core = self._core
        config = core.config
        sp = request.sampling_params
        prompt_tokens = len(ids)
        if config.mode == "prefill":
            await wait_prefill(run, config, prompt_tokens)
            cached = run.cached_tokens
            block = config.block_size
            handoff = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": f"sim-{config.host}-{config.bootstrap_port}",
                "remote_host": config.host,
                "remote_port": config.bootstrap_port,
                "remote_block_ids": list(range((prompt_tokens + block - 1) // block)),
                "tp_size": 1,
            }
            if request.stream:
                chunk = pb.GenerateStreamChunk(prompt_tokens=prompt_tokens, cached_tokens=cached)
                yield pb.GenerateResponse(chunk=chunk)
            complete = pb.GenerateComplete(
                finish_reason="stop",
                prompt_tokens=prompt_tokens,
                cached_tokens=cached,
                kv_transfer_params_json=json.dumps(handoff, separators=(",", ":")),
            )
            yield pb.GenerateResponse(complete=complete)
            return
        plans = core.plan(
            ids,
            n=sp.n,
            max_new_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
            eos_is_matched=False,
        )
        want_logprobs = sp.HasField("logprobs")
        top = (_ALL_LOGPROBS if sp.logprobs < 0 else sp.logprobs) if want_logprobs else 0
        if request.stream:
            await run.start(plans, every_token=config.tokens_per_chunk == 1)
            cached = run.cached_tokens
            async for step in run.stream_steps(plans, config.tokens_per_chunk):
                plan = step.plan
                tokens = plan.visible(step.start, step.end)
                logprobs = output_logprobs(tokens, step.start, top) if want_logprobs else None
                generated = step.end - step.start
                chunk = pb.GenerateStreamChunk(
                    token_ids=tokens,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=generated,
                    cached_tokens=cached,
                    output_logprobs=logprobs,
                    index=plan.index,
                )
                yield pb.GenerateResponse(chunk=chunk)
                if step.last:
                    yield self._complete(plan, tokens, generated, prompt_tokens, cached, logprobs)
            for plan in plans:
                if not plan.done:
                    # An aborted request still ends with an (empty) output and its finished record.
                    chunk = pb.GenerateStreamChunk(
                        prompt_tokens=prompt_tokens, cached_tokens=cached, index=plan.index
                    )
                    yield pb.GenerateResponse(chunk=chunk)
                    yield self._aborted(plan, prompt_tokens, cached)
            return
        await run.wait_whole(plans)
        cached = run.cached_tokens
        for plan in plans:
            if run.aborted:
                yield self._aborted(plan, prompt_tokens, cached)
                continue
            tokens = plan.visible_ids
            logprobs = output_logprobs(tokens, 0, top) if want_logprobs else None
            yield self._complete(plan, tokens, len(plan.ids), prompt_tokens, cached, logprobs)

    @staticmethod
    def _complete(
        plan: ChoicePlan,
        tokens: list[int],
        completion_tokens: int,
        prompt_tokens: int,
        cached: int,
        logprobs: pb.OutputLogProbs | None,
    ) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=tokens,
            finish_reason=plan.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached,
            output_logprobs=logprobs,
            index=plan.index,
        )
        if plan.matched_token_id is not None:
            complete.matched_token_id = plan.matched_token_id
        return pb.GenerateResponse(complete=complete)

    @staticmethod
    def _aborted(plan: ChoicePlan, prompt_tokens: int, cached: int) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            finish_reason="abort", prompt_tokens=prompt_tokens, cached_tokens=cached, index=plan.index
        )
        return pb.GenerateResponse(complete=complete)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        for request_id in request.request_ids:
            self._core.abort(request_id)
        return pb.AbortResponse()

    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HealthCheckResponse:
        healthy = self._core.healthy
        return pb.HealthCheckResponse(healthy=healthy, message="Health" if healthy else "Engine is not alive")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        config = self._core.config
        return pb.GetModelInfoResponse(**model_info_fields(config))

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        core = self._core
        config = core.config
        pd = config.mode != "regular"
        return pb.GetServerInfoResponse(
            active_requests=core.active,
            is_paused=False,
            last_receive_timestamp=core.last_receive,
            uptime_seconds=time.time() - core.started_at,
            server_type="vllm-grpc",
            kv_connector="NixlConnector" if pd else "",
            kv_role={"prefill": "kv_producer", "decode": "kv_consumer"}.get(config.mode, ""),
            kv_engine_id=f"sim-{config.host}-{config.bootstrap_port}" if pd else "",
            data_parallel_size=1,
            max_num_seqs=config.max_running_requests,
        )

    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetLoadsResponse:
        figures = self._core.figures()
        load = scheduler_load(pb, figures, "vllm")
        return pb.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(), version=_VERSION, dp_rank_count=1, loads=[load]
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


def add_to_server(servicer: SimVllmEngine, server: grpc.aio.Server) -> None:
    add_with_raw_streams(
        pb_grpc.add_VllmEngineServicer_to_server, servicer, server, SERVICE_NAME, KV_EVENT_STREAM
    )


__all__ = ["SERVICE_NAME", "SimVllmEngine", "add_to_server", "output_logprobs"]
