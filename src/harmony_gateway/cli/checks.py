"""What `serve` checks before it binds its port: settings that cannot work (names, numbers, URLs) and
files it cannot use (key files, the MCP config, TLS material, tokenizer folders). Each problem is a
`StartupError`: one line naming the option and its value, which the command prints before exiting 2.
The checks that need I/O beyond reading files (the storage's reachability, the ports) are in
`cli/startup.py`."""

from __future__ import annotations

import ipaddress
import os
import ssl
from collections.abc import Mapping

from ..engines.registry import GRPC_ENGINES, check_worker_url
from ..errors import InvalidRequest
from ..pipeline.output_parsers.registry import validate_parser_names
from ..routing.cache_aware import CacheAwarePolicy
from ..routing.dns_discovery import parse_dns_target, parse_nameserver
from ..routing.kv_aware import KvAwarePolicy
from ..routing.registry import POLICIES
from ..settings import Settings
from ..storage.registry import STORES


class StartupError(Exception):
    """Raised when the gateway cannot start with its settings; the message is one line naming the
    option (`dest`, when one is to blame) and its value."""

    def __init__(self, message: str, dest: str | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.dest = dest

    def describe(self, sources: Mapping[str, str]) -> str:
        """The message, plus where the option was set when not on the command line (`sources`: dest ->
        `--flag`, `HARMONY_GATEWAY_...` or `FILE: key`, `cli/config.Layers`)."""
        source = sources.get(self.dest, "") if self.dest else ""
        if source and not source.startswith("-"):
            return f"{self} (set by {source})"
        return str(self)


def shown(value: object) -> str:
    """A value as the command line would give it (`-1`, not `-1.0`)."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def flag(dest: str) -> str:
    """The command-line flag of a `serve` option, by dest (`max_body_bytes` -> `--max-body-bytes`)."""
    return "--" + dest.replace("_", "-")


#: Policy constructor options whose `serve` option has another name.
_POLICY_OPTION_DESTS = {
    "overlap_weight": "kv_overlap_weight",
    "queue_weight": "kv_queue_weight",
    "decode_weight": "kv_decode_weight",
    "load_max_age": "kv_load_max_age",
    "temperature": "kv_temperature",
}


def setting_problem(settings: Settings) -> StartupError | None:
    """The first setting that cannot work, or None. Pure: reads no file, resolves no name."""
    for check in (
        _policy_problem,
        _number_problem,
        _url_problem,
        _traffic_problem,
        _discovery_problem,
    ):
        problem = check(settings)
        if problem is not None:
            return problem
    if settings.protect_metrics and not settings.admin_keys and settings.admin_port is None:
        return StartupError(
            "--protect-metrics needs the admin credential: pass --admin-key KEY or --admin-port PORT",
            "protect_metrics",
        )
    return None


def _policy_problem(settings: Settings) -> StartupError | None:
    named = [("policy", settings.policy), ("prefill_policy", settings.prefill_policy)]
    named += [("decode_policy", settings.decode_policy)]
    named += [("model_policy", f"{model}={name}") for model, name in settings.model_policies.items()]
    for dest, value in named:
        name = value.rpartition("=")[2] if value is not None else None
        if name is not None and name not in POLICIES:
            return StartupError(
                f"{flag(dest)} {value}: unknown routing policy {name!r}; expected one of "
                f"{', '.join(sorted(POLICIES))}",
                dest,
            )
    for policy, cls in (("cache_aware", CacheAwarePolicy), ("kv_aware", KvAwarePolicy)):
        options = settings.policy_options(policy)
        try:
            cls(**options)
        except ValueError as exc:
            knob = next((name for name in options if name in str(exc)), None)
            if knob is None:
                return StartupError(str(exc), "policy")
            dest = _POLICY_OPTION_DESTS.get(knob, knob)
            return StartupError(f"{flag(dest)} {shown(getattr(settings, dest))}: {exc}", dest)
    try:
        validate_parser_names(settings.reasoning_parsers, settings.tool_call_parsers, settings.text_parsers)
    except InvalidRequest as exc:
        return StartupError(exc.message)
    return None


def _number_problem(settings: Settings) -> StartupError | None:
    at_least_zero = (
        "engine_wedge_ms",
        "engine_prefill_rate",
        "load_poll_interval",
        "text_parser_window_chars",
        "queue_size",
        "drain_timeout",
        "max_retries",
        "bootstrap_port",
    )
    above_zero = (
        "queue_timeout",
        "health_interval",
        "health_timeout",
        "mcp_tool_timeout",
        "header_timeout",
        "body_timeout",
        "keep_alive_timeout",
        "max_body_bytes",
        "max_header_bytes",
        "max_headers",
        "max_parse_tokens",
        "health_failure_threshold",
        "health_success_threshold",
        "breaker_failure_threshold",
        "ws_max_message_bytes",
        "ws_idle_timeout",
        "ws_max_turns",
        "ws_max_lifetime",
        "ws_max_sockets_per_key",
    )
    optional_at_least_one = ("max_concurrent_requests", "rate_limit", "token_rate_limit", "max_connections")
    for dest in at_least_zero:
        if getattr(settings, dest) < 0:
            return StartupError(f"{flag(dest)} {shown(getattr(settings, dest))}: must be 0 or more", dest)
    for dest in above_zero:
        if getattr(settings, dest) <= 0:
            return StartupError(f"{flag(dest)} {shown(getattr(settings, dest))}: must be above 0", dest)
    for dest in optional_at_least_one:
        value = getattr(settings, dest)
        if value is not None and value < 1:
            return StartupError(f"{flag(dest)} {value}: must be 1 or more", dest)
    if settings.text_parser_window_seconds is not None and settings.text_parser_window_seconds <= 0:
        value = settings.text_parser_window_seconds
        return StartupError(
            f"--text-parser-window-seconds {value}: must be above 0", "text_parser_window_seconds"
        )
    if settings.breaker_cooldown < 0:
        return StartupError(
            f"--breaker-cooldown {shown(settings.breaker_cooldown)}: must be 0 or more", "breaker_cooldown"
        )
    for dest in ("port", "admin_port"):
        port = getattr(settings, dest)
        if port is not None and not 0 <= port < 65536:
            return StartupError(f"{flag(dest)} {port}: not a port (0 to 65535)", dest)
    if settings.processes < 1:
        return StartupError(f"--workers {settings.processes}: must be 1 or more", "workers")
    return None


def _url_problem(settings: Settings) -> StartupError | None:
    for dest, option in (
        ("worker_urls", "--worker-url"),
        ("prefill_urls", "--prefill"),
        ("decode_urls", "--decode"),
    ):
        for url in getattr(settings, dest):
            try:
                check_worker_url(url)
            except InvalidRequest as exc:
                return StartupError(f"{option} {url}: {_without_url(exc.message, url)}", _option_dest(dest))
    if settings.storage_url is not None:
        scheme, sep, _ = settings.storage_url.partition("://")
        if not sep or scheme.lower() not in STORES:
            shown = f"unsupported scheme {scheme!r}" if sep else "no scheme"
            return StartupError(
                f"--storage {redact(settings.storage_url)}: {shown}; expected memory://, sqlite:///PATH or "
                "postgresql://USER@HOST/DB",
                "storage",
            )
    if settings.otlp_endpoint is not None and not settings.otlp_endpoint.startswith(("http://", "https://")):
        return StartupError(
            f"--otlp-endpoint {settings.otlp_endpoint}: expects an OTLP/HTTP URL such as http://127.0.0.1:4318",
            "otlp_endpoint",
        )
    if settings.rate_limit_store and not settings.rate_limit_store.startswith(("redis://", "rediss://")):
        return StartupError(
            f"--rate-limit-store {redact(settings.rate_limit_store)}: expects redis://host:port/db",
            "rate_limit_store",
        )
    return None


def _traffic_problem(settings: Settings) -> StartupError | None:
    for peer in settings.forwarded_allow_ips:
        if peer != "*":
            try:
                ipaddress.ip_network(peer, strict=False)
            except ValueError:
                return StartupError(
                    f"--forwarded-allow-ips {peer}: expects IPs, CIDRs or '*'", "forwarded_allow_ips"
                )
    if bool(settings.ssl_certfile) != bool(settings.ssl_keyfile):
        given = "--ssl-certfile" if settings.ssl_certfile else "--ssl-keyfile"
        missing = "--ssl-keyfile" if settings.ssl_certfile else "--ssl-certfile"
        return StartupError(f"{given} needs {missing} too", given[2:].replace("-", "_"))
    return None


def _discovery_problem(settings: Settings) -> StartupError | None:
    try:
        for spec in settings.worker_dns:
            parse_dns_target(spec, tuple(GRPC_ENGINES))
    except ValueError as exc:
        return StartupError(str(exc), "worker_dns")
    if settings.worker_dns_server is not None:
        try:
            parse_nameserver(settings.worker_dns_server)
        except ValueError as exc:
            return StartupError(str(exc), "worker_dns_server")
    for dest in ("worker_dns_interval", "worker_dns_timeout"):
        if getattr(settings, dest) <= 0:
            return StartupError(f"{flag(dest)} {shown(getattr(settings, dest))}: must be above 0", dest)
    if settings.worker_dns_drain_timeout is not None and settings.worker_dns_drain_timeout < 0:
        value = settings.worker_dns_drain_timeout
        return StartupError(
            f"--worker-dns-drain-timeout {value}: must be 0 or more", "worker_dns_drain_timeout"
        )
    return None


def file_problem(settings: Settings) -> StartupError | None:
    """The first file the settings name that cannot be used, or None. Reads the files (blocking)."""
    if settings.mcp_config:
        from ..mcp.config import McpConfigError, load_mcp_config  # lazy: the MCP SDK only with --mcp-config

        try:
            load_mcp_config(settings.mcp_config)
        except McpConfigError as exc:
            return StartupError(
                f"--mcp-config {settings.mcp_config}: {str(exc).splitlines()[0]}", "mcp_config"
            )
    if settings.ssl_certfile and settings.ssl_keyfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(settings.ssl_certfile, settings.ssl_keyfile)
        except (OSError, ssl.SSLError) as exc:
            return StartupError(
                f"--ssl-certfile {settings.ssl_certfile} / --ssl-keyfile {settings.ssl_keyfile}: cannot "
                f"load them: {exc}",
                "ssl_certfile",
            )
    for model, folder in settings.tokenizer_paths.items():
        if not os.path.isdir(folder):
            shown = folder if model == "*" else f"{model}={folder}"
            return StartupError(f"--tokenizer {shown}: no such folder", "tokenizer")
    return None


def redact(url: str) -> str:
    """`url` without its password (`postgresql://gw:***@db/x`)."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not sep or not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def _without_url(message: str, url: str) -> str:
    """An engine-layer message about `url` without repeating it (the option names it)."""
    return message.replace(f"worker URL {url!r} ", "").replace(f"worker URL {url!r}: ", "")


def _option_dest(settings_field: str) -> str:
    return {"worker_urls": "worker_url", "prefill_urls": "prefill", "decode_urls": "decode"}[settings_field]
