"""Engine client for the MLX engine gRPC service (`mlx.grpc.engine.MlxEngine`, smg-grpc-servicer's MLX
servicer on Apple silicon or a CPU).

The MLX wire is its own service with its own field numbers, and far narrower than SGLang's: no `n`, no
stop strings, no constrained decoding, no per-request stream interval, no PD, no GetLoads. The client
declares that in its capabilities, so a request that needs any of it is a 400 naming the parameter.

What the wire needs, always sent: the stop ids (only `eos_token_id` stops otherwise, and gpt-oss's tool
calls end on `<|call|>`), an explicit temperature (unset means 1.0) and an explicit `max_tokens` (unset
means the whole context).

Normalised into `EngineChunk`s:

| wire                                   | MLX                                  | EngineChunk                       |
|----------------------------------------|--------------------------------------|-----------------------------------|
| stream `GenerateStreamChunk`           | one new token, running counts        | `token_ids` as-is                 |
| stream `GenerateComplete.output_ids`   | empty                                | finish reason, counts, matched id |
| non-stream `GenerateComplete`          | every id, total count                | one finished chunk with all ids   |
| `matched_stop_token_id` (optional)     | the stop token, also in the ids      | `matched_stop_token`              |
| RPC ends OK without a Complete         | the request was aborted              | `UpstreamError` (never a hang or an empty answer) |
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import replace
from typing import Any

from smg_grpc_proto.generated import mlx_engine_pb2 as pb
from smg_grpc_proto.generated import mlx_engine_pb2_grpc as pb_grpc

from ..errors import UpstreamError
from .base import BASIC_CAPABILITIES, EngineChunk, GenerateRequest
from .grpc_common import SHARED_SAMPLING, GrpcEngineClient, int32_seed, sampling_fields
from .grpc_errors import map_grpc_errors

#: The basics only (no `n`, stop strings, constraints or stream interval), and every stop id must be sent;
#: it answers server info and sends its tokenizer.
CAPABILITIES = replace(BASIC_CAPABILITIES, server_info=True, tokenizer=True, implicit_stops=False)


def _matched_stop(complete: Any) -> tuple[int | None, str | None]:
    """MLX reports only a matched stop token, as an optional field."""
    return (complete.matched_stop_token_id if complete.HasField("matched_stop_token_id") else None), None


class MlxGrpcClient(GrpcEngineClient):
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`."""

    engine = "mlx"
    capabilities = CAPABILITIES
    _pb = pb
    _stub_type = pb_grpc.MlxEngineStub

    @staticmethod
    def _default_sampling(info: Any) -> dict[str, Any]:
        return {}  # the MLX wire advertises no sampling defaults

    @staticmethod
    def _tokenizer_path(info: Any) -> str:
        return ""  # nor a tokenizer path: GetTokenizer sends the files

    async def server_info(self, timeout: float = 10.0) -> dict[str, object]:
        with map_grpc_errors(self.url):
            info = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
        return {
            "server_type": info.server_type,
            "active_requests": info.active_requests,
            "uptime_seconds": info.uptime_seconds,
        }

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        with map_grpc_errors(self.url):
            await self._stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=timeout)

    def to_proto(self, request: GenerateRequest) -> pb.GenerateRequest:
        s = request.sampling
        # Only the model's eos_token_id stops by default: list every id the caller stops on, plus the
        # model's own EOS ids (a caller's list replaces nothing on this wire, it only adds).
        stops = list(dict.fromkeys([*s.stop_token_ids, *([] if s.ignore_eos else self.eos_token_ids)]))
        params = pb.SamplingParams(
            **sampling_fields(s, SHARED_SAMPLING),
            top_k=max(s.top_k, 0),  # uint32 on this wire: 0 disables top-k
            stop_token_ids=stops,
            ignore_eos=s.ignore_eos,
        )
        # Unset means "the rest of the context" on this wire; the gateway always knows the budget.
        params.max_tokens = s.max_new_tokens if s.max_new_tokens is not None else self.default_max_tokens
        if s.seed is not None:
            params.seed = int32_seed(s.seed)
        if request.return_logprob:
            params.logprobs = request.top_logprobs_num
        return pb.GenerateRequest(
            request_id=request.request_id,
            tokenized=pb.TokenizedInput(original_text=request.original_text, input_ids=request.input_ids),
            sampling_params=params,
            stream=request.stream,
        )

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        completed = False
        async with contextlib.aclosing(self._scheduler_stream(request, _matched_stop)) as chunks:
            async for chunk in chunks:
                completed = chunk.finished
                yield chunk
        if not completed:
            # The MLX servicer ends an aborted request's RPC with status OK and no Complete.
            raise UpstreamError(f"engine at {self.url} ended the request without finishing it (aborted)")


__all__ = ["CAPABILITIES", "MlxGrpcClient"]
