"""The `mlx.grpc.engine.MlxEngine` servicer of the simulated engine.

Mirrors smg-grpc-servicer 0.14.1's MLX servicer as observed against the real one:
- stream: one `GenerateStreamChunk` per token with running counts, then a `GenerateComplete` with empty
  `output_ids`; non-stream: one Complete with every id. The stop token is part of the output.
- only the model's `eos_token_id` (<|return|> for gpt-oss) stops unless `stop_token_ids` are sent;
  `matched_stop_token_id` names the stop token.
- unset `temperature` means 1.0 and unset `max_tokens` means the rest of the context.
- Abort ends the Generate RPC with status OK and no Complete, stream and non-stream.
- no `n`, stop strings, constraints, PD or GetLoads on this wire; text input is refused.
The real servicer spins its generation thread on an empty prompt; the simulator refuses it with INTERNAL,
so a client that lets one through fails a test instead of hanging it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import mlx_engine_pb2 as pb
from smg_grpc_proto.generated import mlx_engine_pb2_grpc as pb_grpc

from .server import ChoicePlan, ReceivedRequest, Run
from .servicer import SimServicer, admitted, fake_output_logprobs, model_info_fields, tokenizer_chunks

SERVICE_NAME = "mlx.grpc.engine.MlxEngine"


class SimMlxEngine(SimServicer, pb_grpc.MlxEngineServicer):
    """MlxEngine over a `SimCore`."""

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        if request.WhichOneof("input") != "tokenized":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "MLX servicer requires tokenized input")
        ids = list(request.tokenized.input_ids)
        if not ids:
            await context.abort(grpc.StatusCode.INTERNAL, "empty prompt (the real engine spins on it)")
        sp = request.sampling_params
        received = ReceivedRequest(
            request_id=request.request_id,
            input_ids=ids,
            sampling=MessageToDict(sp, preserving_proto_field_name=True),
            stream=request.stream,
            return_logprob=sp.HasField("logprobs"),
            top_logprobs_num=max(sp.logprobs, 0) if sp.HasField("logprobs") else 0,
        )
        async with admitted(self._core, received, context) as run:
            async for response in self._generate(request, run, ids):
                yield response

    async def _generate(
        self, request: pb.GenerateRequest, run: Run, ids: list[int]
    ) -> AsyncIterator[pb.GenerateResponse]:
        core = self._core
        sp = request.sampling_params
        stops = list(sp.stop_token_ids)
        if not sp.ignore_eos:
            stops.append(core.config.primary_eos_id)
        (plan,) = core.plan(
            ids,
            n=1,
            max_new_tokens=sp.max_tokens if sp.HasField("max_tokens") else None,
            stop_token_ids=stops,
            ignore_eos=True,  # only the stops computed above, as the real servicer does
        )
        top = max(sp.logprobs, 0) if sp.HasField("logprobs") else 0
        want = sp.HasField("logprobs")
        prompt_tokens = len(ids)
        if request.stream:
            async for step in run.stream_steps([plan], 1):
                tokens = plan.ids[step.start : step.end]
                yield pb.GenerateResponse(
                    chunk=pb.GenerateStreamChunk(
                        token_ids=tokens,
                        prompt_tokens=prompt_tokens,
                        completion_tokens=step.end,
                        output_logprobs=fake_output_logprobs(pb, tokens, step.start, top) if want else None,
                    )
                )
                if step.last:
                    yield self._complete(plan, [], prompt_tokens, None)
            return  # aborted: the RPC just ends
        await run.wait_whole([plan])
        if not run.aborted:
            logprobs = fake_output_logprobs(pb, plan.ids, 0, top) if want else None
            yield self._complete(plan, plan.ids, prompt_tokens, logprobs)

    @staticmethod
    def _complete(
        plan: ChoicePlan, ids: list[int], prompt_tokens: int, logprobs: pb.OutputLogProbs | None
    ) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=ids,
            finish_reason=plan.finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(plan.ids),
            output_logprobs=logprobs,
        )
        if plan.matched_token_id is not None:
            complete.matched_stop_token_id = plan.matched_token_id
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
        return pb.HealthCheckResponse(healthy=healthy, message="OK" if healthy else "simulated unhealthy")

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetModelInfoResponse:
        fields = model_info_fields(self._core.config)
        # The real servicer reports config.json's eos_token_id: for gpt-oss only <|return|>.
        fields["eos_token_ids"] = [self._core.config.primary_eos_id]
        keep = {f.name for f in pb.GetModelInfoResponse.DESCRIPTOR.fields}
        return pb.GetModelInfoResponse(**{k: v for k, v in fields.items() if k in keep})

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetServerInfoResponse:
        core = self._core
        return pb.GetServerInfoResponse(
            server_type="mlx-grpc", active_requests=core.active, uptime_seconds=time.time() - core.started_at
        )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async for chunk in tokenizer_chunks(self._core, context):
            yield chunk


def add_to_server(servicer: SimMlxEngine, server: grpc.aio.Server) -> None:
    pb_grpc.add_MlxEngineServicer_to_server(servicer, server)


__all__ = ["SERVICE_NAME", "SimMlxEngine", "add_to_server"]
