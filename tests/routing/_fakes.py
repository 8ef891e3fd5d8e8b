"""A scripted stand-in for an engine's health endpoint, a prefix index, and worker builders."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio

from harmony_gateway.routing import Worker

HANG = "hang"
#: Tokens per block of `BlockIndex`.
BLOCK = 4


class FakeEngine:
    """Answers `health()` from a script: True/False, an exception to raise, or HANG (sleeps forever).

    The last entry repeats once the script runs out. Records every call and every cancelled probe.
    """

    def __init__(self, script: Iterable[object] = (True,), url: str = "fake://") -> None:
        self.url = url
        self.script = list(script)
        self.calls = 0
        self.cancelled = 0

    async def health(self, timeout: float) -> bool:
        step = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        if step == HANG:
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
        if isinstance(step, BaseException):
            raise step
        return bool(step)


def make_worker(
    name: str, *, healthy: bool = True, in_flight: int = 0, script: Iterable[object] = (True,)
) -> Worker:
    return Worker(
        url=f"grpc://{name}",
        client=FakeEngine(script, url=f"grpc://{name}"),
        id=name,
        healthy=healthy,
        in_flight=in_flight,
    )  # type: ignore[arg-type]


def make_workers(n: int) -> list[Worker]:
    return [make_worker(f"w{i}") for i in range(n)]


class BlockIndex:
    """Satisfies `PrefixIndex`: the whole blocks of the prompts stored on one engine, each known by the
    hash of its tokens chained to its parent's. Counts its lookups, so a test can tell whether routing
    read it."""

    def __init__(self, *, complete: bool = True) -> None:
        self.complete = complete
        self.blocks: set[int] = set()
        self.lookups = 0

    @staticmethod
    def chain(input_ids: Sequence[int]) -> list[int]:
        hashes, parent = [], 0
        for end in range(BLOCK, len(input_ids) + 1, BLOCK):
            parent = hash((parent, tuple(input_ids[end - BLOCK : end])))
            hashes.append(parent)
        return hashes

    def store(self, input_ids: Sequence[int]) -> BlockIndex:
        self.blocks.update(self.chain(input_ids))
        return self

    def matched_tokens(self, input_ids: Sequence[int], lora_name: str = "", cache_salt: str = "") -> int:
        self.lookups += 1
        n = 0
        for block in self.chain(input_ids):
            if block not in self.blocks:
                break
            n += BLOCK
        return n

    def __len__(self) -> int:
        return len(self.blocks)
