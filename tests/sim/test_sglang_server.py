"""The SglangScheduler protocol of the simulated engine, over real grpc.aio stubs on loopback."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc

from harmony_gateway.harmony.encoding import CALL, RETURN
from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine

from ._helpers import (
    WEATHER_TOOL,
    collect,
    developer_with_tools,
    drain,
    parse,
    render,
    sg_request,
    tool_result,
    user,
)

PROMPT = render(user("What is the capital of France?"))


def chunks_and_completes(responses: list[sg.GenerateResponse]) -> tuple[list, list]:
    chunks = [r.chunk for r in responses if r.WhichOneof("response") == "chunk"]
    completes = [r.complete for r in responses if r.WhichOneof("response") == "complete"]
    return chunks, completes


async def test_model_info_describes_gpt_oss(sglang: sg_grpc.SglangSchedulerStub) -> None:
    info = await sglang.GetModelInfo(sg.GetModelInfoRequest())
    assert info.served_model_name == "openai/gpt-oss-20b"
    assert info.model_type == "gpt_oss"
    assert list(info.architectures) == ["GptOssForCausalLM"]
    assert list(info.eos_token_ids) == [200002, 199999, 200012]
    assert info.max_context_length == 131072
    assert info.is_generation
    assert info.default_sampling_params_json == ""


async def test_both_health_services_report_healthy_and_can_be_flipped(sim: RunningSim) -> None:
    async with grpc.aio.insecure_channel(sim.address) as channel:
        scheduler = sg_grpc.SglangSchedulerStub(channel)
        standard = health_pb2_grpc.HealthStub(channel)
        assert (await scheduler.HealthCheck(sg.HealthCheckRequest())).healthy
        for service in ("", "sglang.grpc.scheduler.SglangScheduler"):
            reply = await standard.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        await sim.set_healthy(False)
        assert not (await scheduler.HealthCheck(sg.HealthCheckRequest())).healthy
        reply = await standard.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_server_info_loads_and_unimplemented(sglang: sg_grpc.SglangSchedulerStub) -> None:
    info = await sglang.GetServerInfo(sg.GetServerInfoRequest())
    assert info.server_type == "grpc"
    assert info.server_args["disaggregation_mode"] == "null"
    assert info.server_args["disaggregation_bootstrap_port"] == 8998
    assert info.server_args["model_path"] == "openai/gpt-oss-20b"
    loads = await sglang.GetLoads(sg.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await sglang.Embed(sg.EmbedRequest())
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_non_stream_plain_answer_parses_into_analysis_and_final(
    sim: RunningSim, sglang: sg_grpc.SglangSchedulerStub
) -> None:
    responses = await collect(sglang.Generate(sg_request(PROMPT, max_new_tokens=512)))
    assert len(responses) == 1 and responses[0].request_id == "req-1"
    done = responses[0].complete
    assert done.finish_reason == "stop"
    assert done.matched_token_id == RETURN
    assert done.output_ids[-1] == RETURN
    assert done.prompt_tokens == len(PROMPT)
    assert done.completion_tokens == len(done.output_ids)
    assert [m.channel for m in parse(done.output_ids)] == ["analysis", "final"]
    recorded = sim.requests[0]
    assert recorded.request_id == "req-1" and recorded.input_ids == PROMPT and not recorded.stream
    assert recorded.sampling["max_new_tokens"] == 512
    assert recorded.sampling["stop_token_ids"] == [200002, 200012]


async def test_tool_call_for_a_named_tool(sglang: sg_grpc.SglangSchedulerStub) -> None:
    prompt = render(developer_with_tools(WEATHER_TOOL), user("Please call get_weather for Berlin"))
    done = (await collect(sglang.Generate(sg_request(prompt))))[0].complete
    assert done.matched_token_id == CALL
    call = parse(done.output_ids)[-1]
    assert (call.channel, call.recipient) == ("commentary", "functions.get_weather")
    args = json.loads(call.content[0].text)
    assert args == {"location": "Berlin", "unit": "c", "days": 1}


async def test_tool_result_is_answered(sglang: sg_grpc.SglangSchedulerStub) -> None:
    prompt = render(
        developer_with_tools(WEATHER_TOOL),
        user("get_weather for Rome"),
        tool_result("functions.get_weather", "sunny, 25C"),
    )
    done = (await collect(sglang.Generate(sg_request(prompt))))[0].complete
    assert 'returned: "sunny, 25C"' in parse(done.output_ids)[-1].content[0].text


async def test_max_new_tokens_cuts_with_length(sglang: sg_grpc.SglangSchedulerStub) -> None:
    done = (await collect(sglang.Generate(sg_request(PROMPT, max_new_tokens=5))))[0].complete
    assert done.finish_reason == "length"
    assert len(done.output_ids) == 5 and done.completion_tokens == 5
    assert done.WhichOneof("matched_stop") is None


async def test_stream_chunks_are_deltas_and_complete_repeats_the_last_chunk(
    sglang: sg_grpc.SglangSchedulerStub,
) -> None:
    whole = (await collect(sglang.Generate(sg_request(PROMPT))))[0].complete.output_ids
    responses = await collect(sglang.Generate(sg_request(PROMPT, stream=True, request_id="s")))
    chunks, completes = chunks_and_completes(responses)
    assert responses[-1].WhichOneof("response") == "complete" and len(completes) == 1
    assert all(len(c.token_ids) == 1 for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == list(whole)
    assert [c.completion_tokens for c in chunks] == list(range(1, len(whole) + 1))
    assert all(c.prompt_tokens == len(PROMPT) for c in chunks)
    assert list(completes[0].output_ids) == list(chunks[-1].token_ids)
    assert completes[0].completion_tokens == len(whole)
    assert completes[0].matched_token_id == RETURN


async def test_stream_interval_and_tokens_per_chunk_group_tokens() -> None:
    async with (
        await start_sim_engine(SimConfig(tokens_per_chunk=4)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        chunks, completes = chunks_and_completes(
            await collect(stub.Generate(sg_request(PROMPT, stream=True)))
        )
        assert all(len(c.token_ids) == 4 for c in chunks[:-1]) and 1 <= len(chunks[-1].token_ids) <= 4
        request = sg_request(PROMPT, stream=True, stream_interval=7)
        chunks, _ = chunks_and_completes(await collect(stub.Generate(request)))
        # As SGLang honours a request's interval: the first token at once, then seven at a time.
        assert len(chunks[0].token_ids) == 1
        assert all(len(c.token_ids) == 7 for c in chunks[1:-1])


async def test_n2_stream_interleaves_indices(sglang: sg_grpc.SglangSchedulerStub) -> None:
    responses = await collect(sglang.Generate(sg_request(PROMPT, stream=True, n=2)))
    chunks, completes = chunks_and_completes(responses)
    assert sorted(c.index for c in completes) == [0, 1]
    assert [c.index for c in chunks[:4]] == [0, 1, 0, 1]
    texts = {}
    for index in (0, 1):
        ids = [t for c in chunks if c.index == index for t in c.token_ids]
        texts[index] = parse(ids)[-1].content[0].text
    assert texts[1].endswith("(choice 1)") and not texts[0].endswith(")")


async def test_n2_non_stream_sends_one_complete_per_choice(sglang: sg_grpc.SglangSchedulerStub) -> None:
    responses = await collect(sglang.Generate(sg_request(PROMPT, n=2)))
    assert [r.complete.index for r in responses] == [0, 1]


async def test_strip_stop_token_omits_the_stop_id_but_names_it() -> None:
    async with (
        await start_sim_engine(SimConfig(strip_stop_token=True)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        done = (await collect(stub.Generate(sg_request(PROMPT))))[0].complete
        assert RETURN not in done.output_ids and done.matched_token_id == RETURN
        assert done.completion_tokens == len(done.output_ids) + 1
        chunks, completes = chunks_and_completes(
            await collect(stub.Generate(sg_request(PROMPT, stream=True)))
        )
        streamed = [t for c in chunks for t in c.token_ids]
        assert streamed == list(done.output_ids)
        assert list(chunks[-1].token_ids) == [] and completes[0].matched_token_id == RETURN


async def test_logprobs_are_returned_per_token(sglang: sg_grpc.SglangSchedulerStub) -> None:
    request = sg_request(PROMPT, stream=True)
    request.return_logprob = True
    request.top_logprobs_num = 3
    chunks, _ = chunks_and_completes(await collect(sglang.Generate(request)))
    first = chunks[0].output_logprobs
    assert list(first.token_ids) == list(chunks[0].token_ids)
    assert len(first.token_logprobs) == 1 and first.token_logprobs[0] <= 0
    assert len(first.top_logprobs[0].values) == 3 and first.top_logprobs[0].token_ids[0] == first.token_ids[0]


async def test_cached_tokens_reflect_a_shared_prefix(sglang: sg_grpc.SglangSchedulerStub) -> None:
    first = (await collect(sglang.Generate(sg_request(PROMPT))))[0].complete
    assert first.cached_tokens == 0
    longer = render(user("What is the capital of France?"), user("And of Spain?"))
    again = (await collect(sglang.Generate(sg_request(longer))))[0].complete
    assert 0 < again.cached_tokens < len(longer)
    assert again.cached_tokens % 16 == 0


async def test_prompt_longer_than_context_is_invalid_argument() -> None:
    async with (
        await start_sim_engine(SimConfig(max_context_length=10)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(sg_request(PROMPT)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_abort_stops_a_slow_stream_and_is_recorded() -> None:
    async with (
        await start_sim_engine(SimConfig(tokens_per_second=20)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        call = stub.Generate(sg_request(PROMPT, stream=True, request_id="slow"))
        first = await call.read()
        assert first.chunk.token_ids
        reply = await stub.Abort(sg.AbortRequest(request_id="slow"))
        assert reply.success
        rest = []
        async with asyncio.timeout(1.0):
            while (response := await call.read()) is not grpc.aio.EOF:
                rest.append(response)
        assert rest[-1].complete.finish_reason == "abort"
        assert sim.aborted == ["slow"]
        assert sim.active_requests == 0
        assert not (await stub.Abort(sg.AbortRequest(request_id="gone"))).success


async def test_client_cancel_is_not_an_abort() -> None:
    async with (
        await start_sim_engine(SimConfig(tokens_per_second=50)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        call = stub.Generate(sg_request(PROMPT, stream=True))
        await call.read()
        call.cancel()
        async with asyncio.timeout(1.0):
            while sim.active_requests:
                await asyncio.sleep(0.01)
        assert sim.aborted == []


async def test_ttft_delays_the_first_token() -> None:
    async with (
        await start_sim_engine(SimConfig(ttft_ms=150)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        loop = asyncio.get_running_loop()
        started = loop.time()
        call = stub.Generate(sg_request(PROMPT, stream=True))
        await call.read()
        assert loop.time() - started >= 0.14
        call.cancel()


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
async def test_fail_next_before_any_token(sim: RunningSim, sglang: sg_grpc.SglangSchedulerStub, code) -> None:
    sim.fail_next(code)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain(sglang.Generate(sg_request(PROMPT, stream=True)), received)
    assert err.value.code() == code and received == []
    # One-shot: the next call succeeds.
    assert (await collect(sglang.Generate(sg_request(PROMPT))))[0].complete.finish_reason == "stop"


async def test_fail_next_mid_stream(sim: RunningSim, sglang: sg_grpc.SglangSchedulerStub) -> None:
    sim.fail_next(grpc.StatusCode.INTERNAL, after_tokens=5)
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain(sglang.Generate(sg_request(PROMPT, stream=True)), received)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert [r.WhichOneof("response") for r in received] == ["chunk"] * 5


async def test_fail_next_non_stream(sim: RunningSim, sglang: sg_grpc.SglangSchedulerStub) -> None:
    sim.fail_next(grpc.StatusCode.UNAVAILABLE, after_tokens=3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(sglang.Generate(sg_request(PROMPT)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_prefill_mode_returns_no_tokens_and_records_the_room() -> None:
    config = SimConfig(mode="prefill", bootstrap_port=9123)
    async with await start_sim_engine(config) as sim, grpc.aio.insecure_channel(sim.address) as channel:
        stub = sg_grpc.SglangSchedulerStub(channel)
        info = await stub.GetServerInfo(sg.GetServerInfoRequest())
        assert info.server_args["disaggregation_mode"] == "prefill"
        assert info.server_args["disaggregation_bootstrap_port"] == 9123
        request = sg_request(PROMPT, stream=True)
        request.disaggregated_params.CopyFrom(
            sg.DisaggregatedParams(bootstrap_host="10.0.0.1", bootstrap_port=9123, bootstrap_room=0)
        )
        chunks, completes = chunks_and_completes(await collect(stub.Generate(request)))
        assert len(chunks) == 1 and list(chunks[0].token_ids) == []
        assert completes[0].finish_reason == "stop" and list(completes[0].output_ids) == []
        assert completes[0].prompt_tokens == len(PROMPT)
        recorded = sim.requests[0]
        assert (recorded.bootstrap_host, recorded.bootstrap_port, recorded.bootstrap_room) == (
            "10.0.0.1",
            9123,
            0,
        )
        request.stream = False
        responses = await collect(stub.Generate(request))
        assert len(responses) == 1 and list(responses[0].complete.output_ids) == []


async def test_decode_mode_generates_and_records_the_room() -> None:
    async with (
        await start_sim_engine(SimConfig(mode="decode")) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        request = sg_request(PROMPT)
        request.disaggregated_params.CopyFrom(
            sg.DisaggregatedParams(bootstrap_host="10.0.0.1", bootstrap_port=8998, bootstrap_room=42)
        )
        done = (await collect(stub.Generate(request)))[0].complete
        assert done.matched_token_id == RETURN
        assert sim.requests[0].bootstrap_room == 42


async def test_non_harmony_mode_echoes_the_prompt_reversed() -> None:
    async with (
        await start_sim_engine(SimConfig(harmony=False, model="Qwen/Qwen2-0.5B", eos_token_id=2)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        info = await stub.GetModelInfo(sg.GetModelInfoRequest())
        assert (info.model_type, list(info.architectures), list(info.eos_token_ids)) == (
            "qwen2",
            ["Qwen2ForCausalLM"],
            [2],
        )
        request = sg_request([11, 12, 13])
        del request.sampling_params.stop_token_ids[:]
        done = (await collect(stub.Generate(request)))[0].complete
        assert list(done.output_ids) == [13, 12, 11, 2] and done.matched_token_id == 2


async def test_restart_on_the_same_port() -> None:
    sim = await start_sim_engine(SimConfig())
    port = sim.port
    await sim.stop()
    async with await start_sim_engine(SimConfig(port=port)) as again:
        assert again.port == port and again.url == f"grpc://127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(again.address) as channel:
            stub = sg_grpc.SglangSchedulerStub(channel)
            assert (await stub.HealthCheck(sg.HealthCheckRequest())).healthy


async def test_repeated_streams_reuse_frames_with_their_own_request_ids(
    sglang: sg_grpc.SglangSchedulerStub,
) -> None:
    runs = []
    for name in ("a", "bb", "c" * 200):
        responses = await collect(sglang.Generate(sg_request(PROMPT, stream=True, request_id=name)))
        assert {r.request_id for r in responses} == {name}
        runs.append(responses)
    assert runs[1] == [
        sg.GenerateResponse(request_id="bb", chunk=r.chunk)
        if r.WhichOneof("response") == "chunk"
        else sg.GenerateResponse(request_id="bb", complete=r.complete)
        for r in runs[2]
    ]
