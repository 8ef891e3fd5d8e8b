"""What the gateway itself costs: load it in front of a simulated engine that answers at once.

By default the script starts `harmony-gateway sim-engine --output-tokens 64` (a fixed 64-token Harmony
answer, one token per streamed message) and `harmony-gateway serve --storage memory://` in subprocesses
on free loopback ports, drives the gateway with a bounded async load generator, stops both by PID and
prints one table. `--worker-url` uses an external worker instead of the simulated engine (for example
the common yardstick worker of a side-by-side comparison); `--gateway-url` loads an already running
gateway (then pass `--gateway-pid` for its CPU).

Scenarios: chat, chat-stream (include_usage), responses, responses-stream (store=false). For each
scenario and concurrency level: a warm-up, then at most `--requests` requests or `--duration` seconds.
Columns: requests/s, latency p50/p90/p99, time to first token p50 (streams: first event carrying
reasoning or answer text), and gateway CPU per request (user+system time of the gateway process and its
children over the run, divided by the completed requests). Every response is checked (HTTP 200, answer
text, reasoning; streams end with `[DONE]` / `response.completed`); failures count as errors.

    .venv/bin/python benchmarks/bench_gateway.py                       # about 2 minutes
    .venv/bin/python benchmarks/bench_gateway.py --scenarios chat --concurrency 1 --duration 5
    .venv/bin/python benchmarks/bench_gateway.py --worker-url grpc://127.0.0.1:50051 --json-out out.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

PROMPT = "What is 2+2? Answer briefly."
MODEL = "openai/gpt-oss-20b"
SCENARIOS = ("chat", "chat-stream", "responses", "responses-stream")


@dataclass
class Sample:
    ok: bool
    latency: float
    ttft: float | None = None
    error: str | None = None


@dataclass
class Level:
    scenario: str
    concurrency: int
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    cpu_seconds: float | None = None


# -- processes ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway_command() -> list[str]:
    exe = Path(sys.executable).with_name("harmony-gateway")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("harmony-gateway")
    return [found] if found else [sys.executable, "-m", "harmony_gateway"]


def wait_for_port(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"process {proc.args!r} exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise SystemExit(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


async def wait_ready(base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(base + "/readiness") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise SystemExit(f"gateway at {base} is not ready after {timeout:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


class CpuMeter:
    """User+system seconds of a process and its children (gateway worker processes)."""

    def __init__(self, pid: int | None) -> None:
        self.proc = psutil.Process(pid) if pid else None

    def seconds(self) -> float | None:
        if self.proc is None:
            return None
        total = 0.0
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except psutil.Error:
            return None
        for p in procs:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total


# -- load -------------------------------------------------------------------------------------------
def request_for(scenario: str, max_tokens: int | None) -> tuple[str, dict[str, Any]]:
    stream = scenario.endswith("-stream")
    if scenario.startswith("chat"):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if max_tokens:
            body["max_tokens"] = max_tokens
        return "/v1/chat/completions", body
    body = {"model": MODEL, "input": PROMPT, "stream": stream, "store": False}
    if max_tokens:
        body["max_output_tokens"] = max_tokens
    return "/v1/responses", body


def check_body(scenario: str, data: dict[str, Any]) -> str | None:
    """None when a non-stream body has reasoning and answer text, else what is wrong."""
    if scenario == "chat":
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError):
            return "no choices[0].message"
        if not message.get("content"):
            return "empty content"
        if not (message.get("reasoning_content") or message.get("reasoning")):
            return "no reasoning"
        return None
    if data.get("status") != "completed":
        return f"status {data.get('status')}"
    kinds = {item.get("type") for item in data.get("output") or []}
    if "message" not in kinds or "reasoning" not in kinds:
        return f"output items {sorted(k for k in kinds if k)}"
    return None


_TOKEN_EVENTS = (b'"response.output_text.delta"', b'"response.reasoning_text.delta"')


async def one_request(session: aiohttp.ClientSession, url: str, scenario: str, body: bytes) -> Sample:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
            if r.status != 200:
                text = (await r.text())[:120]
                return Sample(False, time.perf_counter() - t0, error=f"http {r.status}: {text}")
            if not scenario.endswith("-stream"):
                data = json.loads(await r.read())
                latency = time.perf_counter() - t0
                error = check_body(scenario, data)
                return Sample(error is None, latency, error=error)
            return await read_stream(r, scenario, t0)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Sample(False, time.perf_counter() - t0, error=type(exc).__name__)


async def read_stream(r: aiohttp.ClientResponse, scenario: str, t0: float) -> Sample:
    chat = scenario.startswith("chat")
    ttft = None
    reasoning = content = finished = False
    async for raw in r.content:  # one SSE line at a time
        if not raw.startswith(b"data:"):
            if raw.startswith(b"event: error") or raw.startswith(b"event: response.failed"):
                return Sample(False, time.perf_counter() - t0, error="stream error event")
            continue
        payload = raw[5:].strip()
        if chat:
            if payload == b"[DONE]":
                finished = True
                continue
            event = json.loads(payload)
            if "error" in event:
                return Sample(False, time.perf_counter() - t0, error="stream error chunk")
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    content = True
                elif delta.get("reasoning_content") or delta.get("reasoning"):
                    reasoning = True
                else:
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
            continue
        # Responses: classify by the event type without decoding every delta.
        if payload.startswith(b'{"type":') and payload[8:40].startswith(_TOKEN_EVENTS):
            if ttft is None:
                ttft = time.perf_counter() - t0
            if payload[8:40].startswith(_TOKEN_EVENTS[0]):
                content = True
            else:
                reasoning = True
            continue
        event = json.loads(payload)
        kind = event.get("type")
        if kind == "response.output_text.delta":
            content = True
        elif kind == "response.reasoning_text.delta":
            reasoning = True
        elif kind == "response.completed":
            finished = True
            continue
        elif kind in ("response.failed", "error"):
            return Sample(False, time.perf_counter() - t0, error=f"stream {kind}")
        else:
            continue
        if ttft is None:
            ttft = time.perf_counter() - t0
    latency = time.perf_counter() - t0
    if not finished:
        return Sample(False, latency, error="stream not finished")
    if not (content and reasoning):
        return Sample(False, latency, error="missing content or reasoning")
    return Sample(True, latency, ttft=ttft)


async def run_level(
    base: str,
    scenario: str,
    concurrency: int,
    args: argparse.Namespace,
    cpu: CpuMeter,
) -> Level:
    path, body = request_for(scenario, args.max_tokens)
    url = base + path
    payload = json.dumps(body).encode()
    level = Level(scenario, concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        warmup = iter(range(max(args.warmup, concurrency)))

        async def warm() -> None:
            for _ in warmup:
                await one_request(session, url, scenario, payload)

        await asyncio.gather(*(warm() for _ in range(concurrency)))

        budget = iter(range(args.requests))
        deadline = time.perf_counter() + args.duration

        async def drive() -> None:
            for _ in budget:
                if time.perf_counter() > deadline:
                    return
                level.samples.append(await one_request(session, url, scenario, payload))

        c0 = cpu.seconds()
        t0 = time.perf_counter()
        await asyncio.gather(*(drive() for _ in range(concurrency)))
        level.wall = time.perf_counter() - t0
        c1 = cpu.seconds()
        if c0 is not None and c1 is not None:
            level.cpu_seconds = c1 - c0
    return level


# -- report -----------------------------------------------------------------------------------------
def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(level: Level, label: str) -> dict[str, Any]:
    ok = [s for s in level.samples if s.ok]
    lat = [s.latency * 1000 for s in ok]
    ttft = [s.ttft * 1000 for s in ok if s.ttft is not None]
    errors: dict[str, int] = {}
    for s in level.samples:
        if not s.ok:
            errors[s.error or "?"] = errors.get(s.error or "?", 0) + 1

    def r(x: float | None, nd: int = 2) -> float | None:
        return None if x is None else round(x, nd)

    cpu_ms = None
    if level.cpu_seconds is not None and ok:
        cpu_ms = level.cpu_seconds * 1000 / len(ok)
    return {
        "label": label,
        "scenario": level.scenario,
        "concurrency": level.concurrency,
        "requests": len(level.samples),
        "errors": len(level.samples) - len(ok),
        "rps": round(len(ok) / level.wall, 1) if level.wall else 0.0,
        "lat_ms": {
            "p50": r(percentile(lat, 50)),
            "p90": r(percentile(lat, 90)),
            "p99": r(percentile(lat, 99)),
        },
        "ttft_ms_p50": r(percentile(ttft, 50)),
        "gateway_cpu_ms_per_request": r(cpu_ms, 3),
        "gateway_cpu_cores": r(level.cpu_seconds / level.wall if level.cpu_seconds and level.wall else None),
        "error_kinds": errors,
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "scenario",
        "conc",
        "n",
        "err",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "ttft p50",
        "cpu ms/req",
        "cores",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [
            row["scenario"],
            row["concurrency"],
            row["requests"],
            row["errors"],
            row["rps"],
            row["lat_ms"]["p50"],
            row["lat_ms"]["p90"],
            row["lat_ms"]["p99"],
            row["ttft_ms_p50"],
            row["gateway_cpu_ms_per_request"],
            row["gateway_cpu_cores"],
        ]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[str, int | None]]:
    """Yield (gateway base URL, gateway pid), starting what was not given; stop what was started."""
    started: list[subprocess.Popen[bytes]] = []
    quiet = None if args.verbose else subprocess.DEVNULL
    stack = contextlib.ExitStack()
    try:
        if args.gateway_url:
            yield args.gateway_url.rstrip("/"), args.gateway_pid
            return
        worker_url = args.worker_url
        if not worker_url:
            port = free_port()
            cmd = [*gateway_command(), "sim-engine", "--host", "127.0.0.1", "--port", str(port)]
            cmd += ["--output-tokens", str(args.output_tokens), "--log-level", "warning"]
            started.append(subprocess.Popen(cmd, stdout=quiet, stderr=quiet))
            wait_for_port(port, started[-1], 60)
            worker_url = f"grpc://127.0.0.1:{port}"
        port = free_port()
        cmd = [*gateway_command(), "serve", "--host", "127.0.0.1", "--port", str(port)]
        storage = "memory://"
        if args.workers > 1:  # processes must share storage; store=false requests never touch it
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gateway-"))
            storage = f"sqlite:///{tmp}/responses.db"
        cmd += ["--worker-url", worker_url, "--storage", storage, "--log-level", "warning"]
        cmd += ["--workers", str(args.workers), *args.gateway_arg]
        started.append(subprocess.Popen(cmd, stdout=quiet, stderr=quiet))
        wait_for_port(port, started[-1], 60)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base, 30))
        yield base, started[-1].pid
    finally:
        for proc in reversed(started):
            stop(proc)
        stack.close()


def append_json(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


async def drive_all(base: str, pid: int | None, args: argparse.Namespace) -> list[dict[str, Any]]:
    cpu = CpuMeter(pid)
    rows = []
    for scenario in args.scenarios.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            level = await run_level(base, scenario, concurrency, args, cpu)
            row = summarize(level, args.label)
            rows.append(row)
            print(
                f"{scenario:17} c={concurrency:<3} {row['rps']:8.1f} req/s  p50 {row['lat_ms']['p50']} ms"
                f"  cpu {row['gateway_cpu_ms_per_request']} ms/req  errors {row['errors']}",
                file=sys.stderr,
                flush=True,
            )
            if args.json_out:
                append_json(args.json_out, row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--worker-url", help="external engine worker (grpc://host:port); default: start a sim-engine"
    )
    p.add_argument("--gateway-url", help="load an already running gateway instead of starting one")
    p.add_argument("--gateway-pid", type=int, help="with --gateway-url: its pid, for CPU per request")
    p.add_argument(
        "--gateway-arg", action="append", default=[], help="extra argument for `serve` (repeatable)"
    )
    p.add_argument("--workers", type=int, default=1, help="gateway processes (`serve --workers N`)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--concurrency", default="1,32,64")
    p.add_argument("--duration", type=float, default=10.0, help="max seconds per level")
    p.add_argument("--requests", type=int, default=20000, help="max requests per level")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured requests per level")
    p.add_argument("--output-tokens", type=int, default=64, help="answer length of the started sim-engine")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--label", default="harmony-gateway")
    p.add_argument("--json-out", help="append one JSON line per level")
    p.add_argument("--verbose", action="store_true", help="show the started processes' output")
    args = p.parse_args()
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if args.duration <= 0 or args.requests <= 0:
        p.error("--duration and --requests must be > 0: every run is bounded")
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with services(args) as (base, pid):
        print(f"gateway {base} (pid {pid}); machine load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            rows = runner.run(drive_all(base, pid, args))
    print(table(rows))


if __name__ == "__main__":
    main()
