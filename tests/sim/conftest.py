"""Loopback fixtures for the simulated engine: a running sim of each protocol and a stub for it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sg_grpc
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vl_grpc

from harmony_gateway.sim import RunningSim, SimConfig, start_sim_engine


@pytest.fixture
async def sim() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig()) as running:
        yield running


@pytest.fixture
async def sglang(sim: RunningSim) -> AsyncIterator[sg_grpc.SglangSchedulerStub]:
    async with grpc.aio.insecure_channel(sim.address) as channel:
        yield sg_grpc.SglangSchedulerStub(channel)


@pytest.fixture
async def vllm_sim() -> AsyncIterator[RunningSim]:
    async with await start_sim_engine(SimConfig(engine="vllm")) as running:
        yield running


@pytest.fixture
async def vllm(vllm_sim: RunningSim) -> AsyncIterator[vl_grpc.VllmEngineStub]:
    async with grpc.aio.insecure_channel(vllm_sim.address) as channel:
        yield vl_grpc.VllmEngineStub(channel)
