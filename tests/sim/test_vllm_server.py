"""The VllmEngine protocol of the simulated engine: delta chunk counts, stop reasons, Abort, PD params."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vl
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vl_grpc

from harmony_gateway.harmony.encoding import CALL, RETURN
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine

from ._helpers import WEATHER_TOOL, collect, developer_with_tools, drain, parse, render, user, vl_request

PROMPT = render(user("Tell me a fact about owls."))


def split(responses: list[vl.GenerateResponse]) -> tuple[list, list]:
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    return chunks, completes


async def test_model_and_server_info(vllm_sim: RunningSim, vllm: vl_grpc.VllmEngineStub) -> None:
    info = await vllm.GetModelInfo(vl.GetModelInfoRequest())
    assert (info.served_model_name, info.model_type) == ("openai/gpt-oss-20b", "gpt_oss")
    assert list(info.architectures) == ["GptOssForCausalLM"]
    assert list(info.eos_token_ids) == [200002, 199999, 200012]
    server = await vllm.GetServerInfo(vl.GetServerInfoRequest())
    assert server.server_type == "vllm-grpc" and server.kv_role == ""
    loads = await vllm.GetLoads(vl.GetLoadsRequest())
    assert loads.loads[0].num_running_reqs == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await vllm.Embed(vl.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_health_services(vllm_sim: RunningSim, vllm: vl_grpc.VllmEngineStub) -> None:
    assert (await vllm.HealthCheck(vl.HealthCheckRequest())).healthy
    async with grpc.aio.insecure_channel(vllm_sim.address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="vllm.grpc.engine.VllmEngine")
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_non_stream_answer_and_eos_has_no_matched_token(vllm: vl_grpc.VllmEngineStub) -> None:
    responses = await collect(vllm.Generate(vl_request(PROMPT)))
    assert len(responses) == 1
    done = responses[0].complete
    assert done.finish_reason == "stop"
    assert done.output_ids[-1] == RETURN
    # vLLM checks the primary EOS (<|return|>) before stop_token_ids and then reports no stop reason.
    assert done.WhichOneof("matched_stop") is None
    assert done.completion_tokens == len(done.output_ids)
    assert [m.channel for m in parse(done.output_ids)] == ["analysis", "final"]


async def test_tool_call_names_the_matched_call_token(vllm: vl_grpc.VllmEngineStub) -> None:
    prompt = render(developer_with_tools(WEATHER_TOOL), user("get_weather in Oslo"))
    done = (await collect(vllm.Generate(vl_request(prompt))))[0].complete
    assert done.matched_token_id == CALL
    call = parse(done.output_ids)[-1]
    assert call.recipient == "functions.get_weather"
    assert json.loads(call.content[0].text)["location"] == "Oslo"


async def test_stream_counts_are_deltas_and_complete_repeats_the_last_delta(
    vllm: vl_grpc.VllmEngineStub,
) -> None:
    whole = list((await collect(vllm.Generate(vl_request(PROMPT))))[0].complete.output_ids)
    chunks, completes = split(await collect(vllm.Generate(vl_request(PROMPT, stream=True))))
    assert [t for c in chunks for t in c.token_ids] == whole
    assert all(c.completion_tokens == len(c.token_ids) == 1 for c in chunks)
    assert len(completes) == 1
    assert list(completes[0].output_ids) == list(chunks[-1].token_ids)
    assert completes[0].completion_tokens == 1


async def test_max_tokens_n_and_logprobs(vllm: vl_grpc.VllmEngineStub) -> None:
    done = (await collect(vllm.Generate(vl_request(PROMPT, max_tokens=4))))[0].complete
    assert (done.finish_reason, len(done.output_ids)) == ("length", 4)
    chunks, completes = split(await collect(vllm.Generate(vl_request(PROMPT, stream=True, n=2, logprobs=2))))
    assert sorted(c.index for c in completes) == [0, 1]
    assert {c.index for c in chunks} == {0, 1}
    assert len(chunks[0].output_logprobs.top_logprobs[0].values) == 2


async def test_strip_stop_token() -> None:
    async with (
        await start_sim_engine(SimConfig(engine="vllm", strip_stop_token=True)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = vl_grpc.VllmEngineStub(channel)
        prompt = render(developer_with_tools(WEATHER_TOOL), user("get_weather in Oslo"))
        done = (await collect(stub.Generate(vl_request(prompt))))[0].complete
        assert CALL not in done.output_ids and done.matched_token_id == CALL


async def test_abort_and_fail_next(vllm_sim: RunningSim, vllm: vl_grpc.VllmEngineStub) -> None:
    vllm_sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=2)
    received: list = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain(vllm.Generate(vl_request(PROMPT, stream=True)), received)
    assert err.value.code() == grpc.StatusCode.INTERNAL and len(received) == 2

    async with (
        await start_sim_engine(SimConfig(engine="vllm", tokens_per_second=20)) as slow,
        grpc.aio.insecure_channel(slow.address) as channel,
    ):
        stub = vl_grpc.VllmEngineStub(channel)
        call = stub.Generate(vl_request(PROMPT, stream=True, request_id="v-slow"))
        await call.read()
        await stub.Abort(vl.AbortRequest(request_ids=["v-slow", "other"]))
        rest = []
        async with asyncio.timeout(1.0):
            while (response := await call.read()) is not grpc.aio.EOF:
                rest.append(response)
        assert rest[-1].complete.finish_reason == "abort"
        assert slow.aborted == ["v-slow", "other"]


async def test_text_input_is_rejected(vllm: vl_grpc.VllmEngineStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(vllm.Generate(vl.GenerateRequest(request_id="t", text="hello")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_prefill_mode_returns_kv_transfer_params_and_records_them() -> None:
    async with (
        await start_sim_engine(SimConfig(engine="vllm", mode="prefill", bootstrap_port=5600)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = vl_grpc.VllmEngineStub(channel)
        assert (await stub.GetServerInfo(vl.GetServerInfoRequest())).kv_role == "kv_producer"
        request = vl_request(PROMPT, stream=True)
        request.kv_transfer_params_json = json.dumps({"do_remote_decode": True})
        chunks, completes = split(await collect(stub.Generate(request)))
        assert [list(c.token_ids) for c in chunks] == [[]] and list(completes[0].output_ids) == []
        handoff = json.loads(completes[0].kv_transfer_params_json)
        assert handoff["do_remote_prefill"] is True and handoff["remote_port"] == 5600
        assert sim.requests[0].kv_transfer_params == {"do_remote_decode": True}
        request.kv_transfer_params_json = "not json"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
