"""`TaskSupervisor`: spawned tasks are kept, their failures logged, and `aclose()` ends every one."""

from __future__ import annotations

import asyncio
import logging

import pytest

from harmony_gateway.tasks import SupervisorClosed, TaskSupervisor


async def test_a_spawned_task_runs_and_leaves_when_done() -> None:
    supervisor = TaskSupervisor()
    task = supervisor.spawn(asyncio.sleep(0, result="done"), name="quick")
    assert task.get_name() == "quick"
    assert supervisor.running == 1
    assert await task == "done"
    assert supervisor.running == 0  # its done callback ran before the awaiter resumed
    await supervisor.aclose()


async def test_a_failing_task_is_logged_with_its_name(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = TaskSupervisor()

    async def fail() -> None:
        raise LookupError("the thing is gone")

    task = supervisor.spawn(fail(), name="failing-work")
    await asyncio.wait({task})
    [record] = [r for r in caplog.records if r.name == "harmony_gateway.tasks"]
    assert record.levelno == logging.ERROR and "failing-work" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], LookupError)
    await supervisor.aclose()


async def test_an_awaited_task_leaves_its_failure_to_whoever_awaits_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = TaskSupervisor()

    async def fail() -> None:
        raise LookupError("no such file")

    task = supervisor.spawn(fail(), name="shared-load", awaited=True)
    with pytest.raises(LookupError):
        await task
    assert not [
        r for r in caplog.records if r.name == "harmony_gateway.tasks" and r.levelno >= logging.WARNING
    ]
    await supervisor.aclose()


async def test_a_cancelled_task_is_not_reported_as_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    supervisor = TaskSupervisor()
    task = supervisor.spawn(asyncio.Event().wait(), name="waiting")
    task.cancel()
    await asyncio.wait({task})
    assert not [r for r in caplog.records if r.name == "harmony_gateway.tasks"]
    await supervisor.aclose()


async def test_aclose_cancels_each_task_and_waits_for_its_clean_up() -> None:
    supervisor = TaskSupervisor()
    started = asyncio.Event()
    cleaned: list[str] = []

    async def work(label: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # clean-up that itself awaits
            cleaned.append(label)

    tasks = [supervisor.spawn(work(label), name=label) for label in ("a", "b")]
    await started.wait()
    await supervisor.aclose()
    assert sorted(cleaned) == ["a", "b"]
    assert all(task.cancelled() for task in tasks)
    assert supervisor.running == 0


async def test_a_task_spawned_while_closing_is_ended_too() -> None:
    supervisor = TaskSupervisor()
    started = asyncio.Event()
    late: list[asyncio.Task[bool]] = []

    async def spawns_on_the_way_out() -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            late.append(supervisor.spawn(asyncio.Event().wait(), name="late"))

    supervisor.spawn(spawns_on_the_way_out(), name="first")
    await started.wait()
    await supervisor.aclose()
    [task] = late
    assert task.done()


async def test_nothing_is_spawned_once_closed() -> None:
    supervisor = TaskSupervisor()
    await supervisor.aclose()
    work = asyncio.sleep(0)
    with pytest.raises(SupervisorClosed):
        supervisor.spawn(work, name="too-late")
    assert work.cr_frame is None  # closed, so it is not reported as never awaited
