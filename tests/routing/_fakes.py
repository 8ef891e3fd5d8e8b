"""A scripted stand-in for an engine's health endpoint, and worker builders."""

from __future__ import annotations

from collections.abc import Iterable

import anyio

from harmony_gateway.routing import Worker

HANG = "hang"


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
