"""Engine client for the TokenSpeed scheduler gRPC service (`tokenspeed.grpc.scheduler.TokenSpeedScheduler`).

TokenSpeed's wire is SGLang's with other field numbers: `TokenizedInput.input_ids` is field 1, the
sampling params field 3, every sampling number has presence (so unset is "the engine's default", not 0),
the seed is `sampling_seed` (uint64), and PD rendezvous is `kv_bootstrap_info` with an int64 room. So the
client is SGLang's (`SglangGrpcClient`) with those differences, and the stream is normalised as SGLang's:
chunks carry new ids, and the stream-mode Complete repeats the last chunk's ids, so only its finish
reason, counts and matched stop are used. Constraints apply from the first generated token; the Harmony
constraints the gateway sends are structural tags, which trigger only inside the tagged parts, so they
are sent as they are.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2_grpc as pb_grpc

from .base import EngineCapabilities, ModelInfo
from .sglang_grpc import SglangGrpcClient

CAPABILITIES = EngineCapabilities(server_info=True, tokenizer=True, kv_events=True, loads=True)


class TokenSpeedGrpcClient(SglangGrpcClient):
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`."""

    engine = "tokenspeed"
    capabilities = CAPABILITIES
    _pb = pb
    _stub_type = pb_grpc.TokenSpeedSchedulerStub
    _bootstrap_field = "kv_bootstrap_info"

    @staticmethod
    def _default_sampling(info: Any) -> dict[str, Any]:
        return ModelInfo.parse_sampling_json(info.default_sampling_params_json)

    @staticmethod
    def _set_seed(params: Any, seed: int) -> None:
        params.sampling_seed = seed % 2**64


__all__ = ["CAPABILITIES", "TokenSpeedGrpcClient"]
