"""Engine client for the vLLM engine gRPC service (`vllm.grpc.engine.VllmEngine`).

vLLM's stream (the servicer runs the engine with `output_kind=DELTA` when streaming) has SGLang's shape
but for its counts, so it goes through the same normalisation (`GrpcEngineClient._scheduler_stream`,
with `_delta_counts`) into the same `EngineChunk`s the SGLang client yields:

| wire                                  | vLLM                                  | EngineChunk                      |
|---------------------------------------|---------------------------------------|----------------------------------|
| `GenerateStreamChunk.token_ids`       | new ids of this step                  | `token_ids` as-is                |
| `GenerateStreamChunk.completion_tokens` | ids in this step (a delta count)    | running total per choice         |
| stream `GenerateComplete.output_ids`  | the last delta again                  | ignored (tokens come from chunks)|
| stream `GenerateComplete.completion_tokens` | the last delta's length         | running total (or the Complete's, if larger) |
| non-stream `GenerateComplete`         | every id, total count                 | one finished chunk with all ids  |

vLLM reports `matched_token_id` only for ids listed in `stop_token_ids`; a stop on the model's primary EOS
(`<|return|>` for gpt-oss) arrives with no matched stop, and the output parser closes the message at
finish. Prefill/decode disaggregation uses `kv_transfer_params_json` where SGLang uses bootstrap fields;
see `kv_transfer_params`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

from google.protobuf import json_format
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from .base import BootstrapInfo, EngineCapabilities, EngineChunk, GenerateRequest
from .grpc_common import (
    SHARED_SAMPLING,
    SHARED_STOPS,
    GrpcEngineClient,
    int32_seed,
    oneof_matched_stop,
    sampling_fields,
    set_constraint,
)
from .grpc_errors import map_grpc_errors

#: `GetServerInfo.kv_role` of a worker that produces KV caches (a prefill worker).
KV_PRODUCER = "kv_producer"


def kv_transfer_params(bootstrap: BootstrapInfo, kv_role: str) -> dict[str, Any]:
    """The connector params for one side of a PD pair, sent as `kv_transfer_params_json`.

    Both sides get the prefill worker's host/port and the shared room (as `bootstrap_room` and as the
    string `transfer_id`), so the engines rendezvous the way SGLang's bootstrap does and both requests
    can be sent at once. The producer (prefill, `kv_role == "kv_producer"`) is told to keep the KV cache
    for a remote decode and gets `max_tokens = 1`; every other role is told to pull it from the remote
    prefill:

        prefill: {"do_remote_decode": true,  "do_remote_prefill": false, "remote_host": "10.0.0.5",
                  "remote_port": 8998, "bootstrap_room": 42, "transfer_id": "42"}
        decode:  {"do_remote_decode": false, "do_remote_prefill": true,  ...same rendezvous fields}
    """
    producer = kv_role == KV_PRODUCER
    return {
        "do_remote_decode": producer,
        "do_remote_prefill": not producer,
        "remote_host": bootstrap.host,
        "remote_port": bootstrap.port,
        "bootstrap_room": bootstrap.room,
        "transfer_id": str(bootstrap.room),
    }


class VllmGrpcClient(GrpcEngineClient):
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`."""

    engine = "vllm"
    #: vLLM's proto has no per-request stream interval.
    capabilities = EngineCapabilities(server_info=True, tokenizer=True, kv_events=True, loads=True)
    _pb = pb
    _stub_type = pb_grpc.VllmEngineStub
    _delta_counts = True

    def __init__(self, url: str, *, request_timeout: float = 600.0) -> None:
        super().__init__(url, request_timeout=request_timeout)
        #: `GetServerInfo.kv_role`, learned once on the first PD request (or `server_info()`).
        self.kv_role: str | None = None

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        """`GetServerInfo` as a dict keyed by proto field names (`kv_role`, `kv_connector`, ...)."""
        with map_grpc_errors(self.url):
            info = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
        self.kv_role = info.kv_role
        return json_format.MessageToDict(info, preserving_proto_field_name=True)

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        with map_grpc_errors(self.url):
            await self._stub.Abort(pb.AbortRequest(request_ids=[request_id]), timeout=timeout)

    def to_proto(self, request: GenerateRequest, kv_role: str = "") -> pb.GenerateRequest:
        s = request.sampling
        params = pb.SamplingParams(
            **sampling_fields(s, SHARED_SAMPLING + SHARED_STOPS),
            top_k=max(s.top_k, 0),  # uint32 on this wire: 0 disables top-k
            min_tokens=s.min_new_tokens,
            include_stop_str_in_output=s.no_stop_trim,
        )
        if s.max_new_tokens is not None:
            params.max_tokens = s.max_new_tokens
        if s.seed is not None:
            params.seed = int32_seed(s.seed)
        if request.return_logprob:
            params.logprobs = request.top_logprobs_num
        set_constraint(params, s)
        message = pb.GenerateRequest(
            request_id=request.request_id,
            tokenized=pb.TokenizedInput(original_text=request.original_text, input_ids=request.input_ids),
            sampling_params=params,
            stream=request.stream,
        )
        if request.bootstrap is not None:
            if kv_role == KV_PRODUCER:
                message.sampling_params.max_tokens = (
                    1  # the prefill side only fills the KV cache; decode generates
                )
            message.kv_transfer_params_json = json.dumps(
                kv_transfer_params(request.bootstrap, kv_role), separators=(",", ":")
            )
        return message

    async def _kv_role(self) -> str:
        if self.kv_role is None:
            try:
                await self.server_info(timeout=5.0)
            except Exception:
                return ""  # unknown role: the worker is treated as a consumer, and asked again next time
        return self.kv_role or ""

    async def _generate_message(self, request: GenerateRequest) -> pb.GenerateRequest:
        kv_role = await self._kv_role() if request.bootstrap is not None else ""
        return self.to_proto(request, kv_role)

    def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        return self._scheduler_stream(request, oneof_matched_stop)


__all__ = ["KV_PRODUCER", "VllmGrpcClient", "kv_transfer_params"]
