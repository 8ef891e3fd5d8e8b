"""`serve --workers N`: refused where processes could not share state; the process app builds from argv."""

from __future__ import annotations

import json

import pytest

from harmony_gateway import cli
from harmony_gateway.cli.serve import SERVE_ARGV_ENV


@pytest.mark.parametrize(
    "extra",
    [["--storage", "memory://"], ["--demo", "--storage", "sqlite:///x.db"]],
)
def test_workers_need_shared_state(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--worker-url", "grpc://127.0.0.1:1", "--workers", "2", *extra]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "--workers 2" in capsys.readouterr().err


def test_process_app_is_built_from_the_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    argv = ["serve", "--worker-url", "grpc://127.0.0.1:1", "--storage", f"sqlite:///{tmp_path}/r.db"]
    monkeypatch.setenv(SERVE_ARGV_ENV, json.dumps(argv))
    app = cli.app_from_env()
    assert "/v1/chat/completions" in app.openapi()["paths"]


def test_workers_flag_sets_the_process_count() -> None:
    args = cli.build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--workers", "3"])
    assert cli.settings_from_args(args).processes == 3
    args = cli.build_parser().parse_args(["serve", "--worker-url", "grpc://h:1"])
    assert cli.settings_from_args(args).processes == 1
