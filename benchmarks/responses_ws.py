"""A client-driven tool loop over the Responses API's WebSocket mode against HTTP+SSE.

Each loop is an agent's tool loop of `--turns` turns (20 by default): the model calls a function every
turn (the simulated engine's `[[repeat]]`), the client answers each call with a `function_call_output`
and `previous_response_id`, and sends the tools again, as agents do. Three transports run the same loops:

- `ws`: one WebSocket per loop, `store: false` (the chain continues from the socket's cache);
- `ws-store`: one WebSocket per loop, `store: true`;
- `http`: `POST /v1/responses` with `stream: true` per turn on a kept-alive HTTP connection,
  `store: true` (HTTP continues only from stored responses).

The script starts `harmony-gateway sim-engine` (answers at once unless `--sim-arg` paces it) and
`harmony-gateway serve --storage memory://` on free loopback ports, runs `--warmup` unmeasured loops, then
`--loops` loops per transport and concurrency, with the transports interleaved round by round so a busy
machine weighs on each alike. Every turn is checked (a `function_call` each, `response.completed`).
Columns: loop latency p50/p90 (first send to the last turn's `response.completed`), turn latency p50, and
the gateway's CPU per loop (user+system of its process over the cell, divided by the loops).

    .venv/bin/python benchmarks/responses_ws.py
    .venv/bin/python benchmarks/responses_ws.py --concurrency 1,8 --loops 40 --json-out ws.jsonl
    .venv/bin/python benchmarks/responses_ws.py --sim-arg=--tokens-per-second --sim-arg=200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import websockets
from bench_gateway import CpuMeter, free_port, gateway_command, percentile, stop, wait_for_port, wait_ready

MODEL = "openai/gpt-oss-20b"
TRANSPORTS = ("ws", "ws-store", "http")
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
FIRST_INPUT = "[[repeat]] please call get_weather for Paris"


@dataclass
class Cell:
    transport: str
    concurrency: int
    loops: list[float] = field(default_factory=list)
    turns: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    cpu_seconds: float = 0.0
    wall: float = 0.0


def turn_body(previous: dict[str, Any] | None, store: bool) -> dict[str, Any]:
    """The next turn of a loop: the first user message, then the answer to the previous call."""
    body: dict[str, Any] = {"model": MODEL, "tools": TOOLS, "store": store}
    if previous is None:
        body["input"] = FIRST_INPUT
        return body
    call = previous["output"][-1]
    if call.get("type") != "function_call":
        raise RuntimeError(f"turn ended with {call.get('type')}, not a function call")
    body["previous_response_id"] = previous["id"]
    body["input"] = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny, 21 C"}]
    return body


def finished(event: dict[str, Any]) -> dict[str, Any]:
    if event["type"] != "response.completed":
        raise RuntimeError(f"turn ended with {event['type']}: {json.dumps(event)[:200]}")
    return event["response"]  # type: ignore[no-any-return]


async def ws_loop(url: str, turns: int, store: bool, cell: Cell | None) -> None:
    async with websockets.connect(url, max_size=None, compression=None) as ws:
        previous = None
        for _ in range(turns):
            started = time.perf_counter()
            await ws.send(json.dumps({"type": "response.create", **turn_body(previous, store)}))
            while True:
                message = await ws.recv()
                if _terminal(message):  # only the event that ends a turn is decoded
                    previous = finished(json.loads(message))
                    break
            if cell is not None:
                cell.turns.append(time.perf_counter() - started)


def _terminal(message: str | bytes) -> bool:
    head = message[:48] if isinstance(message, bytes) else message[:48].encode()
    return head.startswith(
        (b'{"type":"response.completed"', b'{"type":"response.failed"', b'{"type":"error"')
    )


async def http_loop(session: aiohttp.ClientSession, url: str, turns: int, cell: Cell | None) -> None:
    previous = None
    for _ in range(turns):
        started = time.perf_counter()
        body = dict(turn_body(previous, True), stream=True)
        async with session.post(url, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"http {r.status}: {(await r.text())[:200]}")
            event = None
            async for raw in r.content:  # one SSE line at a time
                if raw.startswith(b"data: ") and _terminal(raw[6:]):
                    event = json.loads(raw[6:])
        if event is None:
            raise RuntimeError("the stream ended without a terminal event")
        previous = finished(event)
        if cell is not None:
            cell.turns.append(time.perf_counter() - started)


async def one_loop(
    base: str, transport: str, turns: int, session: aiohttp.ClientSession, cell: Cell | None
) -> None:
    started = time.perf_counter()
    try:
        if transport == "http":
            await http_loop(session, base + "/v1/responses", turns, cell)
        else:
            ws_url = base.replace("http://", "ws://") + "/v1/responses"
            await ws_loop(ws_url, turns, transport == "ws-store", cell)
    except Exception as exc:
        if cell is None:
            raise
        cell.errors.append(f"{type(exc).__name__}: {exc}"[:200])
        return
    if cell is not None:
        cell.loops.append(time.perf_counter() - started)


async def run_cell(
    base: str, cell: Cell, loops: int, turns: int, cpu: CpuMeter, session: aiohttp.ClientSession
) -> None:
    """`loops` loops, `cell.concurrency` at a time; the gateway's CPU over them is added to the cell."""
    queue = list(range(loops))

    async def worker() -> None:
        while queue:
            queue.pop()
            await one_loop(base, cell.transport, turns, session, cell)

    before, wall = cpu.seconds() or 0.0, time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
    cell.wall += time.perf_counter() - wall
    cell.cpu_seconds += (cpu.seconds() or 0.0) - before


def summarize(cell: Cell, turns: int) -> dict[str, Any]:
    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1000, 1)

    done = len(cell.loops)
    return {
        "transport": cell.transport,
        "concurrency": cell.concurrency,
        "turns_per_loop": turns,
        "loops": done,
        "errors": len(cell.errors),
        "first_error": cell.errors[0] if cell.errors else None,
        "loop_ms": {"p50": ms(percentile(cell.loops, 50)), "p90": ms(percentile(cell.loops, 90))},
        "turn_ms_p50": ms(percentile(cell.turns, 50)),
        "gateway_cpu_ms_per_loop": round(cell.cpu_seconds * 1000 / done, 1) if done else None,
        "gateway_cpu_ms_per_turn": round(cell.cpu_seconds * 1000 / (done * turns), 2) if done else None,
        "loops_per_s": round(done / cell.wall, 2) if cell.wall else None,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = "| transport | c | loops | loop p50 ms | loop p90 ms | turn p50 ms | gateway CPU ms/loop | CPU ms/turn | errors |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    lines.extend(
        f"| {r['transport']} | {r['concurrency']} | {r['loops']} | {r['loop_ms']['p50']} "
        f"| {r['loop_ms']['p90']} | {r['turn_ms_p50']} | {r['gateway_cpu_ms_per_loop']} "
        f"| {r['gateway_cpu_ms_per_turn']} | {r['errors']} |"
        for r in rows
    )
    return "\n".join(lines)


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, int]]:
    """The started sim-engine and gateway: (gateway base URL, gateway pid); both stopped afterwards."""
    started: list[subprocess.Popen[bytes]] = []
    quiet = None if args.verbose else subprocess.DEVNULL
    try:
        port = free_port()
        cmd = [*gateway_command(), "sim-engine", "--host", "127.0.0.1", "--port", str(port), *args.sim_arg]
        started.append(subprocess.Popen(cmd, stdout=quiet, stderr=quiet))
        wait_for_port(port, started[-1], 60)
        worker = f"grpc://127.0.0.1:{port}"
        port = free_port()
        cmd = [
            *gateway_command(),
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-url",
            worker,
        ]
        cmd += ["--storage", "memory://", "--log-level", "warning", *args.gateway_arg]
        started.append(subprocess.Popen(cmd, stdout=quiet, stderr=quiet))
        wait_for_port(port, started[-1], 60)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base, 30))
        yield base, started[-1].pid
    finally:
        for proc in reversed(started):
            stop(proc)


async def drive(base: str, pid: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    cpu = CpuMeter(pid)
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        for transport in args.transports:  # warm-up: every path loaded once before anything is measured
            await asyncio.gather(
                *(one_loop(base, transport, args.turns, session, None) for _ in range(args.warmup))
            )
        for concurrency in args.concurrency:
            cells = {t: Cell(t, concurrency) for t in args.transports}
            # Round-robin rounds: each transport runs `concurrency` loops per round, in turn.
            for _ in range(max(1, args.loops // concurrency)):
                for transport in args.transports:
                    await run_cell(base, cells[transport], concurrency, args.turns, cpu, session)
            for transport in args.transports:
                row = summarize(cells[transport], args.turns)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated: ws, ws-store, http")
    p.add_argument("--concurrency", default="1,8", help="loops at once, comma-separated levels")
    p.add_argument("--loops", type=int, default=40, help="measured loops per transport and level")
    p.add_argument("--turns", type=int, default=20, help="turns per loop (tool calls answered)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured loops per transport")
    p.add_argument("--sim-arg", action="append", default=[], help="extra argument for `sim-engine`")
    p.add_argument("--gateway-arg", action="append", default=[], help="extra argument for `serve`")
    p.add_argument("--json-out", help="append one JSON line per transport and level")
    p.add_argument("--verbose", action="store_true", help="show the started processes' output")
    args = p.parse_args()
    args.transports = args.transports.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    unknown = set(args.transports) - set(TRANSPORTS)
    if unknown:
        p.error(f"unknown transports: {', '.join(sorted(unknown))}")
    if args.loops < 1 or args.turns < 1:
        p.error("--loops and --turns must be at least 1")
    with services(args) as (base, pid):
        rows = asyncio.run(drive(base, pid, args))
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    print(table(rows))


if __name__ == "__main__":
    main()
