"""docs/operations.md stays true to the gateway: its YAML parses, its example alert rules are well formed
and every metric the page names is one the gateway exports, and every option it names is a real one."""

from __future__ import annotations

import argparse
import re

import yaml
from prometheus_client import CollectorRegistry

import harmony_gateway.app  # noqa: F401  (imports every module that declares metrics)
from harmony_gateway.cli import build_parser
from harmony_gateway.observability.metrics import FleetCollector, GatewayMetrics, MetricSet
from tests.deploy.kit import ROOT

DOC = ROOT / "docs" / "operations.md"
METRIC = re.compile(r"\b(?:gateway|harmony)_[a-z0-9_]+\b")
HISTOGRAM_SERIES = re.compile(r"_(?:bucket|sum|count)$")
#: Names that look like metrics but are not: the package's own name.
NOT_METRICS = {"harmony_gateway"}
#: `--config FILE`, the configuration file option the kit's Deployment passes (tests/deploy/test_kubernetes.py).


def exported_metrics() -> set[str]:
    """Every metric name the gateway can export: each `MetricSet`'s, and the fleet collector's."""
    names: set[str] = set()
    pending: list[type[MetricSet]] = [MetricSet]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls is MetricSet:
            continue
        metrics = GatewayMetrics() if cls is GatewayMetrics else cls(CollectorRegistry())  #
        names.update(metrics.registry._names_to_collectors)
    names.update(family.name for family in FleetCollector(list).collect())
    return names


def all_flags() -> set[str]:
    """Every option of every command."""
    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flags


def yaml_blocks() -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_every_metric_the_page_names_is_exported() -> None:
    exported = exported_metrics()
    assert "gateway_requests_total" in exported and "gateway_worker_healthy" in exported
    named = {HISTOGRAM_SERIES.sub("", m) for m in METRIC.findall(DOC.read_text())} - NOT_METRICS
    assert named, "the page names no metric"
    assert named <= exported, sorted(named - exported)


def test_the_alert_rules_are_well_formed() -> None:
    (rules,) = [yaml.safe_load(block) for block in yaml_blocks() if block.startswith("groups:")]
    alerts = [rule for group in rules["groups"] for rule in group["rules"]]
    assert len(alerts) >= 5
    for rule in alerts:
        assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning", "info")
        assert rule["annotations"]["summary"]
        assert METRIC.search(rule["expr"]), rule["alert"]
        assert rule["expr"].count("(") == rule["expr"].count(")"), rule["alert"]
        # Each label a summary shows is one the expression keeps.
        for label in re.findall(r"\$labels\.([a-z_]+)", rule["annotations"]["summary"]):
            assert re.search(rf"by \([^)]*\b{label}\b", rule["expr"]), (rule["alert"], label)


def test_every_yaml_block_parses_and_every_flag_is_real() -> None:
    for block in yaml_blocks():
        yaml.safe_load(block)
    text = DOC.read_text()
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text))
    flags = all_flags()
    # Flags of other programs the page shows (docker, kubectl) are not the gateway's.
    others = {"--rm"}
    assert mentioned - others <= flags, sorted(mentioned - others - flags)
