"""Overhead of the text-level Harmony parser on the gateway's HTTP-upstream path, end to end.

Starts, as subprocesses: a minimal OpenAI-compatible upstream that streams one long gpt-oss reply as
Harmony text (~20k tokens: analysis, a preamble, a tool call, a final answer) in ~4-character
`/v1/completions` events (`--events-per-write` per write), and two gateways in front of it, one with the default text parser and one with
`--text-parser MODEL=off` (raw pass-through). Then streams the same chat request through each gateway,
alternating, and compares the gateways' CPU time per request (read from /proc via psutil) and the wall
time. Both gateways emit reasoning in one field (`--reasoning-fields reasoning_content`), so they write
about the same bytes and the difference is the parser's. Prints both overheads; the target is under 3 %.

Run: `.venv/bin/python benchmarks/http_text_parser_overhead.py [--rounds 15] [--tokens 20000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
import orjson
import psutil

MODEL = "gpt-oss-bench"
WORDS = (
    "the user asks about weather in Paris we need to call the tool then answer concisely "
    "let us check units celsius maybe also give a short summary of the forecast for tomorrow "
    "x < y and a | b are fine in text"
).split()


def build_reply(tokens: int, rng: random.Random) -> str:
    def prose(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    analysis = tokens * 6 // 10
    return (
        "<|channel|>analysis<|message|>" + prose(analysis) + "<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>" + prose(60) + "<|end|>"
        "<|start|>assistant<|channel|>final<|message|>" + prose(tokens - analysis - 60) + "<|return|>"
    )


def sse_frames(text: str, rng: random.Random) -> list[bytes]:
    frames, i = [], 0
    while i < len(text):
        n = max(1, 4 + rng.randint(-2, 2))
        choice = {"index": 0, "text": text[i : i + n], "finish_reason": None}
        frames.append(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        i += n
    frames.append(b'data: {"choices":[{"index":0,"text":"","finish_reason":"stop"}]}\n\n')
    usage = {"prompt_tokens": 100, "completion_tokens": len(frames), "total_tokens": 100 + len(frames)}
    frames.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def serve_upstream(port: int, tokens: int, per_write: int) -> None:
    """The upstream process: frames are built once; each response writes `per_write` per write."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    frames = sse_frames(build_reply(tokens, random.Random(7)), random.Random(8))
    batches = [b"".join(frames[i : i + per_write]) for i in range(0, len(frames), per_write)]

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": MODEL, "max_model_len": 131072}]})

    async def health(request: Request) -> Response:
        return Response()

    async def completions(request: Request) -> Response:
        await request.body()

        async def body():  # type: ignore[no-untyped-def]
            for batch in batches:
                yield batch

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/health", health),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(url + "/v1/models")
                if r.status_code == 200 and MODEL in r.text:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


async def one_request(client: httpx.AsyncClient, url: str, proc: psutil.Process) -> tuple[float, float, int]:
    """(gateway CPU seconds, wall seconds, response bytes) for one streamed chat request."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "stream": True}
    cpu0 = sum(proc.cpu_times()[:2])
    t0 = time.perf_counter()
    size = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for piece in response.aiter_raw():
            size += len(piece)
    wall = time.perf_counter() - t0
    return sum(proc.cpu_times()[:2]) - cpu0, wall, size


def start_processes(
    up_port: int, on_port: int, off_port: int, tokens: int, per_write: int
) -> list[subprocess.Popen[bytes]]:
    """The upstream and the two gateways (parser on, `--text-parser MODEL=off`)."""
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve-upstream", str(up_port), "--tokens", str(tokens)]
            + ["--events-per-write", str(per_write)]
        )
    ]
    gateway = [sys.executable, "-m", "harmony_gateway.cli", "serve", "--storage", "memory://"]
    gateway += ["--worker-url", f"http://127.0.0.1:{up_port}", "--log-level", "warning"]
    # One reasoning field, so both gateways write about the same bytes: the comparison is the parser's.
    gateway += ["--reasoning-fields", "reasoning_content"]
    env = {**os.environ, "HARMONY_GATEWAY_API_KEYS": ""}
    procs.append(subprocess.Popen([*gateway, "--port", str(on_port)], env=env))
    procs.append(
        subprocess.Popen([*gateway, "--port", str(off_port), "--text-parser", f"{MODEL}=off"], env=env)
    )
    return procs


async def measure(rounds: int, tokens: int, per_write: int) -> None:
    up_port, on_port, off_port = free_port(), free_port(), free_port()
    procs = await asyncio.to_thread(start_processes, up_port, on_port, off_port, tokens, per_write)
    try:
        on_url, off_url = f"http://127.0.0.1:{on_port}", f"http://127.0.0.1:{off_port}"
        await wait_ready(on_url)
        await wait_ready(off_url)
        on_proc, off_proc = psutil.Process(procs[1].pid), psutil.Process(procs[2].pid)
        results: dict[str, list[tuple[float, float, int]]] = {"on": [], "off": []}
        timeout = httpx.Timeout(120.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            for warm in (on_url, off_url):  # first requests pay for imports and caches
                await one_request(client, warm, on_proc if warm == on_url else off_proc)
            for i in range(rounds):
                order = [("on", on_url, on_proc), ("off", off_url, off_proc)]
                for name, url, proc in order if i % 2 == 0 else order[::-1]:
                    results[name].append(await one_request(client, url, proc))
        # CPU times tick at 10 ms: the mean over all rounds resolves the difference, a median would not.
        cpu = {k: statistics.fmean(r[0] for r in v) for k, v in results.items()}
        wall = {k: statistics.median(r[1] for r in v) for k, v in results.items()}
        chunks = len(sse_frames(build_reply(tokens, random.Random(7)), random.Random(8))) - 3
        print(
            f"stream: ~{tokens} tokens of Harmony text in {chunks} upstream events, {per_write} per write; "
            f"{rounds} rounds each"
        )
        print(
            f"gateway CPU per request: parser {cpu['on'] * 1000:.1f} ms, pass-through {cpu['off'] * 1000:.1f} ms"
        )
        print(
            f"wall per request:        parser {wall['on'] * 1000:.1f} ms, pass-through {wall['off'] * 1000:.1f} ms"
        )
        print(f"parser cost per chunk: {(cpu['on'] - cpu['off']) / chunks * 1e6:.2f} us")
        print(
            f"overhead: CPU {100 * (cpu['on'] / cpu['off'] - 1):+.2f} %, wall {100 * (wall['on'] / wall['off'] - 1):+.2f} %"
        )
        # Rounds run back to back (order alternating), so a paired ratio cancels slow phases of a shared box.
        paired = [on[0] / off[0] for on, off in zip(results["on"], results["off"], strict=True) if off[0]]
        print(f"overhead, median of paired CPU ratios: {100 * (statistics.median(paired) - 1):+.2f} %")
        print("target: < 3 %")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument(
        "--events-per-write",
        type=int,
        default=1,
        help="SSE events the upstream writes at once (1: one per token, as vLLM streams)",
    )
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        serve_upstream(args.serve_upstream, args.tokens, args.events_per_write)
        return
    asyncio.run(measure(args.rounds, args.tokens, args.events_per_write))


if __name__ == "__main__":
    main()
