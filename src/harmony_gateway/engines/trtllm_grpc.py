"""Engine client for the TensorRT-LLM gRPC service (`trtllm.TrtllmService`).

TRT-LLM's wire differs from SGLang's in shape, not only numbering:
- ids go in `tokenized.input_token_ids`; `max_tokens` is a required plain field (always sent);
  `streaming` instead of `stream`; sampling in `SamplingConfig` (every number with presence,
  `num_return_sequences` for `n`, `beam_width` 1), logprobs in `OutputConfig`;
- constraints are `GuidedDecodingParams{guide_type, guide}`; stops are `stop` strings and
  `stop_token_ids`; `include_stop_token_in_output` is always set, or `<|call|>` and `<|return|>` never
  reach the Harmony parser (smg#879);
- choices are `sequence_index`; logprobs are a list of `TokenLogprob` per token;
- `HealthCheck` answers a status string ("OK" when healthy); `GetModelInfo` names only `model_id` and
  sizes, with no model type, architectures or EOS ids (Harmony is then recognised by the model name or
  `--harmony-models`).
The stream is normalised as SGLang's: chunks carry new ids; a stream-mode Complete contributes its ids
only for a choice that sent no chunk. Prefill/decode disaggregation (context-only / generation-only
requests carrying the KV cache blocks) is not spoken: a PD request to a TRT-LLM worker is refused.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

from smg_grpc_proto.generated import trtllm_service_pb2 as pb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as pb_grpc

from ..errors import UpstreamError
from .base import EngineCapabilities, EngineChunk, GenerateRequest, ModelInfo, TokenLogprob
from .grpc_common import SHARED_SAMPLING, GrpcEngineClient, oneof_matched_stop, sampling_fields
from .grpc_errors import map_grpc_errors

#: TRT-LLM streams KV events but answers no GetLoads.
CAPABILITIES = EngineCapabilities(server_info=True, tokenizer=True, implicit_stops=False, kv_events=True)


def trtllm_logprobs(entries: Sequence[Any]) -> list[TokenLogprob] | None:
    if not entries:
        return None
    return [
        TokenLogprob(e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top_logprobs])
        for e in entries
    ]


class TrtllmGrpcClient(GrpcEngineClient):
    """One channel per worker, reused by every request. Errors surface as `errors.Upstream*`."""

    engine = "trtllm"
    capabilities = CAPABILITIES
    _pb = pb
    _stub_type = pb_grpc.TrtllmServiceStub

    async def model_info(self, timeout: float = 10.0) -> ModelInfo:
        with map_grpc_errors(self.url):
            info = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        self.vocab_size = max(info.vocab_size, 0)
        return ModelInfo(served_model_name=info.model_id, max_context_length=max(info.max_seq_len, 0))

    async def health(self, timeout: float) -> bool:
        with map_grpc_errors(self.url):
            reply = await self._stub.HealthCheck(pb.HealthCheckRequest(), timeout=timeout)
        return bool(reply.status.strip().upper() == "OK")

    async def server_info(self, timeout: float = 10.0) -> dict[str, Any]:
        with map_grpc_errors(self.url):
            info = await self._stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout)
        return {"version": info.version, "backend": info.backend, "world_size": info.world_size}

    async def abort(self, request_id: str, timeout: float = 2.0) -> None:
        with map_grpc_errors(self.url):
            await self._stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout)

    def to_proto(self, request: GenerateRequest) -> pb.GenerateRequest:
        s = request.sampling
        config = pb.SamplingConfig(
            **sampling_fields(s, SHARED_SAMPLING),
            beam_width=1,
            num_return_sequences=s.n,
            top_k=max(s.top_k, 0),  # 0 disables top-k on this wire
            min_tokens=s.min_new_tokens,
        )
        if s.seed is not None:
            config.seed = s.seed % 2**64
        output = pb.OutputConfig(exclude_input_from_output=True)
        if request.return_logprob:
            output.logprobs = request.top_logprobs_num
        message = pb.GenerateRequest(
            request_id=request.request_id,
            tokenized=pb.TokenizedInput(
                original_text=request.original_text, input_token_ids=request.input_ids
            ),
            sampling_config=config,
            output_config=output,
            max_tokens=s.max_new_tokens if s.max_new_tokens is not None else self.default_max_tokens,
            streaming=request.stream,
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
            ignore_eos=s.ignore_eos,
            include_stop_token_in_output=True,
        )
        guide = _guide(s.json_schema, s.regex, s.structural_tag)
        if guide is not None:
            message.guided_decoding.CopyFrom(guide)
        return message

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[EngineChunk, None]:
        self.check(request)
        if request.bootstrap is not None:
            raise UpstreamError(f"the trtllm engine at {self.url} cannot serve prefill/decode pairs")
        stream = request.stream
        want_logprobs = request.return_logprob
        streamed: set[int] = set()
        with self._generate_call(self.to_proto(request)) as call:
            async for reply in call:
                which = reply.WhichOneof("response")
                if which == "chunk":
                    c = reply.chunk
                    streamed.add(c.sequence_index)
                    yield EngineChunk(
                        c.sequence_index,
                        list(c.token_ids),
                        c.prompt_tokens,
                        c.completion_tokens,
                        c.cached_tokens,
                        trtllm_logprobs(c.logprobs) if want_logprobs else None,
                    )
                elif which == "complete":
                    c = reply.complete
                    stop_token, stop_str = oneof_matched_stop(c)
                    take_ids = not stream or c.sequence_index not in streamed
                    yield EngineChunk(
                        c.sequence_index,
                        list(c.output_token_ids) if take_ids else [],
                        c.prompt_tokens,
                        c.completion_tokens,
                        c.cached_tokens,
                        trtllm_logprobs(c.logprobs) if take_ids and want_logprobs else None,
                        True,
                        c.finish_reason or "stop",
                        stop_token,
                        stop_str,
                    )


def _guide(
    json_schema: str | None, regex: str | None, structural_tag: str | None
) -> pb.GuidedDecodingParams | None:
    kinds = pb.GuidedDecodingParams
    if json_schema is not None:
        return kinds(guide_type=kinds.GUIDE_TYPE_JSON_SCHEMA, guide=json_schema)
    if regex is not None:
        return kinds(guide_type=kinds.GUIDE_TYPE_REGEX, guide=regex)
    if structural_tag is not None:
        return kinds(guide_type=kinds.GUIDE_TYPE_STRUCTURAL_TAG, guide=structural_tag)
    return None


__all__ = ["CAPABILITIES", "TrtllmGrpcClient", "trtllm_logprobs"]
