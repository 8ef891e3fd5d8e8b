"""The fleet's start-up probes: a worker that never answered is named as unreachable and tried again
after the retry interval, twice as long after each failure up to a cap; clients hear it is unreachable;
the worker that joins is one line (URL → engine protocol → model); `served_model_name` renames."""

from __future__ import annotations

import logging
import time

import pytest

from harmony_gateway.engines.base import ModelInfo
from harmony_gateway.errors import NoHealthyWorker, UpstreamUnavailable
from harmony_gateway.routing.fleet import MAX_RETRY_INTERVAL, Fleet


class Engine:
    """Unreachable until `up`; then serves `model`."""

    engine = "sglang"

    def __init__(self, model: str = "openai/gpt-oss-20b") -> None:
        self.up = False
        self.model = model

    async def model_info(self, timeout: float) -> ModelInfo:
        if not self.up:
            raise UpstreamUnavailable("connection refused")
        return ModelInfo(served_model_name=self.model)

    async def health(self, timeout: float) -> bool:
        return self.up

    async def close(self) -> None:
        pass


def fleet_of(engines: dict[str, Engine], **options: object) -> Fleet:
    return Fleet(
        client_factory=lambda url, engine: engines[url],  # type: ignore[arg-type,return-value]
        policy_factory=lambda model, role: None,
        retry_interval=2.0,
        **options,  # type: ignore[arg-type]
    )


async def test_an_unreachable_worker_backs_off_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    fleet = fleet_of({"grpc://e:1": engine})
    caplog.set_level(logging.INFO, "harmony_gateway.routing.fleet")
    worker = await fleet.admit("grpc://e:1")
    waits = []
    for _ in range(7):
        waits.append(round(worker.next_probe_at - time.monotonic(), 1))
        assert not fleet.due_for_probe(worker, now=worker.next_probe_at - 0.01)
        assert fleet.due_for_probe(worker, now=worker.next_probe_at)
        await fleet.probe(worker)
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, MAX_RETRY_INTERVAL, MAX_RETRY_INTERVAL]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == (
        f"worker {worker.id} grpc://e:1 is unreachable: connection refused; trying again in 2 s"
    )
    assert messages[2].startswith(f"worker {worker.id} grpc://e:1 is still unreachable after 3 tries")
    with pytest.raises(NoHealthyWorker, match="a worker is unreachable, so the model it serves is not known"):
        fleet.group("openai/gpt-oss-20b")
    engine.up = True
    caplog.clear()
    assert await fleet.probe(worker)
    assert not fleet.due_for_probe(worker, now=worker.next_probe_at)
    assert [r.getMessage() for r in caplog.records] == [
        f"worker {worker.id} grpc://e:1 → sglang → openai/gpt-oss-20b (Harmony), after 8 failed tries"
    ]
    assert fleet.group("openai/gpt-oss-20b").workers == [worker]


async def test_a_worker_not_probed_yet_is_still_starting() -> None:
    fleet = fleet_of({"grpc://e:1": Engine()})
    fleet.create_worker("grpc://e:1")
    with pytest.raises(NoHealthyWorker, match="workers are still starting"):
        fleet.group("m")


async def test_served_model_name_renames_the_one_model() -> None:
    engines = {"grpc://a:1": Engine(), "grpc://b:1": Engine(), "grpc://c:1": Engine("acme/other")}
    for engine in engines.values():
        engine.up = True
    fleet = fleet_of(engines, served_model_name="gpt-oss")
    a, b, c = [await fleet.admit(url) for url in engines]
    assert list(fleet.groups) == ["gpt-oss"]
    group = fleet.group("gpt-oss")
    assert group.workers == [a, b] and group.harmony  # Harmony as the engines' own name says
    assert a.model_id == "gpt-oss"
    assert c.model_info is None and "already stands for 'openai/gpt-oss-20b'" in c.probe_error
