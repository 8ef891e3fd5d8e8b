"""Which exceptions count as a request's own failure, and the one line each gets in the log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from harmony_gateway.errors import InvalidRequest, is_failure, is_panic
from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.observability.logging import FAILURE_MESSAGE_CHARS, log_failure


@pytest.fixture(scope="module")
def panic() -> BaseException:
    try:
        get_encoding().encode("x" * 1_000_000, allowed_special=set(), disallowed_special=())
    except BaseException as exc:
        return exc
    pytest.fail("openai-harmony no longer panics on a million-letter word")


def test_failures_are_exceptions_and_panics_not_cancellation(panic: BaseException) -> None:
    assert is_panic(panic) and is_failure(panic)
    assert is_failure(ValueError("x")) and is_failure(InvalidRequest("x"))
    assert not is_panic(ValueError("x"))
    for not_a_failure in (asyncio.CancelledError(), KeyboardInterrupt(), SystemExit(1)):
        assert not is_failure(not_a_failure)
    assert is_failure(BaseExceptionGroup("task group", [panic, ValueError("x")]))
    assert not is_failure(BaseExceptionGroup("task group", [panic, asyncio.CancelledError()]))


def test_a_failure_is_one_short_line_with_the_traceback_at_debug(
    panic: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    log = logging.getLogger("harmony_gateway.test")
    caplog.set_level(logging.INFO, logger=log.name)
    log_failure(log, "request rid-1", RuntimeError("y" * 10_000 + "\n" + "z"))
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is None
    assert record.getMessage().startswith("request rid-1 failed: RuntimeError: yyy")
    assert len(record.getMessage()) < FAILURE_MESSAGE_CHARS + 100 and "\n" not in record.getMessage()

    caplog.clear()
    log_failure(log, "request rid-3", RuntimeError("first\nsecond"))
    assert caplog.records[0].getMessage() == "request rid-3 failed: RuntimeError: first\\nsecond"

    caplog.clear()
    caplog.set_level(logging.DEBUG, logger=log.name)
    log_failure(log, "request rid-2", panic)
    error, debug = caplog.records
    assert "PanicException" in error.getMessage() and error.exc_info is None
    assert debug.levelno == logging.DEBUG and debug.exc_info is not None
