"""The vLLM engine client against the simulated vLLM engine on loopback: stream normalisation, PD
params, abort, health, model info, and `--engine auto` detection."""

from __future__ import annotations

import json

import grpc
import pytest

from harmony_gateway.engines.base import BootstrapInfo, GenerateRequest, SamplingOptions
from harmony_gateway.engines.detect import DetectingGrpcClient
from harmony_gateway.engines.registry import create_client
from harmony_gateway.engines.sglang_grpc import SglangGrpcClient
from harmony_gateway.engines.vllm_grpc import VllmGrpcClient, kv_transfer_params
from harmony_gateway.errors import InvalidRequest, UpstreamUnavailable
from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import SimConfig, start_sim_engine

STOPS = [200002, 200012]


def prompt() -> list[int]:
    from openai_harmony import Conversation, Message, Role, SystemContent

    return get_encoding().render_conversation_for_completion(
        Conversation.from_messages(
            [
                Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
                Message.from_role_and_content(Role.USER, "What is 2+2?"),
            ]
        ),
        Role.ASSISTANT,
    )


def request(rid: str = "r1", *, stream: bool = True, n: int = 1, **kw: object) -> GenerateRequest:
    sampling = SamplingOptions(stop_token_ids=STOPS, max_new_tokens=512, n=n)
    return GenerateRequest(request_id=rid, input_ids=prompt(), sampling=sampling, stream=stream, **kw)  # type: ignore[arg-type]


async def collect(client: VllmGrpcClient, req: GenerateRequest) -> list:
    return [chunk async for chunk in client.generate(req)]


@pytest.mark.parametrize("tokens_per_chunk", [1, 3])
async def test_stream_yields_new_ids_once_and_running_counts(tokens_per_chunk: int) -> None:
    async with await start_sim_engine(SimConfig(engine="vllm", tokens_per_chunk=tokens_per_chunk)) as sim:
        client = VllmGrpcClient(sim.url)
        try:
            streamed = await collect(client, request(stream=True))
            whole = await collect(client, request("r2", stream=False))
        finally:
            await client.close()
    ids = [t for c in streamed for t in c.token_ids]
    assert len(whole) == 1 and whole[0].finished
    # The Complete repeats the last delta on the wire; the client must not emit it twice.
    assert ids == whole[0].token_ids
    assert [c.finished for c in streamed].count(True) == 1 and streamed[-1].finished
    assert streamed[-1].token_ids == []
    counts = [c.completion_tokens for c in streamed[:-1]]
    assert counts == sorted(counts) and counts[-1] == len(ids)
    assert streamed[-1].completion_tokens == len(ids) == whole[0].completion_tokens
    assert streamed[-1].finish_reason == "stop" and streamed[-1].prompt_tokens == len(prompt())
    # vLLM names no matched stop for the primary EOS (<|return|>); the id itself is in the output.
    assert streamed[-1].matched_stop_token is None and ids[-1] == 200002


async def test_n_choices_count_separately_and_sampling_is_explicit() -> None:
    async with await start_sim_engine(SimConfig(engine="vllm")) as sim:
        client = VllmGrpcClient(sim.url)
        try:
            chunks = await collect(client, request(n=2, return_logprob=True, top_logprobs_num=2))
        finally:
            await client.close()
    sampling = sim.requests[0].sampling
    assert sampling["top_p"] == 1.0 and sampling["repetition_penalty"] == 1.0 and sampling["n"] == 2
    assert sampling["max_tokens"] == 512 and sampling["logprobs"] == 2
    finals = {c.index: c for c in chunks if c.finished}
    assert set(finals) == {0, 1}
    for index, final in finals.items():
        ids = [t for c in chunks if c.index == index for t in c.token_ids]
        assert final.completion_tokens == len(ids)
        lps = [lp for c in chunks if c.index == index and c.logprobs for lp in c.logprobs]
        assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 2 for lp in lps)


async def test_health_model_info_abort_and_errors() -> None:
    async with await start_sim_engine(SimConfig(engine="vllm", tokens_per_second=50)) as sim:
        client = VllmGrpcClient(sim.url)
        try:
            info = await client.model_info()
            assert info.served_model_name == "openai/gpt-oss-20b" and info.looks_harmony
            assert await client.health(1.0)
            await sim.set_healthy(False)
            assert not await client.health(1.0)
            await client.abort("gone")
            assert sim.aborted == ["gone"]
            sim.fail_next(grpc.StatusCode.UNAVAILABLE)
            with pytest.raises(UpstreamUnavailable):
                await collect(client, request())
            assert (await client.server_info())["server_type"] == "vllm-grpc"
        finally:
            await client.close()


async def test_pd_sends_kv_transfer_params_by_role() -> None:
    boot = BootstrapInfo(host="127.0.0.1", port=9100, room=4242)
    async with (
        await start_sim_engine(SimConfig(engine="vllm", mode="prefill")) as prefill_sim,
        await start_sim_engine(SimConfig(engine="vllm", mode="decode")) as decode_sim,
    ):
        prefill, decode = VllmGrpcClient(prefill_sim.url), VllmGrpcClient(decode_sim.url)
        try:
            p_chunks = await collect(prefill, request(bootstrap=boot))
            d_chunks = await collect(decode, request(bootstrap=boot))
        finally:
            await prefill.close()
            await decode.close()
    p_params = prefill_sim.requests[0].kv_transfer_params
    d_params = decode_sim.requests[0].kv_transfer_params
    assert p_params == kv_transfer_params(boot, "kv_producer")
    assert p_params["do_remote_decode"] is True and p_params["do_remote_prefill"] is False
    assert d_params["do_remote_prefill"] is True and d_params["do_remote_decode"] is False
    assert p_params["bootstrap_room"] == d_params["bootstrap_room"] == 4242
    assert d_params["remote_host"] == "127.0.0.1" and d_params["remote_port"] == 9100
    assert prefill_sim.requests[0].sampling["max_tokens"] == 1
    assert not any(c.token_ids for c in p_chunks) and any(c.token_ids for c in d_chunks)
    assert json.loads(json.dumps(d_params)) == d_params


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
async def test_auto_detects_the_protocol(engine: str) -> None:
    async with await start_sim_engine(SimConfig(engine=engine)) as sim:  # type: ignore[arg-type]
        client = create_client(sim.url, "auto")
        assert isinstance(client, DetectingGrpcClient) and client.engine == "auto"
        try:
            with pytest.raises(UpstreamUnavailable):
                client.generate(request())  # nothing is known before the first probe
            info = await client.model_info()
            assert info.served_model_name == "openai/gpt-oss-20b"
            assert client.engine == engine
            expected = SglangGrpcClient if engine == "sglang" else VllmGrpcClient
            assert isinstance(client.detected, expected)
            chunks = [c async for c in client.generate(request())]
            assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) > 0
        finally:
            await client.close()


async def test_auto_detection_waits_for_a_reachable_worker() -> None:
    async with await start_sim_engine(SimConfig(engine="vllm")) as sim:
        url = sim.url
    client = create_client(url, "auto")
    try:
        with pytest.raises(UpstreamUnavailable):
            await client.health(0.5)
        assert client.engine == "auto" and client.detected is None  # type: ignore[attr-defined]
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("url", "engine"), [("ftp://x:1", "auto"), ("grpc://nohost", "auto"), ("grpc://h:1", "lmdeploy")]
)
def test_create_client_rejects_bad_urls_and_engines(url: str, engine: str) -> None:
    with pytest.raises(InvalidRequest):
        create_client(url, engine)


@pytest.mark.parametrize(
    ("seed", "wire"), [(7, 7), (-5, -5), (2**31, -(2**31)), (2**40 + 3, 3), (2**64 - 1, -1)]
)
def test_wide_seeds_fold_into_the_int32_wire(seed: int, wire: int) -> None:
    client = VllmGrpcClient("grpc://127.0.0.1:1")
    req = request()
    req.sampling.seed = seed
    assert client.to_proto(req).sampling_params.seed == wire
