"""The CLI: help on every command, and settings that cannot work fail before serving, in one line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import get_args

import pytest

import harmony_gateway
from harmony_gateway.app import feed_config
from harmony_gateway.cli import (
    StartupError,
    build_parser,
    invalid_setting,
    settings_from_args,
    visible_secret_warning,
)
from harmony_gateway.engines.registry import GRPC_ENGINES
from harmony_gateway.routing.kv_index import DEFAULT_MAX_BLOCKS
from harmony_gateway.routing.kv_subscriptions import FeedConfig
from harmony_gateway.settings import Settings
from harmony_gateway.sim.server import EngineKind
from harmony_gateway.storage import ConversationLimits


@pytest.mark.parametrize("command", [[], ["serve"], ["sim-engine"], ["vocab"], ["render"]])
def test_help_on_every_command(command: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([*command, "--help"])
    assert info.value.code == 0


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--policy", "fastest"], "unknown routing policy 'fastest'"),
        (["--model-policy", "m=nope"], "unknown routing policy 'nope'"),
        (["--reasoning-parser", "m=nope"], "unknown reasoning parser 'nope'"),
        (["--tool-call-parser", "m=nope"], "tool-call parser 'nope'"),
    ],
)
def test_invalid_settings_are_named(flags: list[str], fragment: str) -> None:
    args = build_parser().parse_args(["serve", "--worker-url", "grpc://127.0.0.1:1", *flags])
    problem = invalid_setting(settings_from_args(args))
    assert problem is not None and fragment in problem


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--worker-dns", "grpc://engines"], "needs a port"),
        (["--worker-dns", "grpc://engines:1?engine=nope"], "unknown engine 'nope'"),
        (["--worker-dns", "grpc://engines:1", "--worker-dns-server", "dns.example"], "expected an IP"),
        (["--worker-dns", "grpc://engines:1", "--worker-dns-interval", "0"], "--worker-dns-interval"),
        (["--worker-dns", "grpc://engines:1", "--worker-dns-drain-timeout", "-1"], "drain-timeout"),
    ],
)
def test_invalid_discovery_settings_are_named(flags: list[str], fragment: str) -> None:
    args = build_parser().parse_args(["serve", *flags])
    problem = invalid_setting(settings_from_args(args))
    assert problem is not None and fragment in problem


def test_discovery_settings() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--worker-dns",
            "grpc://engines.ns.svc.cluster.local:30000",
            "--worker-dns",
            "grpc+srv://_grpc._tcp.prefill.ns.svc.cluster.local?kind=prefill",
            "--worker-dns-server",
            "10.96.0.10",
        ]
    )
    settings = settings_from_args(args)
    assert invalid_setting(settings) is None
    assert settings.worker_dns == (
        "grpc://engines.ns.svc.cluster.local:30000",
        "grpc+srv://_grpc._tcp.prefill.ns.svc.cluster.local?kind=prefill",
    )
    assert settings.worker_dns_server == "10.96.0.10"
    assert (settings.worker_dns_interval, settings.worker_dns_timeout) == (5.0, 2.0)
    assert settings.worker_dns_drain_timeout is None


def test_valid_settings_pass() -> None:
    args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--policy", "cache_aware"])
    assert invalid_setting(settings_from_args(args)) is None


def test_bad_policy_exits_2_with_one_line() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harmony_gateway.cli",
            "serve",
            "--worker-url",
            "grpc://127.0.0.1:1",
            "--policy",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown routing policy" in proc.stderr


def test_cache_aware_thresholds_reach_the_policy() -> None:
    from harmony_gateway.app import build_state
    from harmony_gateway.routing import CacheAwarePolicy

    flags = ["--cache-threshold", "0.25", "--balance-abs-threshold", "4", "--balance-rel-threshold", "2"]
    args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--policy=cache_aware", *flags])
    settings = settings_from_args(args)
    assert invalid_setting(settings) is None
    policy = build_state(settings).fleet._policy_factory("m", "regular")
    assert isinstance(policy, CacheAwarePolicy)
    assert (policy.cache_threshold, policy.balance_abs_threshold) == (0.25, 4)
    assert policy.balance_rel_threshold == 2.0
    args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", "--cache-threshold", "1.5"])
    assert "cache_threshold" in (invalid_setting(settings_from_args(args)) or "")


def test_kv_aware_knobs_reach_the_policy() -> None:
    from harmony_gateway.app import build_state
    from harmony_gateway.routing import KvAwarePolicy

    base = ["serve", "--worker-url", "grpc://h:1", "--policy=kv_aware"]
    defaults = build_state(settings_from_args(build_parser().parse_args(base))).fleet._policy_factory(
        "m", "regular"
    )
    assert isinstance(defaults, KvAwarePolicy)
    assert (defaults.overlap_weight, defaults.decode_weight, defaults.load_max_age) == (1.0, 1024.0, 5.0)
    assert (defaults.kv_pressure_threshold, defaults.temperature) == (0.9, 0.0)
    flags = [
        *("--kv-overlap-weight", "2", "--kv-decode-weight", "64", "--kv-load-max-age", "1.5"),
        *("--kv-pressure-threshold", "0.8", "--kv-temperature", "0.1"),
        *("--balance-abs-threshold", "4", "--balance-rel-threshold", "2"),
    ]
    settings = settings_from_args(build_parser().parse_args([*base, *flags]))
    assert invalid_setting(settings) is None
    policy = build_state(settings).fleet._policy_factory("m", "regular")
    assert isinstance(policy, KvAwarePolicy)
    assert (policy.overlap_weight, policy.decode_weight, policy.load_max_age) == (2.0, 64.0, 1.5)
    assert (policy.kv_pressure_threshold, policy.temperature) == (0.8, 0.1)
    assert (policy.balance_abs_threshold, policy.balance_rel_threshold) == (4, 2.0)
    bad = build_parser().parse_args([*base, "--kv-pressure-threshold", "1.5"])
    assert "kv_pressure_threshold" in (invalid_setting(settings_from_args(bad)) or "")


def test_text_parser_window_flags() -> None:
    flags = ["--text-parser-window-chars", "64", "--text-parser-window-seconds", "1.5"]
    settings = settings_from_args(build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", *flags]))
    assert (settings.text_parser_window_chars, settings.text_parser_window_seconds) == (64, 1.5)
    default = settings_from_args(build_parser().parse_args(["serve", "--worker-url", "grpc://h:1"]))
    assert (default.text_parser_window_chars, default.text_parser_window_seconds) == (256, None)
    bad = build_parser().parse_args(
        ["serve", "--worker-url", "grpc://h:1", "--text-parser-window-chars", "-1"]
    )
    assert "--text-parser-window-chars" in (invalid_setting(settings_from_args(bad)) or "")


def test_conversation_limit_flags() -> None:
    base = ["serve", "--worker-url", "grpc://h:1"]
    flags = ["--max-conversation-items", "50", "--max-conversation-bytes", "65536"]
    settings = settings_from_args(build_parser().parse_args([*base, *flags]))
    assert settings.conversation_limits == ConversationLimits(max_items=50, max_bytes=65536)
    default = settings_from_args(build_parser().parse_args(base))
    assert default.conversation_limits == ConversationLimits(max_items=10_000, max_bytes=8 * 1024 * 1024)
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--max-conversation-bytes", "0"])


def test_kv_event_flags_reach_the_settings_and_the_feeds() -> None:
    base = ["serve", "--worker-url", "grpc://h:1"]
    default = settings_from_args(build_parser().parse_args(base))
    assert feed_config(default) == FeedConfig(poll_timeout=default.health_timeout)
    assert default.kv_index_max_blocks == DEFAULT_MAX_BLOCKS
    flags = ["--kv-events", "off", "--kv-index-max-blocks", "1000", "--engine-wedge-ms", "0"]
    flags += ["--engine-prefill-rate", "500", "--load-poll-interval", "2.5"]
    config = feed_config(settings_from_args(build_parser().parse_args([*base, *flags])))
    assert (config.kv_events, config.max_blocks, config.wedge_ms) == (False, 1000, 0.0)
    assert (config.prefill_rate, config.poll_interval) == (500.0, 2.5)
    for bad in (["--kv-events", "on"], ["--kv-index-max-blocks", "0"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*base, *bad])
    problem = invalid_setting(
        settings_from_args(build_parser().parse_args([*base, "--engine-wedge-ms", "-1"]))
    )
    assert problem == "--engine-wedge-ms -1: must be 0 or more"


def test_agent_client_flags_reach_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["serve", "--worker-url", "grpc://h:1"]
    monkeypatch.delenv("HARMONY_GATEWAY_REASONING_KEY", raising=False)
    settings = settings_from_args(build_parser().parse_args(base))
    assert (settings.unbacked_tools, settings.reasoning_key) == ("drop", None)
    flags = ["--unbacked-tools", "reject", "--reasoning-key", "s3cret"]
    settings = settings_from_args(build_parser().parse_args([*base, *flags]))
    assert (settings.unbacked_tools, settings.reasoning_key) == ("reject", "s3cret")
    monkeypatch.setenv("HARMONY_GATEWAY_REASONING_KEY", "from-env")
    assert settings_from_args(build_parser().parse_args(base)).reasoning_key == "from-env"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--unbacked-tools", "maybe"])


def test_serve_defaults_are_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("HARMONY_"):
            monkeypatch.delenv(name)
    settings = settings_from_args(build_parser().parse_args(["serve", "--worker-url", "grpc://h:1"]))
    assert settings == Settings(worker_urls=("grpc://h:1",))


def test_options_reach_their_settings_fields() -> None:
    flags = ["--max-headers", "7", "--drain-timeout", "3", "--admin-host", "0.0.0.0", "--log-json"]
    flags += ["--tokenizer", "m=/tok", "--mcp-allow-hosts", "a,b", "--mcp-allow-hosts", "c"]
    flags += ["--workers", "2", "--storage", "sqlite:///x.db", "--conversation-date", "2025-01-02"]
    settings = settings_from_args(build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", *flags]))
    assert (settings.max_headers, settings.drain_timeout, settings.admin_host, settings.log_json) == (
        7,
        3.0,
        "0.0.0.0",
        True,
    )
    assert (settings.tokenizer_paths, settings.mcp_allow_hosts) == ({"m": "/tok"}, ("a", "b", "c"))
    assert (settings.processes, settings.storage_url) == (2, "sqlite:///x.db")
    assert settings.conversation_start_date == "2025-01-02"


def test_reasoning_key_file_keeps_the_key_out_of_the_process_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--worker-url", "grpc://h:1"]
    monkeypatch.setenv("HARMONY_GATEWAY_REASONING_KEY", "from-env")
    key_file = tmp_path / "reasoning.key"
    key_file.write_text("from-file\n")
    args = build_parser().parse_args([*base, "--reasoning-key-file", str(key_file)])
    assert settings_from_args(args).reasoning_key == "from-file"  # the file wins over the environment
    assert visible_secret_warning(args) is None
    shown = build_parser().parse_args([*base, "--reasoning-key", "s3cret"])
    assert "process list" in (visible_secret_warning(shown) or "")
    assert "s3cret" not in (visible_secret_warning(shown) or "")
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--reasoning-key", "a", "--reasoning-key-file", str(key_file)])
    capsys.readouterr()
    for bad in (tmp_path / "missing.key", tmp_path / "empty.key"):
        if bad.name == "empty.key":
            bad.write_text("  \n")
        with pytest.raises(StartupError, match="--reasoning-key-file"):
            settings_from_args(build_parser().parse_args([*base, "--reasoning-key-file", str(bad)]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--reasoning-key-file" in capsys.readouterr().out


def test_version_names_the_installed_distribution(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"harmony-gateway {metadata.version('harmony-gateway')}\n"

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # a source tree without an install
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out == f"harmony-gateway {harmony_gateway.__version__}\n"


SERVE_GROUPS = [
    "server",
    "engine and model",
    "worker discovery",
    "routing",
    "storage",
    "limits and traffic",
    "WebSocket mode",
    "security",
    "observability",
]


def test_websocket_options_reach_their_settings() -> None:
    flags = ["--ws-max-message-bytes", "1024", "--ws-idle-timeout", "9", "--ws-max-turns", "3"]
    flags += ["--ws-max-lifetime", "60"]
    settings = settings_from_args(build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", *flags]))
    assert (
        settings.ws_max_message_bytes,
        settings.ws_idle_timeout,
        settings.ws_max_turns,
        settings.ws_max_lifetime,
    ) == (1024, 9.0, 3, 60.0)
    for flag in ("--ws-idle-timeout", "--ws-max-lifetime"):
        args = build_parser().parse_args(["serve", "--worker-url", "grpc://h:1", flag, "0"])
        problem = invalid_setting(settings_from_args(args))
        assert problem is not None and flag in problem


def test_serve_help_shows_the_option_groups_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]
    assert titles == ["options", *SERVE_GROUPS]
    flat = " ".join(text.split())
    for shown in ("--port PORT port to listen on (default: 8000)", "(default: round_robin)"):
        assert shown in flat


def test_every_serve_default_is_shown_once() -> None:
    serve = _subcommand(build_parser(), "serve")
    formatter = serve._get_formatter()
    for action in serve._actions:
        help_text = formatter._expand_help(action) if action.help else ""
        assert help_text.lower().count("default") <= 1, action.option_strings
        if not any(action.default is unset for unset in (None, False, argparse.SUPPRESS)):
            assert f"(default: {action.default}" in help_text, action.option_strings


def test_engine_choices_are_the_engines_registry() -> None:
    parser = build_parser()
    protocols = [name for name in GRPC_ENGINES if name != "auto"]
    assert list(_option(parser, "serve", "--engine").choices or ()) == ["auto", *protocols]
    assert list(_option(parser, "sim-engine", "--engine").choices or ()) == protocols
    assert set(get_args(EngineKind)) == set(protocols)  # the simulator speaks every one of them
    for name in GRPC_ENGINES:
        assert parser.parse_args(["serve", "--engine", name]).engine == name


def _subcommand(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subcommand: argparse.ArgumentParser = commands.choices[command]
    return subcommand


def _option(parser: argparse.ArgumentParser, command: str, flag: str) -> argparse.Action:
    return next(a for a in _subcommand(parser, command)._actions if flag in a.option_strings)


def test_sim_engine_flags_configure_the_cluster_twin() -> None:
    from harmony_gateway.cli.sim_engine import config_from_args

    args = build_parser().parse_args(
        [
            "sim-engine",
            "--engine",
            "vllm",
            "--block-size",
            "32",
            "--kv-capacity-tokens",
            "65536",
            "--prefill-ms-per-token",
            "0.02",
            "--decode-ms-per-token",
            "8",
            "--decode-ms-per-running",
            "0.5",
            "--max-running-requests",
            "16",
            "--kv-history-batches",
            "500",
            "--kv-heartbeat-s",
            "0.5",
            "--no-record-requests",
        ]
    )
    config = config_from_args(args)
    assert (config.engine, config.block_size, config.kv_capacity_tokens) == ("vllm", 32, 65536)
    assert (config.prefill_ms_per_token, config.decode_ms_per_token, config.decode_ms_per_running) == (
        0.02,
        8.0,
        0.5,
    )
    assert (config.max_running_requests, config.kv_history_batches, config.kv_heartbeat_s) == (16, 500, 0.5)
    assert config.kv_events and not config.record_requests
    assert not config_from_args(build_parser().parse_args(["sim", "--no-kv-events"])).kv_events
    with pytest.raises(SystemExit, match="block_size must be at least 1"):
        config_from_args(build_parser().parse_args(["sim", "--block-size", "0"]))
