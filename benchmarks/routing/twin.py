"""One twin worker of the routing benchmark: `harmony-gateway sim-engine` with a recorder.

It takes every `sim-engine` flag (the cluster twin of docs/simulated-engine.md) and serves the same
engine, plus `--record PATH`: every request the scheduler sees is noted (wall-clock time, prompt ids,
planned output length, then its output ids and cached tokens when it leaves), and on SIGTERM/SIGINT the
notes and the engine's own totals are pickled to PATH. The benchmark reads them to cross-check the
hit rate the gateways report in usage and to replay the exact prompt sequence through the offline
oracle. `--serve-tokenizer DIR` makes GetTokenizer stream that folder, as a real engine serves its own
(SMG loads its tokenizer from the worker).

    PYTHONPATH=src python benchmarks/routing/twin.py --port 50051 --kv-capacity-tokens 150000 \\
        --prefill-ms-per-token 0.025 --record /tmp/twin0.pickle
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pickle
import signal
import time
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harmony_gateway.cli import sim_engine
from harmony_gateway.sim import SimConfig, start_sim_engine
from harmony_gateway.sim.scheduler import Scheduler, Ticket


class Recorder:
    """Notes what passes through a scheduler's `enter` and `leave`."""

    def __init__(self, scheduler: Scheduler, block_size: int) -> None:
        self.block_size = block_size
        #: (time, request number, planned output tokens, prompt ids)
        self.enters: list[tuple[float, int, int, array[int]]] = []
        #: (time, request number, output ids, cached tokens at admission or -1 if never admitted)
        self.leaves: list[tuple[float, int, array[int], int]] = []
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self._numbers: dict[int, int] = {}
        enter, leave = scheduler.enter, scheduler.leave

        def recording_enter(ticket: Ticket) -> Any:
            number = len(self.enters)
            self._numbers[id(ticket)] = number
            self.enters.append((time.time(), number, ticket.out_tokens, array("I", ticket.ids)))
            return enter(ticket)

        def recording_leave(ticket: Ticket, output: Sequence[int]) -> None:
            admitted = ticket.admitted and not ticket.done
            leave(ticket, output)
            number = self._numbers.pop(id(ticket), None)
            if number is None or not admitted:
                return
            cached = ticket.cached_blocks * self.block_size
            self.prompt_tokens += len(ticket.ids)
            self.cached_tokens += cached
            self.leaves.append((time.time(), number, array("I", output), cached))

        scheduler.enter = recording_enter  # type: ignore[method-assign]
        scheduler.leave = recording_leave  # type: ignore[method-assign]


async def serve(config: SimConfig, record: Path) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    sim = await start_sim_engine(config)
    core = sim._core
    recorder = Recorder(core.scheduler, config.block_size)
    try:
        await stop.wait()
    finally:
        await sim.stop(grace=1.0)
        state = sim.cache_state()
        notes = {
            "enters": recorder.enters,
            "leaves": recorder.leaves,
            "prompt_tokens": recorder.prompt_tokens,
            "cached_tokens": recorder.cached_tokens,
            "requests": core.total_requests,
            "evicted_blocks": state.evicted_blocks,
            "capacity_blocks": state.capacity_blocks,
            "block_size": state.block_size,
        }
        tmp = record.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(notes, protocol=pickle.HIGHEST_PROTOCOL))
        tmp.replace(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sim_engine.add_arguments(parser)
    parser.add_argument("--record", type=Path, required=True, help="where to pickle the notes on exit")
    parser.add_argument(
        "--serve-tokenizer",
        default=None,
        metavar="DIR",
        help="a tokenizer folder GetTokenizer streams (SMG fetches its tokenizer from the worker)",
    )
    args = parser.parse_args()
    config = sim_engine.config_from_args(args)
    if args.serve_tokenizer:
        config = dataclasses.replace(config, tokenizer_path=args.serve_tokenizer)
    asyncio.run(serve(config, args.record))


if __name__ == "__main__":
    main()
