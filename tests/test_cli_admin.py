"""The admin plane flags: parsing, the environment variable, refused combinations, and a real `serve`
process with its admin listener."""

from __future__ import annotations

import httpx
import pytest

from harmony_gateway import cli
from harmony_gateway.sim import SimConfig
from tests.e2e._fleet import sims
from tests.support.processes import free_port, start_gateway_process


def settings_for(*flags: str):  # type: ignore[no-untyped-def]
    return cli.settings_from_args(
        cli.build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", *flags])
    )


def test_admin_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARMONY_GATEWAY_ADMIN_KEY", "sk-env-1, sk-env-2")
    assert settings_for().admin_keys == frozenset({"sk-env-1", "sk-env-2"})
    settings = settings_for(
        "--admin-key",
        "sk-flag",
        "--admin-port",
        "9001",
        "--worker-allow-hosts",
        "10.0.0.0/8,engine.internal",
        "--protect-metrics",
    )
    assert settings.admin_keys == frozenset({"sk-flag"})  # the command line wins over the environment
    assert (settings.admin_host, settings.admin_port) == ("127.0.0.1", 9001)
    assert settings.worker_allow_hosts == ("10.0.0.0/8", "engine.internal")
    assert settings.protect_metrics is True
    assert cli.invalid_setting(settings) is None
    monkeypatch.delenv("HARMONY_GATEWAY_ADMIN_KEY")
    defaults = settings_for()
    assert defaults.admin_keys == frozenset() and defaults.admin_port is None and not defaults.protect_metrics


def test_protect_metrics_needs_an_admin_credential() -> None:
    problem = cli.invalid_setting(settings_for("--protect-metrics"))
    assert problem is not None and "--admin-key" in problem
    assert cli.invalid_setting(settings_for("--protect-metrics", "--admin-port", "9001")) is None


def test_admin_listener_runs_in_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--worker-url", "grpc://127.0.0.1:1", "--workers", "2", "--admin-port", "9001"]
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, "--storage", "sqlite:///unused.db"])
    assert exc.value.code == 2
    assert "--admin-port" in capsys.readouterr().err


async def test_serve_starts_the_admin_listener() -> None:
    async with sims(SimConfig(), SimConfig()) as (first, second):
        admin_port = free_port()
        gateway = await start_gateway_process(
            "--worker-url", first.url, "--storage", "memory://", "--admin-port", str(admin_port)
        )
        try:
            async with httpx.AsyncClient(timeout=10) as http:
                main = f"http://127.0.0.1:{gateway.port}"
                admin = f"http://127.0.0.1:{admin_port}"
                r = await http.get(f"{main}/workers")
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_plane_elsewhere"
                r = await http.post(f"{admin}/workers", json={"url": second.url})
                assert r.status_code == 201 and r.json()["healthy"] is True, r.text
                listed = (await http.get(f"{admin}/workers")).json()["data"]
                assert sorted(w["url"] for w in listed) == sorted([first.url, second.url])
        finally:
            gateway.stop()
        # Stopping the main server stops the admin listener with it.
        assert gateway.proc.returncode is not None
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(timeout=2) as http:
                await http.get(f"http://127.0.0.1:{admin_port}/workers")
