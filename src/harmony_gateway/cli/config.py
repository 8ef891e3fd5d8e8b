"""`serve`'s options from three places, in this order of precedence: the command line, the environment
(`HARMONY_GATEWAY_<OPTION>`) and a YAML file (`--config FILE`). Nothing here lists options: each source
is derived from serve's argparse definitions (`serve_options`), so an option added there can be set in
the environment and in the file at once, checked by the same type and choices.

    # gateway.yaml: one key per option, named as on the command line without the dashes
    worker-url: [grpc://engine-0:30000, grpc://engine-1:30000]
    policy: cache_aware
    model-policy: {openai/gpt-oss-120b: kv_aware}     # a MODEL=VALUE option takes a mapping
    log-json: true

    HARMONY_GATEWAY_POLICY=round_robin            # the environment beats the file ...
    harmony-gateway serve --policy power_of_two   # ... and the command line beats both

A list option takes the whole list from the first source that sets it (no merging). `ConfigError`
carries the one-line reason a value cannot be used, naming where it came from.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: `--max-body-bytes` is `HARMONY_GATEWAY_MAX_BODY_BYTES`.
ENV_PREFIX = "HARMONY_GATEWAY_"
#: The option that names the file; the file itself may not set it.
CONFIG_OPTION = "config"

#: Old environment names, still read, with a warning: old name -> the option it sets.
DEPRECATED_ENV: dict[str, str] = {
    "HARMONY_GATEWAY_API_KEYS": "api-key",
    "HARMONY_GATEWAY_KEY": "api-key",
    "HARMONY_GATEWAY_ADMIN_KEYS": "admin-key",
    "HARMONY_MODELS": "harmony-models",
}

#: Variables with the prefix that are not options: the vocabulary cache (harmony/vocab.py), and what a
#: `serve --workers N` supervisor hands its processes.
NOT_OPTIONS = frozenset(
    {"HARMONY_GATEWAY_CACHE_DIR", "HARMONY_GATEWAY_SERVE_ARGV", "HARMONY_GATEWAY_ADMISSION_SLOTS"}
)

#: What Kubernetes puts in the environment of every pod for a Service named `harmony-gateway...`
#: (service links): `..._SERVICE_HOST`, `..._SERVICE_PORT[_NAME]`, `..._PORT` (`tcp://10.0.0.1:8000`),
#: `..._PORT_8000_TCP[_ADDR|_PORT|_PROTO]`. Never options; a `_PORT` one is ignored, with a warning.
_SERVICE_LINK_NAME = re.compile(r".*_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT|PORT_\d+_(TCP|UDP|SCTP)(_\w+)?)")
_SERVICE_LINK_VALUE = re.compile(r"(tcp|udp|sctp)://\S+:\d+")

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class ConfigError(Exception):
    """Raised when a value from the environment or the config file cannot be used, or the file cannot be
    read; the message is one line that names the variable or the file and key, and the value."""


class AliasAction(argparse.Action):
    """Another spelling of an option (other programs' names for it), folded into that option's `dest`:
    the environment and the file know the option by its own name, and the file by this one too.

    Every value is split on commas and whitespace, so `--worker-urls a b`, `--worker-urls a,b` and
    `--worker-urls "a b"` are the same two items, added to the option's list."""

    def __init__(self, option_strings: list[str], dest: str, *, alias_of: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "+")
        super().__init__(option_strings, dest, **kwargs)
        #: The option this spells, as `--name`.
        self.alias_of = alias_of

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        for value in [values] if isinstance(values, str) else values or []:
            items.extend(item for item in re.split(r"[,\s]+", value) if item)
        setattr(namespace, self.dest, items)


class CommandParser(argparse.ArgumentParser):
    """A command's parser. A mistake on its command line is one line (the reason, and where help is),
    not the usage of all its options. With `layered` set (serve), the options the command line leaves
    out come from the environment and the config file (`apply_layers`); the namespace then also holds
    `option_sources` and `config_warnings` (`Layers`)."""

    layered = False

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if self.layered and extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        if self.layered:
            try:
                layers = apply_layers(self, parsed, self._given(args), os.environ)
            except ConfigError as exc:
                self.exit(2, f"{self.prog.split()[0]}: {exc}\n")
            parsed.option_sources = layers.sources
            parsed.config_warnings = layers.warnings
        return parsed, extras

    def _suggestion(self, extras: Sequence[str]) -> str:
        known = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1)
            if close:
                return f" (did you mean {close[0]}?)"
        return ""

    def _given(self, args: Sequence[str] | None) -> set[str]:
        """The dests the command line sets: parsed again with no defaults, what is there was given."""
        saved = [(action, action.default) for action in self._actions]
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        try:
            given, _ = super().parse_known_args(args, None)
        finally:
            for action, default in saved:
                action.default = default
        return set(vars(given))


@dataclass(frozen=True)
class Option:
    """One `serve` option as the environment and the file see it: its action, named by its first long
    option string (`--worker-url` is `worker-url`, `HARMONY_GATEWAY_WORKER_URL`)."""

    action: argparse.Action
    #: A list given as text splits on whitespace too, as the alias it was named by does.
    words: bool = False

    @property
    def name(self) -> str:
        return next(s for s in self.action.option_strings if s.startswith("--"))[2:]

    @property
    def flag(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return self.action.dest

    @property
    def env(self) -> str:
        return env_name(self.name)

    @property
    def switch(self) -> bool:
        """Takes no value on the command line (`--log-json`): true or false elsewhere."""
        return self.action.nargs == 0

    @property
    def many(self) -> bool:
        """Takes a list: repeatable (`append`, `extend`) or several values at once."""
        return isinstance(
            self.action, argparse._AppendAction | argparse._ExtendAction
        ) or self.action.nargs in (
            "+",
            "*",
        )

    def from_text(self, raw: str, where: str) -> Any:
        """The value of a text (an environment variable); a list splits on commas."""
        if self.switch:
            return self._switch(raw, where)
        if self.many:
            return [self._item(item, where) for item in _split(raw, self.words)]
        return self._item(raw.strip(), where)

    def from_yaml(self, value: Any, where: str) -> Any:
        """The value of a YAML value: a scalar, a list for a list option, a mapping for a `MODEL=VALUE`
        one (`{model: value}` is `["model=value"]`)."""
        if self.switch:
            if isinstance(value, bool):
                return self.action.const if value else self.action.default
            if isinstance(value, str):
                return self._switch(value, where)
            raise ConfigError(f"{where}: expects true or false, got {value!r}")
        if self.many:
            if isinstance(value, Mapping):
                return [self._item(f"{k}={_scalar(v, where)}", where) for k, v in value.items()]
            if isinstance(value, list):
                return [self._item(_scalar(item, where), where) for item in value]
            return [self._item(item, where) for item in _split(_scalar(value, where), self.words)]
        return self._item(_scalar(value, where), where)

    def _switch(self, raw: str, where: str) -> Any:
        word = raw.strip().lower()
        if word in _TRUE:
            return self.action.const
        if word in _FALSE:
            return self.action.default
        raise ConfigError(f"{where}: expects true or false (1/0, yes/no, on/off), got {raw!r}")

    def _item(self, raw: str, where: str) -> Any:
        convert = self.action.type
        value: Any = raw
        if callable(convert):
            try:
                value = convert(raw)
            except argparse.ArgumentTypeError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            except (TypeError, ValueError):
                kind = getattr(convert, "__name__", "")
                kind = {"int": "a whole number", "float": "a number"}.get(kind, f"a valid {kind} value")
                raise ConfigError(f"{where}: expects {kind}, got {raw!r}") from None
        choices = self.action.choices
        if choices is not None and value not in choices:
            raise ConfigError(f"{where}: {raw!r} is not one of {', '.join(map(str, choices))}")
        return value


def client_key(environ: Mapping[str, str]) -> str | None:
    """The key a client command (`render --gateway`) sends: the first of `HARMONY_GATEWAY_API_KEY`
    (the variable the gateway reads its keys from, so one shell serves both), else of a deprecated
    name, with a warning on stderr."""
    names = [env_name("api-key"), *(name for name, option in DEPRECATED_ENV.items() if option == "api-key")]
    for name in names:
        keys = _split(environ.get(name, ""))
        if keys:
            if name != names[0]:
                print(f"harmony-gateway: {name} is deprecated: name it {names[0]}", file=sys.stderr)
            return keys[0]
    return None


def env_name(option: str) -> str:
    """`worker-url` -> `HARMONY_GATEWAY_WORKER_URL`."""
    return ENV_PREFIX + option.upper().replace("-", "_")


def serve_options(parser: argparse.ArgumentParser) -> list[Option]:
    """Every option of `parser` the environment and the file can set: each `dest` once, by the action
    that is not an alias (`AliasAction`); help and version are not options."""
    options: dict[str, Option] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction | AliasAction):
            continue
        if any(s.startswith("--") for s in action.option_strings):
            options.setdefault(action.dest, Option(action))
    return list(options.values())


def file_keys(parser: argparse.ArgumentParser, options: Iterable[Option]) -> dict[str, Option]:
    """Every key the file may use: each long spelling of each option (aliases included), dashed; not
    `config` (a file naming another would be a puzzle)."""
    by_dest = {option.dest: option for option in options if option.name != CONFIG_OPTION}
    keys: dict[str, Option] = {}
    for action in parser._actions:
        option = by_dest.get(action.dest)
        if option is None:
            continue
        if isinstance(action, AliasAction):
            option = Option(option.action, words=True)
        for spelling in action.option_strings:
            if spelling.startswith("--"):
                keys.setdefault(spelling[2:], option)
    return keys


@dataclass
class Layers:
    """What the environment and the file set (their values are on the namespace by now): where each
    option's value came from (`--port`, `HARMONY_GATEWAY_PORT`, `gateway.yaml: port`), and the
    warnings to log once logging is set up (deprecated names, ignored variables)."""

    sources: dict[str, str]
    warnings: list[str]


def apply_layers(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    given: Iterable[str],
    environ: Mapping[str, str],
) -> Layers:
    """Set on `args` every option not `given` on the command line (dests) from the environment, else
    from the config file. Raises ConfigError."""
    options = serve_options(parser)
    given = set(given)
    sources = {dest: _flag_of(parser, dest) for dest in given}
    environment, warnings = read_environment(options, environ)
    config_path = getattr(args, CONFIG_OPTION, None)
    if CONFIG_OPTION not in given and CONFIG_OPTION in environment:
        config_path = environment[CONFIG_OPTION][0]
    from_file = read_config_file(config_path, file_keys(parser, options)) if config_path else {}
    for option in options:
        if option.dest in given or option.dest == CONFIG_OPTION:
            continue
        layer = environment.get(option.dest) or from_file.get(option.dest)
        if layer is not None:
            setattr(args, option.dest, layer[0])
            sources[option.dest] = layer[1]
    if config_path:
        setattr(args, CONFIG_OPTION, config_path)
    return Layers(sources, warnings)


def read_environment(
    options: Iterable[Option], environ: Mapping[str, str]
) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """The options the environment sets, by dest, as (value, variable), and the warnings it deserves.
    An empty variable is unset. Raises ConfigError for a value the option refuses."""
    values: dict[str, tuple[Any, str]] = {}
    warnings: list[str] = []
    by_name = {option.name: option for option in options}
    for option in by_name.values():
        raw = environ.get(option.env, "")
        name = option.env
        if not raw.strip():
            old = [
                n
                for n, target in DEPRECATED_ENV.items()
                if target == option.name and environ.get(n, "").strip()
            ]
            if not old:
                continue
            name, raw = old[0], environ[old[0]]
            warnings.append(f"{name} is deprecated and will be removed: name it {option.env}")
        if option.name.endswith("port") and _SERVICE_LINK_VALUE.fullmatch(raw.strip()):
            warnings.append(
                f"{name}={raw.strip()} is a Kubernetes service link, not a port: ignored (set "
                "enableServiceLinks: false in the pod spec, or give the Service another name)"
            )
            continue
        values[option.dest] = (option.from_text(raw, f"{name}={raw.strip()!r}"), name)
    known = {option.env for option in by_name.values()} | set(DEPRECATED_ENV) | NOT_OPTIONS
    unknown = sorted(
        name
        for name in environ
        if name.startswith(ENV_PREFIX) and name not in known and not _SERVICE_LINK_NAME.fullmatch(name)
    )
    if unknown:
        warnings.append(f"ignored: {', '.join(unknown)} (no such option; see serve --help)")
    return values, warnings


def read_config_file(path: str, keys: Mapping[str, Option]) -> dict[str, tuple[Any, str]]:
    """The options the YAML file at `path` sets, by dest, as (value, `FILE: key`). Keys are long option
    names without the dashes (`_` for `-` works too); a null value leaves the option unset. Raises
    ConfigError for an unreadable file, YAML that is not a mapping, an unknown key or a bad value."""
    where = f"--config {path}"
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read it: {exc}") from None
    data = _load_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expects a mapping of option: value, got a {type(data).__name__}")
    unknown = [str(key) for key in data if _dashed(key) not in keys]
    if unknown:
        raise ConfigError(f"{where}: {'; '.join(_unknown_key(key, keys) for key in unknown)}")
    values: dict[str, tuple[Any, str]] = {}
    named: dict[str, str] = {}
    for key, value in data.items():
        option = keys[_dashed(key)]
        if option.dest in named:
            raise ConfigError(f"{where}: {key!r} and {named[option.dest]!r} set the same option")
        named[option.dest] = str(key)
        if value is None:
            continue
        source = f"{path}: {key}"
        values[option.dest] = (option.from_yaml(value, f"{where}: {key}: {value!r}"[:200]), source)
    return values


def _load_yaml(text: str, where: str) -> Any:
    import yaml  # lazy: PyYAML only when a config file is given

    class Loader(yaml.SafeLoader):
        """YAML 1.2's scalars: only true/false are booleans (`kv-events: off` stays the word "off"),
        and a date stays text (`conversation-date: 2025-01-02`)."""

    Loader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_BOOL_TAG, _TIMESTAMP_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        _BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
    )
    try:
        return yaml.load(text, Loader=Loader)  # a SafeLoader: no Python objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None


_BOOL_TAG = "tag:yaml.org,2002:bool"
_TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"


def _unknown_key(key: str, keys: Mapping[str, Option]) -> str:
    if _dashed(key) == CONFIG_OPTION:
        return f"{key!r}: a config file cannot name another"
    close = difflib.get_close_matches(_dashed(key), list(keys), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown option {key!r}{hint}"


def _dashed(key: object) -> str:
    return str(key).strip().lower().replace("_", "-")


def _split(raw: str, words: bool = False) -> list[str]:
    return [item for item in re.split(r"[,\s]+" if words else r"\s*,\s*", raw.strip()) if item]


def _scalar(value: Any, where: str) -> str:
    if isinstance(value, Mapping | list):
        raise ConfigError(f"{where}: expects a single value, got a {type(value).__name__}")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _flag_of(parser: argparse.ArgumentParser, dest: str) -> str:
    for action in parser._actions:
        if action.dest == dest and action.option_strings:
            return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
    return dest
