"""The SGLang engine client's request conversion."""

from __future__ import annotations

import logging

import pytest

from harmony_gateway.engines import sglang_grpc
from harmony_gateway.engines.base import GenerateRequest, SamplingOptions
from harmony_gateway.engines.sglang_grpc import SglangGrpcClient


async def test_seed_is_dropped_with_one_warning_per_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sglang_grpc, "_seed_warned", False)
    client = SglangGrpcClient("grpc://127.0.0.1:1")
    try:
        with caplog.at_level(logging.WARNING, logger=sglang_grpc.__name__):
            for rid in ("a", "b"):
                request = GenerateRequest(request_id=rid, input_ids=[1, 2], sampling=SamplingOptions(seed=7))
                assert client.to_proto(request).sampling_params.temperature == 1.0
            client.to_proto(GenerateRequest(request_id="c", input_ids=[1], sampling=SamplingOptions()))
    finally:
        await client.close()
    warnings = [r for r in caplog.records if "seed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
