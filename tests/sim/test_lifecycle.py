"""Public surface and process lifecycle of the simulated engine."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sg
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc

import harmony_gateway.sim as sim_package
from harmony_gateway.sim import SimConfig, serve_forever, start_sim_engine

from ._helpers import collect, render, sg_request, user


def test_exported_members() -> None:
    assert sorted(sim_package.__all__) == sorted(
        [
            "TRIGGERS",
            "CacheState",
            "HarmonyScript",
            "LoadFigures",
            "PromptSummary",
            "ReceivedRequest",
            "RunningSim",
            "SimConfig",
            "ToolParam",
            "ToolSpec",
            "echo_reply",
            "parse_tool_namespaces",
            "serve_forever",
            "start_sim_engine",
        ]
    )
    for name in sim_package.__all__:
        assert getattr(sim_package, name) is not None


async def test_serve_forever_runs_until_sigterm() -> None:
    probe = await start_sim_engine(SimConfig())
    port = probe.port
    await probe.stop()
    task = asyncio.create_task(serve_forever(SimConfig(port=port)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = sg_grpc.SglangSchedulerStub(channel)
        reply = await stub.HealthCheck(sg.HealthCheckRequest(), wait_for_ready=True, timeout=5)
        assert reply.healthy
        os.kill(os.getpid(), signal.SIGTERM)
        async with asyncio.timeout(5):
            await task


async def test_non_stream_abort_wakes_the_paced_request() -> None:
    async with (
        await start_sim_engine(SimConfig(tokens_per_second=5)) as sim,
        grpc.aio.insecure_channel(sim.address) as channel,
    ):
        stub = sg_grpc.SglangSchedulerStub(channel)
        pending = asyncio.ensure_future(
            collect(stub.Generate(sg_request(render(user("hi")), request_id="ns")))
        )
        async with asyncio.timeout(2):
            while not sim.active_requests:
                await asyncio.sleep(0.005)
            await stub.Abort(sg.AbortRequest(request_id="ns"))
            responses = await pending
        assert [r.complete.finish_reason for r in responses] == ["abort"]
        assert sim.aborted == ["ns"]
