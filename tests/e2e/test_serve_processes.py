"""`serve --workers 2` end to end: two real gateway processes on one port, SQLite storage in tmp_path.

Registered workers, their health and the metrics are shared by both processes. Which process answered
a request is read from prometheus-client's per-process files (`counter_<pid>.db`, `gauge_*_<pid>.db`
in `PROMETHEUS_MULTIPROC_DIR`), so the tests can tell that each process, not just one, did its part.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.mmap_dict import MmapedDict

from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import next_request_id, served_by, sims
from tests.support.processes import GatewayProcess, start_gateway_process

pytestmark = pytest.mark.timeout(150)

OTHER_MODEL = "other-model"
#: How long after a worker change every process must route accordingly: one reconcile interval (1 s)
#: plus slack for a loaded machine.
PROPAGATION_BOUND = 3.0

ADMIN_KEY = "sk-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def _pid_values(metrics_dir: Path, prefix: str, metric: str) -> dict[int, list[tuple[dict[str, str], float]]]:
    """Per live process: the (labels, value) samples of `metric` in its `<prefix>*_<pid>.db` files."""
    out: dict[int, list[tuple[dict[str, str], float]]] = {}
    for path in metrics_dir.glob(f"{prefix}*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        for key, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            _metric_name, name, labels, _help = json.loads(key)
            if name == metric:
                out.setdefault(pid, []).append((labels, value))
    return out


def served_by_process(
    metrics_dir: Path, model: str | None = None, status: str | None = None
) -> dict[int, float]:
    """Requests each live gateway process answered, for `model` and with `status` when given."""
    samples = _pid_values(metrics_dir, "counter", "gateway_requests_total")
    return {
        pid: sum(
            v for labels, v in rows if model in (None, labels["model"]) and status in (None, labels["status"])
        )
        for pid, rows in samples.items()
    }


def healthy_by_process(metrics_dir: Path, worker_id: str) -> dict[int, float]:
    samples = _pid_values(metrics_dir, "gauge_livemax", "gateway_worker_healthy")
    return {
        pid: max(v for labels, v in rows if labels["worker"] == worker_id)
        for pid, rows in samples.items()
        if any(labels["worker"] == worker_id for labels, _ in rows)
    }


#: No keep-alive: a new connection per request, so the kernel hands requests to both processes.
FRESH_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)


async def fresh_chat(http: httpx.AsyncClient, model: str, request_id: str) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "What is 2+2?"}]},
        headers={"x-request-id": request_id},
    )


async def get_json(base: str, path: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=base, timeout=10, limits=FRESH_CONNECTIONS, headers=ADMIN) as http:
        r = await http.get(path)
        assert r.status_code == 200, r.text
        return dict(r.json())


@pytest.fixture
def metrics_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "metrics"
    path.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    return path


async def two_processes(static_url: str, tmp_path: Path, *extra: str) -> GatewayProcess:
    return await start_gateway_process(
        "--workers",
        "2",
        "--worker-url",
        static_url,
        "--storage",
        f"sqlite:///{tmp_path / 'gateway.db'}",
        "--health-failure-threshold",
        "2",
        "--admin-key",
        ADMIN_KEY,
        "--worker-allow-hosts",
        "127.0.0.1",
        *extra,
    )


@pytest.fixture
async def engines() -> AsyncIterator[list]:  # type: ignore[type-arg]
    async with sims(SimConfig(), SimConfig(model=OTHER_MODEL)) as started:
        yield started


async def burst(base: str, model: str, n: int) -> list[tuple[str, httpx.Response]]:
    ids = [next_request_id("mp") for _ in range(n)]
    async with httpx.AsyncClient(base_url=base, timeout=20, limits=FRESH_CONNECTIONS) as http:
        responses = await asyncio.gather(*(fresh_chat(http, model, rid) for rid in ids))
    return list(zip(ids, responses, strict=True))


async def test_registered_worker_is_routed_to_by_both_processes_then_deleted_everywhere(
    engines: list,
    tmp_path: Path,
    metrics_dir: Path,  # type: ignore[type-arg]
) -> None:
    static, extra = engines
    gw = await two_processes(static.url, tmp_path)
    base = f"http://127.0.0.1:{gw.port}"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10, headers=ADMIN) as http:
            r = await http.post("/workers", json={"url": extra.url})
            assert r.status_code == 201, r.text
            worker_id = r.json()["id"]
        registered_at = time.monotonic()

        # Every request sent once the bound has passed must reach the new worker, whichever process
        # answers; keep sending until both processes have answered some of them.
        ok = 0
        deadline = time.monotonic() + 40
        while True:
            before = served_by_process(metrics_dir, OTHER_MODEL)
            for rid, response in await burst(base, OTHER_MODEL, 8):
                if time.monotonic() - registered_at < PROPAGATION_BOUND:
                    continue
                assert response.status_code == 200, response.text
                assert served_by(rid, [static, extra]) == [1]
                ok += 1
            after = served_by_process(metrics_dir, OTHER_MODEL)
            if (
                ok >= 16
                and len(after) == 2
                and time.monotonic() - registered_at > PROPAGATION_BOUND
                and all(after[pid] > before.get(pid, 0) for pid in after)
            ):
                break
            assert time.monotonic() < deadline, f"requests did not reach both processes: {after}"

        # /metrics, whichever process answers, adds up the requests both processes served.
        async with httpx.AsyncClient(base_url=base, timeout=10, headers=ADMIN) as http:
            text = (await http.get("/metrics")).text
        scraped = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("gateway_requests_total{")
            and f'model="{OTHER_MODEL}"' in line
            and 'status="200"' in line
        )
        # Answered ones only: a request that reached a process before it learnt of the worker is a 404
        # that counts in the metrics and never reaches the engine.
        per_process = served_by_process(metrics_dir, OTHER_MODEL, "200")
        assert len(per_process) == 2 and all(v > 0 for v in per_process.values())
        assert scraped == sum(per_process.values()) == len(extra.requests)
        # Each live process's own process_* values, labelled with its pid.
        resident = {
            line.split('pid="', 1)[1].split('"', 1)[0]
            for line in text.splitlines()
            if line.startswith("process_resident_memory_bytes{")
        }
        assert resident == {str(pid) for pid in per_process}
        # Worker gauges are merged too: one healthy series for the worker and, once every process has
        # refreshed its gauges (each does about once a second), nothing left in flight.
        want = ["gateway_worker_healthy 1.0", "gateway_worker_in_flight 0.0"]
        deadline = time.monotonic() + 10
        while True:
            gauges = sorted(
                line.split("{")[0] + " " + line.rsplit(" ", 1)[1]
                for line in text.splitlines()
                if line.startswith(("gateway_worker_healthy{", "gateway_worker_in_flight{"))
                and f'worker="{worker_id}"' in line
            )
            if gauges == want or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=base, timeout=10, headers=ADMIN) as http:
                text = (await http.get("/metrics")).text
        assert gauges == want

        # Both processes list the same workers.
        listings = {
            json.dumps(sorted((w["id"], w["url"]) for w in (await get_json(base, "/workers"))["data"]))  # type: ignore[union-attr]
            for _ in range(8)
        }
        assert listings == {json.dumps(sorted([("w1", static.url), (worker_id, extra.url)]))}

        async with httpx.AsyncClient(base_url=base, timeout=10, headers=ADMIN) as http:
            r = await http.delete(f"/workers/{worker_id}")
            assert r.status_code == 200, r.text
        deleted_at = time.monotonic()
        seen_404: dict[int, float] = {}
        deadline = time.monotonic() + 40
        while True:
            before = served_by_process(metrics_dir, status="404")
            for _rid, response in await burst(base, OTHER_MODEL, 8):
                if time.monotonic() - deleted_at < PROPAGATION_BOUND:
                    continue
                assert response.status_code == 404, response.text
                assert response.json()["error"]["code"] == "model_not_found"
            after = served_by_process(metrics_dir, status="404")
            if time.monotonic() - deleted_at > PROPAGATION_BOUND:
                for pid in after:
                    if after[pid] > before.get(pid, 0):
                        seen_404[pid] = after[pid]
            if len(seen_404) == 2:
                break
            assert time.monotonic() < deadline, "404s did not come from both processes"
        listed = (await get_json(base, "/workers"))["data"]
        assert [w["url"] for w in listed] == [static.url]  # type: ignore[union-attr]
    finally:
        gw.stop()


def _lease_holder(db: Path) -> tuple[str, float] | None:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT owner, expires_at FROM leases WHERE name = 'health'").fetchone()
    return (str(row[0]), float(row[1])) if row else None


async def test_health_is_shared_and_survives_the_lease_holder_dying(
    engines: list,
    tmp_path: Path,
    metrics_dir: Path,  # type: ignore[type-arg]
) -> None:
    static, extra = engines
    gw = await two_processes(static.url, tmp_path)
    base = f"http://127.0.0.1:{gw.port}"
    db = tmp_path / "gateway.db"
    try:
        async with httpx.AsyncClient(base_url=base, timeout=10, headers=ADMIN) as http:
            r = await http.post("/workers", json={"url": extra.url})
            assert r.status_code == 201, r.text
            worker_id = r.json()["id"]

        # Both processes know the worker as healthy (their own gauges), and one holds the lease.
        deadline = time.monotonic() + 30
        while True:
            await burst(base, OTHER_MODEL, 4)  # scrapes refresh gauges; requests wake both up
            views = healthy_by_process(metrics_dir, worker_id)
            holder = _lease_holder(db)
            if len(views) == 2 and set(views.values()) == {1.0} and holder is not None:
                break
            assert time.monotonic() < deadline, f"worker not healthy in both processes: {views}"
            await asyncio.sleep(0.1)
        holder_pid = int(holder[0].rsplit(":", 1)[1])
        assert holder_pid in views

        # The holder dies without releasing: the other process takes the lease over at expiry.
        os.kill(holder_pid, 9)
        deadline = time.monotonic() + 30
        while True:
            current = _lease_holder(db)
            if current is not None and int(current[0].rsplit(":", 1)[1]) != holder_pid:
                break
            assert time.monotonic() < deadline, "nobody took the health lease over"
            await asyncio.sleep(0.2)

        new_holder = int(current[0].rsplit(":", 1)[1])
        # uvicorn's supervisor replaces the killed process; wait until the replacement serves and
        # knows the worker too, so that both live processes are checked below.
        deadline = time.monotonic() + 40
        while True:
            await burst(base, OTHER_MODEL, 4)
            views = healthy_by_process(metrics_dir, worker_id)
            if len(views) == 2 and set(views.values()) == {1.0}:
                break
            assert time.monotonic() < deadline, f"no replacement process knows the worker: {views}"
            await asyncio.sleep(0.1)
        assert holder_pid not in views and new_holder in views
        # The survivors drop the dead process's live gauges, so its last values do not linger in sums.
        deadline = time.monotonic() + 10
        while any(metrics_dir.glob(f"gauge_live*_{holder_pid}.db")):
            assert time.monotonic() < deadline, "the dead process's gauge files were not reaped"
            await asyncio.sleep(0.1)

        # The engine stops: both processes mark it unhealthy within the health bound (failure
        # threshold x interval, plus a reconcile for the process that reads the shared result).
        await extra.stop()
        stopped_at = time.monotonic()
        deadline = stopped_at + 30
        while True:
            views = healthy_by_process(metrics_dir, worker_id)
            if len(views) == 2 and set(views.values()) == {0.0}:
                break
            assert time.monotonic() < deadline, f"worker still healthy somewhere: {views}"
            await asyncio.sleep(0.05)
        # 2 failed probes 0.5 s apart, the probe timeout (2 s), one reconcile (1 s), and slack.
        assert time.monotonic() - stopped_at < 0.5 * 2 + 2.0 + 1.0 + 3.0
        for _rid, response in await burst(base, OTHER_MODEL, 8):
            assert response.status_code == 503, response.text
        listed = {w["id"]: w for w in (await get_json(base, "/workers"))["data"]}  # type: ignore[union-attr]
        assert listed[worker_id]["healthy"] is False
    finally:
        gw.stop()
