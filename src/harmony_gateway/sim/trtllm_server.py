"""The `trtllm.TrtllmService` servicer of the simulated engine.

Mirrors the TRT-LLM wire (engines/trtllm_grpc.py): ids in `input_token_ids`, the budget in the required
`max_tokens`, `num_return_sequences` choices by `sequence_index`, chunks with new ids and running counts,
a stream-mode Complete with no ids. Stop tokens are left out of the output unless the request sets
`include_stop_token_in_output` (the trap smg#879 describes); only `stop_token_ids` and the model's end id
stop. `HealthCheck` answers a status string; `GetModelInfo` has no model type, architectures or EOS ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as pb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as pb_grpc

from .server import ChoicePlan, ReceivedRequest, Run, fake_logprob
from .servicer import KV_EVENT_STREAM, SimServicer, add_with_raw_streams, admitted, tokenizer_chunks

SERVICE_NAME = "trtllm.TrtllmService"


def _logprobs(tokens: list[int], first_position: int) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(token_id=t, logprob=fake_logprob(t, first_position + i)) for i, t in enumerate(tokens)
    ]


class SimTrtllmService(SimServicer, pb_grpc.TrtllmServiceServicer):
    """TrtllmService over a `SimCore`; RPCs it does not simulate answer UNIMPLEMENTED."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        ids = list(request.tokenized.input_token_ids)
        sampling = MessageToDict(request.sampling_config, preserving_proto_field_name=True)
        sampling.update(
            max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            stop=list(request.stop),
            include_stop_token_in_output=request.include_stop_token_in_output,
        )
        if request.HasField("guided_decoding"):
            sampling["guided_decoding"] = MessageToDict(
                request.guided_decoding, preserving_proto_field_name=True
            )
        want = request.output_config.HasField("logprobs")
        received = ReceivedRequest(
            request_id=request.request_id,
            input_ids=ids,
            sampling=sampling,
            stream=request.streaming,
            return_logprob=want,
            top_logprobs_num=max(request.output_config.logprobs, 0) if want else 0,
        )
        async with admitted(self._core, received, context) as run:
            async for response in self._generate(request, run, ids, want):
                yield response

    async def _generate(
        self, request: pb.GenerateRequest, run: Run, ids: list[int], want: bool
    ) -> AsyncIterator[pb.GenerateResponse]:
        core = self._core
        rid = request.request_id
        stops = list(request.stop_token_ids)
        if not request.ignore_eos:
            stops.append(core.config.primary_eos_id)
        plans = core.plan(
            ids,
            n=max(request.sampling_config.num_return_sequences, 1),
            max_new_tokens=request.max_tokens,
            stop_token_ids=stops,
            ignore_eos=True,
        )
        for plan in plans:
            plan.hide_last = plan.matched_token_id is not None and not request.include_stop_token_in_output
        prompt_tokens = len(ids)
        if request.streaming:
            await run.start(plans, every_token=core.config.tokens_per_chunk == 1)
            cached = run.cached_tokens
            async for step in run.stream_steps(plans, core.config.tokens_per_chunk):
                plan = step.plan
                tokens = plan.visible(step.start, step.end)
                yield pb.GenerateResponse(
                    request_id=rid,
                    chunk=pb.GenerateStreamChunk(
                        token_ids=tokens,
                        sequence_index=plan.index,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=step.end,
                        cached_tokens=cached,
                        logprobs=_logprobs(tokens, step.start) if want else [],
                    ),
                )
                if step.last:
                    yield self._complete(rid, plan, [], prompt_tokens, cached, want=False)
        else:
            await run.wait_whole(plans)
            cached = run.cached_tokens
            if not run.aborted:
                for plan in plans:
                    plan.done = True
                    yield self._complete(rid, plan, plan.visible_ids, prompt_tokens, cached, want=want)
        for plan in plans:
            if not plan.done:
                yield pb.GenerateResponse(
                    request_id=rid,
                    complete=pb.GenerateComplete(
                        sequence_index=plan.index,
                        finish_reason="cancelled",
                        prompt_tokens=prompt_tokens,
                        cached_tokens=cached,
                    ),
                )

    @staticmethod
    def _complete(
        rid: str, plan: ChoicePlan, tokens: list[int], prompt_tokens: int, cached: int, *, want: bool
    ) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_token_ids=tokens,
            sequence_index=plan.index,
            finish_reason=plan.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(plan.ids),
            cached_tokens=cached,
            logprobs=_logprobs(tokens, 0) if want else [],
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
        return pb.HealthCheckResponse(status="OK" if self._core.healthy else "engine is not ready")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        config = self._core.config
        return pb.GetModelInfoResponse(
            model_id=config.model,
            max_input_len=config.max_context_length,
            max_seq_len=config.max_context_length,
            max_batch_size=config.max_running_requests,
            vocab_size=201088 if config.harmony else 32000,
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        return pb.GetServerInfoResponse(version="sim-0.1", backend="pytorch", world_size=1)

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in tokenizer_chunks(self._core, context):
            yield chunk

    _unimplemented = SimServicer._unimplemented
    Embed = _unimplemented


def add_to_server(servicer: SimTrtllmService, server: grpc.aio.Server) -> None:
    add_with_raw_streams(
        pb_grpc.add_TrtllmServiceServicer_to_server, servicer, server, SERVICE_NAME, KV_EVENT_STREAM
    )


__all__ = ["SERVICE_NAME", "SimTrtllmService", "add_to_server"]
