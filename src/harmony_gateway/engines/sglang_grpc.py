"""Engine client for the SGLang scheduler gRPC service (`sglang.grpc.scheduler.SglangScheduler`).

Normalises SGLang's stream into `EngineChunk`s: chunks carry new token ids; in stream mode the final
`GenerateComplete` repeats the last chunk's tokens (smg_grpc_servicer), so its ids are ignored and it
contributes only the finish reason, counts and matched stop. The SGLang proto has no `seed`: a request
that sets one is served unseeded, with a warning logged once per process.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc
from google.protobuf import json_format
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from .base import EngineCapabilities, EngineChunk, GenerateRequest, ModelInfo
from .grpc_common import (
    SHARED_SAMPLING,
    SHARED_STOPS,
    GrpcEngineClient,
    oneof_matched_stop,
    sampling_fields,
    set_constraint,
)
from .grpc_errors import map_grpc_errors

log = logging.getLogger(__name__)

_seed_warned = False


def warn_seed_ignored() -> None:
    """Log, once per process, that SGLang engines cannot honour `seed` (REFERENCE §2.7)."""
    global _seed_warned
    if not _seed_warned:
        _seed_warned = True
        log.warning("seed ignored: the SGLang engine protocol has no seed (logged once per process)")


class SglangGrpcClient(GrpcEngineClient):
    """One channel per worker, reused by every request.

    Also the base of wires that are SGLang's with other field numbers (TokenSpeed): they name their
    generated module in `_pb`, the `GenerateRequest` field of the PD rendezvous in `_bootstrap_field`,
    and how they take a seed in `_set_seed`.
    """

    engine = "sglang"
    capabilities = EngineCapabilities(
        stream_interval=True, server_info=True, tokenizer=True, kv_events=True, loads=True
    )
    _pb = pb
    # Declared as the base does, so that TokenSpeed's stub may replace it.
    _stub_type: Callable[[grpc.aio.Channel], Any] = pb_grpc.SglangSchedulerStub
    _bootstrap_field = "disaggregated_params"

    @staticmethod
    def _default_sampling(info: Any) -> dict[str, Any]:
        return ModelInfo.parse_sampling_json(
            info.default_sampling_params_json, info.preferred_sampling_params
        )

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        with map_grpc_errors(self.url):
            info = await self._stub.GetServerInfo(self._pb.GetServerInfoRequest(), timeout=timeout)
        return json_format.MessageToDict(info.server_args) if info.HasField("server_args") else {}

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        with map_grpc_errors(self.url):
            await self._stub.Abort(
                self._pb.AbortRequest(request_id=request_id, reason="client gone"), timeout=timeout
            )

    @staticmethod
    def _set_seed(params: Any, seed: int) -> None:
        warn_seed_ignored()

    def to_proto(self, request: GenerateRequest) -> Any:
        """The wire's `GenerateRequest` (`pb.GenerateRequest` here, TokenSpeed's in its client)."""
        s = request.sampling
        params = self._pb.SamplingParams(
            **sampling_fields(s, SHARED_SAMPLING + SHARED_STOPS),
            top_k=s.top_k,
            min_new_tokens=s.min_new_tokens,
            no_stop_trim=s.no_stop_trim,
        )
        if s.max_new_tokens is not None:
            params.max_new_tokens = s.max_new_tokens
        if s.seed is not None:
            self._set_seed(params, s.seed)
        if s.stream_interval is not None and self.capabilities.stream_interval:
            params.stream_interval = s.stream_interval
        set_constraint(params, s)
        message = self._pb.GenerateRequest(
            request_id=request.request_id,
            tokenized=self._pb.TokenizedInput(
                original_text=request.original_text, input_ids=request.input_ids
            ),
            sampling_params=params,
            stream=request.stream,
            return_logprob=request.return_logprob,
            top_logprobs_num=request.top_logprobs_num,
        )
        if request.return_logprob:
            message.logprob_start_len = -1
        if request.bootstrap is not None:
            rendezvous = getattr(message, self._bootstrap_field)
            rendezvous.bootstrap_host = request.bootstrap.host
            rendezvous.bootstrap_port = request.bootstrap.port
            rendezvous.bootstrap_room = request.bootstrap.room
        return message

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        return self._scheduler_stream(request, oneof_matched_stop)
