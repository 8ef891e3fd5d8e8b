"""CPU a bare grpcio asyncio client spends receiving streamed answers: the floor under any Python gateway.

Drives an SGLang-scheduler gRPC worker (ours: `harmony-gateway sim-engine`, or `shared/bench`'s mock)
with `SglangGrpcClient.generate` alone (no HTTP, parsing or framing), `--concurrency` streams at once
for `--duration` seconds, and prints requests/s and this process's CPU time per request.

    .venv/bin/python benchmarks/grpc_receive_floor.py grpc://127.0.0.1:50051 --concurrency 64 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time

from harmony_gateway.engines.base import GenerateRequest, SamplingOptions
from harmony_gateway.engines.sglang_grpc import SglangGrpcClient


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run(url: str, concurrency: int, duration: float, output_tokens: int) -> None:
    client = SglangGrpcClient(url)
    completed = 0
    deadline = 0.0

    async def stream(worker: int) -> None:
        nonlocal completed
        n = 0
        while time.monotonic() < deadline:
            request = GenerateRequest(
                f"floor-{worker}-{n}", [1, 2, 3, 4], SamplingOptions(max_new_tokens=output_tokens)
            )
            async for _ in client.generate(request):
                pass
            completed += 1
            n += 1

    deadline = time.monotonic() + 2.0  # warm-up: channel, first calls
    await asyncio.gather(*(stream(i) for i in range(min(4, concurrency))))
    completed = 0
    started, cpu = time.monotonic(), cpu_seconds()
    deadline = started + duration
    await asyncio.gather(*(stream(i) for i in range(concurrency)))
    wall, cpu = time.monotonic() - started, cpu_seconds() - cpu
    print(
        f"{completed} requests in {wall:.1f} s: {completed / wall:.1f} req/s, "
        f"client CPU {cpu * 1000 / max(completed, 1):.2f} ms per request ({cpu / wall:.2f} cores)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("url", help="grpc://host:port of an SGLang-scheduler worker")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(run(args.url, args.concurrency, args.duration, args.output_tokens))


if __name__ == "__main__":
    main()
