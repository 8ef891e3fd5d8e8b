"""Engine client for the TokenSpeed scheduler gRPC service (`tokenspeed.grpc.scheduler.TokenSpeedScheduler`).

TokenSpeed's wire is SGLang's with other field numbers: `TokenizedInput.input_ids` is field 1, the
sampling params field 3, every sampling number has presence (so unset is "the engine's default", not 0),
the seed is `sampling_seed` (uint64), and PD rendezvous is `kv_bootstrap_info` with an int64 room. The
stream is normalised as SGLang's: chunks carry new ids, and the stream-mode Complete repeats the last
chunk's ids, so only its finish reason, counts and matched stop are used. Constraints apply from the
first generated token; the Harmony constraints the gateway sends are structural tags, which trigger
only inside the tagged parts, so they are sent as they are.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from google.protobuf import json_format
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from .base import EngineCapabilities, EngineChunk, GenerateRequest, ModelInfo
from .grpc_common import GrpcEngineClient, oneof_matched_stop, set_constraint
from .grpc_errors import map_grpc_errors

CAPABILITIES = EngineCapabilities(server_info=True, tokenizer=True)


class TokenSpeedGrpcClient(GrpcEngineClient):
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`."""

    engine = "tokenspeed"
    capabilities = CAPABILITIES
    _pb = pb
    _stub_type = pb_grpc.TokenSpeedSchedulerStub

    @staticmethod
    def _default_sampling(info: Any) -> dict[str, Any]:
        return ModelInfo.parse_sampling_json(info.default_sampling_params_json)

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        with map_grpc_errors(self.url):
            info = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
        return json_format.MessageToDict(info.server_args) if info.HasField("server_args") else {}

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        with map_grpc_errors(self.url):
            await self._stub.Abort(
                pb.AbortRequest(request_id=request_id, reason="client gone"), timeout=timeout
            )

    def to_proto(self, request: GenerateRequest) -> pb.GenerateRequest:
        s = request.sampling
        params = pb.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            frequency_penalty=s.frequency_penalty,
            presence_penalty=s.presence_penalty,
            repetition_penalty=s.repetition_penalty,
            min_new_tokens=s.min_new_tokens,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            skip_special_tokens=s.skip_special_tokens,
            n=s.n,
            no_stop_trim=s.no_stop_trim,
        )
        if s.max_new_tokens is not None:
            params.max_new_tokens = s.max_new_tokens
        if s.seed is not None:
            params.sampling_seed = s.seed % 2**64
        set_constraint(params, s)
        message = pb.GenerateRequest(
            request_id=request.request_id,
            tokenized=pb.TokenizedInput(input_ids=request.input_ids, original_text=request.original_text),
            sampling_params=params,
            stream=request.stream,
            return_logprob=request.return_logprob,
            top_logprobs_num=request.top_logprobs_num,
        )
        if request.return_logprob:
            message.logprob_start_len = -1
        if request.bootstrap is not None:
            message.kv_bootstrap_info.CopyFrom(
                pb.KvBootstrapInfo(
                    bootstrap_host=request.bootstrap.host,
                    bootstrap_port=request.bootstrap.port,
                    bootstrap_room=request.bootstrap.room,
                )
            )
        return message

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        return self._scheduler_stream(request, oneof_matched_stop)


__all__ = ["CAPABILITIES", "TokenSpeedGrpcClient"]
