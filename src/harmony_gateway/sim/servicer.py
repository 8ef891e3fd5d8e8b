"""What the SGLang and vLLM servicers of the simulated engine share.

`admitted` holds a request in the `SimCore` for the length of one Generate call and turns the simulated
failures into gRPC status codes; `wait_prefill` is the prefill half of a PD pair; `fake_output_logprobs`
and `model_info_fields` build the parts of the answers whose fields both protocols spell alike.
`SimServicer` carries the core, the RPCs every protocol answers alike (`SubscribeKvEvents` from the
core's relay, `FlushCache`) and the UNIMPLEMENTED answer for RPCs the simulator does not model;
`add_with_raw_streams` registers a servicer whose streams may yield pre-serialized frames.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc
from smg_grpc_proto.generated import common_pb2

from .server import (
    PromptRejected,
    SimulatedFailure,
    capture_handlers,
    fake_logprob,
    fake_top_logprobs,
    serialize_response,
)

if TYPE_CHECKING:
    from .server import ReceivedRequest, Run, SimConfig, SimCore


@asynccontextmanager
async def admitted(
    core: SimCore, received: ReceivedRequest, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Run]:
    """Admit `received` and release it on exit; a simulated failure or rejected prompt aborts the RPC."""
    run = core.admit(received)
    try:
        yield run
    except SimulatedFailure as exc:
        await context.abort(exc.code, exc.message)
    except PromptRejected as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    finally:
        core.release(run)


async def wait_prefill(run: Run, config: SimConfig, prompt_tokens: int) -> None:
    """The prefill half of a PD pair only fills the KV cache; the decode worker streams the tokens.

    Raises `PromptRejected` when the prompt does not fit the context.
    """
    if prompt_tokens >= config.max_context_length:
        raise PromptRejected(f"The input ({prompt_tokens} tokens) is longer than the context length.")
    await run.wait_whole([])


def fake_output_logprobs(pb: ModuleType, tokens: list[int], first_position: int, top: int) -> Any:
    """`pb.OutputLogProbs` for `tokens` starting at `first_position`, with `top` alternatives each."""
    out = pb.OutputLogProbs(
        token_logprobs=[fake_logprob(t, first_position + i) for i, t in enumerate(tokens)],
        token_ids=tokens,
    )
    if top > 0:
        for i, token in enumerate(tokens):
            values, ids = fake_top_logprobs(token, first_position + i, top)
            out.top_logprobs.append(pb.TopLogProbs(values=values, token_ids=ids))
    return out


def model_info_fields(config: SimConfig) -> dict[str, Any]:
    """The `GetModelInfoResponse` fields both protocols name alike."""
    return {
        "model_path": config.model,
        "tokenizer_path": "",
        "is_generation": True,
        "served_model_name": config.model,
        "max_context_length": config.max_context_length,
        "vocab_size": 201088 if config.harmony else 32000,
        "supports_vision": False,
        "model_type": "gpt_oss" if config.looks_gpt_oss else "qwen2",
        "architectures": ["GptOssForCausalLM"] if config.looks_gpt_oss else ["Qwen2ForCausalLM"],
        "eos_token_ids": list(config.eos_token_ids),
        "pad_token_id": 199999 if config.harmony else 0,
        "bos_token_id": 199998 if config.harmony else 1,
        "max_req_input_len": config.max_context_length,
        "default_sampling_params_json": "",
    }


#: GetTokenizer chunk size; small, so that even a test tokenizer arrives in several chunks.
TOKENIZER_CHUNK = 16 * 1024


def zip_folder(folder: str) -> bytes:
    """The files of a folder (not sub-folders) as a zip archive."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                archive.write(path, path.name)
    return buffer.getvalue()


async def tokenizer_chunks(
    core: SimCore, context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
    """GetTokenizer of every protocol: the tokenizer folder as a zip in `TOKENIZER_CHUNK`-byte chunks,
    the SHA-256 on the last (`smg.grpc.common.GetTokenizerChunk`)."""
    folder = core.config.tokenizer_path
    if not folder:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this simulated model has no tokenizer")
        return
    data = zip_folder(folder)
    digest = hashlib.sha256(data).hexdigest()
    for start in range(0, len(data), TOKENIZER_CHUNK):
        last = start + TOKENIZER_CHUNK >= len(data)
        yield common_pb2.GetTokenizerChunk(
            data=data[start : start + TOKENIZER_CHUNK], sha256=digest if last else ""
        )


#: What the servicers answer when the engine runs without a KV-event publisher.
KV_EVENTS_DISABLED = "KV cache events not enabled (the simulated engine runs with kv_events off)"


class SimServicer:
    """Base of the protocol servicers: holds the `SimCore`."""

    def __init__(self, core: SimCore) -> None:
        self._core = core

    async def _unimplemented(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not simulated")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """The engine's KV events and load records (`kv_relay.KvRelay.serve`), as serialized frames."""
        relay = self._core.relay
        if relay is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, KV_EVENTS_DISABLED)
            return
        async for frame in relay.serve(request, context):
            yield frame

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> common_pb2.FlushCacheResponse:
        """Empty the KV cache; with requests in flight, wait up to `timeout_s` for the engine to go idle."""
        core = self._core
        if request.timeout_s > 0:
            with suppress(TimeoutError):
                async with asyncio.timeout(request.timeout_s):
                    await core.scheduler.idle.wait()
        if core.flush():
            return common_pb2.FlushCacheResponse(success=True, message="Cache flushed.")
        return common_pb2.FlushCacheResponse(
            success=False, message="Cache not flushed: requests are in flight."
        )


def add_with_raw_streams(
    add_servicer: Callable[[Any, Any], None],
    servicer: Any,
    server: grpc.aio.Server,
    service_name: str,
    streams: dict[str, Callable[[bytes], Any]],
) -> None:
    """Register `servicer` as the generated `add_servicer` would, except that the server-streaming
    methods in `streams` (name -> request deserializer) may yield pre-serialized frames."""
    handlers = capture_handlers(add_servicer, servicer)
    for name, deserializer in streams.items():
        handlers[name] = grpc.unary_stream_rpc_method_handler(
            getattr(servicer, name), request_deserializer=deserializer, response_serializer=serialize_response
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
    server.add_registered_method_handlers(service_name, handlers)


#: The KV-event stream's raw-frame registration, for `add_with_raw_streams`.
KV_EVENT_STREAM: dict[str, Callable[[bytes], Any]] = {
    "SubscribeKvEvents": common_pb2.SubscribeKvEventsRequest.FromString
}


__all__ = [
    "KV_EVENTS_DISABLED",
    "KV_EVENT_STREAM",
    "TOKENIZER_CHUNK",
    "SimServicer",
    "add_with_raw_streams",
    "admitted",
    "fake_output_logprobs",
    "model_info_fields",
    "tokenizer_chunks",
    "wait_prefill",
    "zip_folder",
]
