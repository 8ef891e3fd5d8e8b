"""`serve`'s options from a YAML `--config` file and `HARMONY_GATEWAY_<OPTION>` variables: every option
of the parser, precedence command line > environment > file, lists replaced whole, one-line errors."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harmony_gateway.cli import build_parser, settings_from_args, visible_secret_warning
from harmony_gateway.cli.checks import setting_problem
from harmony_gateway.cli.config import DEPRECATED_ENV, NOT_OPTIONS, client_key, env_name, serve_options
from harmony_gateway.settings import Settings

BASE = ["serve", "--worker-url", "grpc://h:1"]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in os.environ:
        if name.startswith("HARMONY_"):
            monkeypatch.delenv(name)


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = commands.choices["serve"]
    return serve


def parse(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_config_file_sets_any_option(tmp_path: Path) -> None:
    config = write(
        tmp_path / "gateway.yaml",
        """
# every key is a serve option without its dashes
host: 0.0.0.0
port: 9000
worker-url: [grpc://engine-0:30000, grpc://engine-1:30000]
prefill: grpc://prefill-0:30000
policy: cache_aware
cache_threshold: 0.25          # underscores work too
model-policy: {acme/m: kv_aware}
kv-events: off                 # YAML 1.1 would read a boolean here
conversation-date: 2025-01-02  # ... and a date here
log-json: true
forwarded-allow-ips: 10.0.0.0/8, 192.168.0.1
reasoning-key: from-the-file
storage-retention: null        # null leaves the default
""",
    )
    args = parse("--config", config)
    settings = settings_from_args(args)
    assert (settings.host, settings.port, settings.policy, settings.cache_threshold) == (
        "0.0.0.0",
        9000,
        "cache_aware",
        0.25,
    )
    assert settings.worker_urls == ("grpc://engine-0:30000", "grpc://engine-1:30000")
    assert settings.prefill_urls == ("grpc://prefill-0:30000",)
    assert settings.model_policies == {"acme/m": "kv_aware"}
    assert (settings.kv_events, settings.conversation_start_date, settings.log_json) == (
        "off",
        "2025-01-02",
        True,
    )
    assert settings.forwarded_allow_ips == ("10.0.0.0/8", "192.168.0.1")
    assert settings.storage_retention is None
    assert args.option_sources["port"] == f"{config}: port"
    # A secret from the file is not in the process list: no warning about it.
    assert settings.reasoning_key == "from-the-file" and visible_secret_warning(args) is None


def test_every_option_has_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Derived from the parser: each option (present and future) is HARMONY_GATEWAY_<ITS NAME>."""
    options = serve_options(serve_parser())
    names = {option.name for option in options}
    assert {"worker-url", "policy", "api-key", "config", "max-body-bytes", "log-json"} <= names
    assert not names & {"help", "worker-urls", "api-keys"}  # help and aliases are not options
    for option in options:
        if option.name == "config":
            continue
        if option.switch:
            value = "true"
        elif option.action.choices:
            value = str(list(option.action.choices)[-1])
        else:
            value = "7" if option.action.type is not None else "grpc://e:1"
        monkeypatch.setenv(option.env, value)
        args = parse()
        assert args.option_sources[option.dest] == option.env, option.name
        assert getattr(args, option.dest) != option.action.default, option.name
        monkeypatch.delenv(option.env)


def test_environment_values_are_typed_and_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARMONY_GATEWAY_WORKER_URL", "grpc://a:1, grpc://b:2")
    monkeypatch.setenv("HARMONY_GATEWAY_PORT", "9001")
    monkeypatch.setenv("HARMONY_GATEWAY_LOG_JSON", "yes")
    monkeypatch.setenv("HARMONY_GATEWAY_PROTECT_METRICS", "off")
    monkeypatch.setenv("HARMONY_GATEWAY_MODEL_POLICY", "a=random,b=power_of_two")
    monkeypatch.setenv("HARMONY_GATEWAY_STORAGE", "")  # empty: unset
    settings = settings_from_args(parse())
    assert settings.worker_urls == ("grpc://a:1", "grpc://b:2")
    assert (settings.port, settings.log_json, settings.protect_metrics) == (9001, True, False)
    assert settings.model_policies == {"a": "random", "b": "power_of_two"}
    assert settings.storage_url is None


def test_precedence_command_line_then_environment_then_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(
        tmp_path / "gateway.yaml",
        "policy: cache_aware\nport: 9000\nworker-url: [grpc://file:1, grpc://file:2]\nlog-level: debug\n",
    )
    monkeypatch.setenv("HARMONY_GATEWAY_CONFIG", config)  # the file named by the environment
    monkeypatch.setenv("HARMONY_GATEWAY_POLICY", "random")
    monkeypatch.setenv("HARMONY_GATEWAY_WORKER_URL", "grpc://env:1")
    args = parse("--policy", "power_of_two", "--port", "8000")  # 8000 is the default: given all the same
    settings = settings_from_args(args)
    assert settings.policy == "power_of_two"  # flag over environment over file
    assert settings.port == 8000  # flag over file
    assert settings.worker_urls == ("grpc://env:1",)  # a list comes whole from one source
    assert settings.log_level == "debug"  # file over default
    sources = args.option_sources
    assert (sources["policy"], sources["worker_url"], sources["log_level"]) == (
        "--policy",
        "HARMONY_GATEWAY_WORKER_URL",
        f"{config}: log-level",
    )
    monkeypatch.delenv("HARMONY_GATEWAY_POLICY")
    assert settings_from_args(parse()).policy == "cache_aware"
    # --config on the command line beats HARMONY_GATEWAY_CONFIG.
    other = write(tmp_path / "other.yaml", "policy: random\n")
    assert settings_from_args(parse("--config", other)).policy == "random"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("polcy: random\n", "unknown option 'polcy' (did you mean 'policy'?)"),
        ("policy: random\nnot-an-option: 1\n", "unknown option 'not-an-option'"),
        ("config: other.yaml\n", "a config file cannot name another"),
        ("port: eighty\n", "port: 'eighty': expects a whole number"),
        ("kv-events: maybe\n", "'maybe' is not one of auto, off"),
        ("log-json: 3\n", "log-json: 3: expects true or false"),
        ("policy: [a, b]\n", "expects a single value"),
        ("- just\n- a list\n", "expects a mapping of option: value"),
        ("policy: [unclosed\n", "not valid YAML at line 2"),
        ("worker-url: grpc://a:1\nworker-urls: grpc://b:1\n", "set the same option"),
    ],
)
def test_config_file_mistakes_are_one_line(
    tmp_path: Path, text: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path / "gateway.yaml", text)
    with pytest.raises(SystemExit) as info:
        parse("--config", config)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and config in err and fragment in err, err


def test_a_missing_config_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--config", str(tmp_path / "nope.yaml"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.yaml: cannot read it" in err


def test_bad_environment_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value, fragment in (
        ("HARMONY_GATEWAY_PORT", "abc", "HARMONY_GATEWAY_PORT='abc': expects a whole number"),
        ("HARMONY_GATEWAY_LOG_JSON", "perhaps", "HARMONY_GATEWAY_LOG_JSON='perhaps': expects true or false"),
        ("HARMONY_GATEWAY_ENGINE", "nope", "HARMONY_GATEWAY_ENGINE='nope': 'nope' is not one of auto"),
        ("HARMONY_GATEWAY_KV_INDEX_MAX_BLOCKS", "0", "must be 1 or more"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit):
            parse()
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and fragment in err, err
        monkeypatch.delenv(name)


def test_deprecated_key_variables_still_work_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(DEPRECATED_ENV.values()) <= {o.name for o in serve_options(serve_parser())}
    for old in ("HARMONY_GATEWAY_API_KEYS", "HARMONY_GATEWAY_KEY"):
        monkeypatch.setenv(old, "sk-a,sk-b")
        args = parse(*BASE[1:])
        assert settings_from_args(args).api_keys == frozenset({"sk-a", "sk-b"})
        assert args.config_warnings == [
            f"{old} is deprecated and will be removed: name it HARMONY_GATEWAY_API_KEY"
        ]
        monkeypatch.delenv(old)
    monkeypatch.setenv("HARMONY_GATEWAY_API_KEY", "sk-new")
    monkeypatch.setenv("HARMONY_GATEWAY_API_KEYS", "sk-old")
    assert settings_from_args(parse(*BASE[1:])).api_keys == frozenset({"sk-new"})  # the new name wins
    monkeypatch.setenv("HARMONY_GATEWAY_ADMIN_KEYS", "sk-admin")
    monkeypatch.setenv("HARMONY_MODELS", "acme/a,acme/b")
    settings = settings_from_args(parse(*BASE[1:]))
    assert settings.admin_keys == frozenset({"sk-admin"})
    assert settings.harmony_models == frozenset({"acme/a", "acme/b"})


def test_kubernetes_service_links_and_unknown_variables_are_ignored_with_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What Kubernetes sets in every pod of a namespace with a Service named harmony-gateway.
    monkeypatch.setenv("HARMONY_GATEWAY_PORT", "tcp://10.96.0.12:8000")
    monkeypatch.setenv("HARMONY_GATEWAY_SERVICE_HOST", "10.96.0.12")
    monkeypatch.setenv("HARMONY_GATEWAY_SERVICE_PORT_HTTP", "8000")
    monkeypatch.setenv("HARMONY_GATEWAY_PORT_8000_TCP_ADDR", "10.96.0.12")
    monkeypatch.setenv("HARMONY_GATEWAY_POLCY", "random")  # a typo
    args = parse(*BASE[1:])
    assert args.port == 8000
    assert len(args.config_warnings) == 2
    assert "Kubernetes service link" in args.config_warnings[0]
    assert args.config_warnings[1] == "ignored: HARMONY_GATEWAY_POLCY (no such option; see serve --help)"


def test_other_programs_spellings(tmp_path: Path) -> None:
    args = parse(
        *("--worker-urls", "grpc://a:1", "grpc://b:1,grpc://c:1", "--worker-url", "grpc://d:1"),
        *("--served-model-name", "gpt-oss", "--tokenizer-path", str(tmp_path)),
        *("--request-timeout-secs", "60", "--queue-timeout-secs", "5", "--retry-max-retries", "4"),
        *("--health-check-interval-secs", "3", "--health-check-timeout-secs", "1"),
        *("--cb-failure-threshold", "9", "--cb-timeout-duration-secs", "12", "--max-payload-size", "1024"),
        *("--shutdown-grace-period-secs", "7", "--api-keys", "sk-1 sk-2", "--api-key", "sk-3"),
    )
    settings = settings_from_args(args)
    assert settings.worker_urls == ("grpc://a:1", "grpc://b:1", "grpc://c:1", "grpc://d:1")
    assert settings.served_model_name == "gpt-oss"
    assert settings.tokenizer_paths == {"*": str(tmp_path)}
    assert (settings.timeouts.total, settings.queue_timeout, settings.max_retries) == (60.0, 5.0, 4)
    assert (settings.health_interval, settings.health_timeout) == (3.0, 1.0)
    assert (settings.breaker_failure_threshold, settings.breaker_cooldown) == (9, 12.0)
    assert (settings.max_body_bytes, settings.drain_timeout) == (1024, 7.0)
    assert settings.api_keys == frozenset({"sk-1", "sk-2", "sk-3"})
    # The file knows them too, by either name.
    config = write(tmp_path / "g.yaml", "worker-urls: grpc://a:1 grpc://b:1\nrequest-timeout-secs: 9\n")
    settings = settings_from_args(parse("--config", config))
    assert (settings.worker_urls, settings.timeouts.total) == (("grpc://a:1", "grpc://b:1"), 9.0)


def test_the_defaults_are_unchanged_by_the_layers() -> None:
    assert settings_from_args(parse(*BASE[1:])) == Settings(worker_urls=("grpc://h:1",))


def test_env_names_follow_the_option_names() -> None:
    assert env_name("max-body-bytes") == "HARMONY_GATEWAY_MAX_BODY_BYTES"
    assert env_name("reasoning-key") == "HARMONY_GATEWAY_REASONING_KEY"  # the name it always had


def test_a_mistyped_flag_is_one_line_with_a_suggestion() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "harmony_gateway.cli", "serve", "--polcy", "random"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "(did you mean --policy?)" in proc.stderr, proc.stderr


def test_render_sends_the_first_key_of_the_gateway_variable(capsys: pytest.CaptureFixture[str]) -> None:
    assert client_key({"HARMONY_GATEWAY_API_KEY": "sk-a, sk-b"}) == "sk-a"
    assert client_key({}) is None
    assert client_key({"HARMONY_GATEWAY_KEY": "sk-old"}) == "sk-old"
    assert "HARMONY_GATEWAY_KEY is deprecated: name it HARMONY_GATEWAY_API_KEY" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        ("HARMONY_GATEWAY_QUEUE_TIMEOUT", "0", "--queue-timeout 0: must be above 0"),
        ("HARMONY_GATEWAY_MODEL_POLICY", "acme/m=fastest", "--model-policy acme/m=fastest: unknown routing"),
        ("HARMONY_GATEWAY_WORKERS", "0", "--workers 0: must be 1 or more"),
        ("HARMONY_GATEWAY_KV_TEMPERATURE", "-1", "--kv-temperature -1: temperature must be 0 or more"),
        ("HARMONY_GATEWAY_WORKER_URL", "engine:1", "--worker-url engine:1: has no scheme"),
    ],
)
def test_a_problem_names_where_its_option_was_set(
    variable: str, value: str, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    args = parse("--policy", "kv_aware")
    problem = setting_problem(settings_from_args(args))
    assert problem is not None
    assert problem.describe(args.option_sources) == f"{problem} (set by {variable})"
    assert fragment in str(problem)


def test_the_gateways_own_variables_are_not_taken_for_options() -> None:
    from harmony_gateway.app import SHARED_SLOTS_ENV
    from harmony_gateway.cli.serve import SERVE_ARGV_ENV

    assert {SHARED_SLOTS_ENV, SERVE_ARGV_ENV, "HARMONY_GATEWAY_CACHE_DIR"} <= NOT_OPTIONS
