"""The --mcp-config file format."""

from __future__ import annotations

import pytest

from harmony_gateway.mcp.config import McpConfigError, load_mcp_config, parse_mcp_config


def test_full_config(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DOCS_TOKEN", "t0ken")
    path = tmp_path / "mcp.yaml"
    path.write_text(
        """
servers:
  docs:
    url: https://docs.example.com/mcp
    headers: {Authorization: "Bearer ${DOCS_TOKEN}"}
    require_approval: never
    allowed_tools: [search_docs]
  legacy:
    transport: sse
    url: https://legacy.example.com/sse
  sandbox:
    command: python
    args: [-m, sandbox]
    env: {MODE: strict}
builtins:
  browser: docs
  python: {server: sandbox, tool: run}
"""
    )
    config = load_mcp_config(path)
    docs = config.servers["docs"]
    assert docs.transport == "streamable_http" and docs.headers == {"Authorization": "Bearer t0ken"}
    assert docs.require_approval == "never" and docs.allowed_tools == ("search_docs",)
    assert "t0ken" not in repr(docs)  # secrets stay out of logs and tracebacks
    assert config.servers["legacy"].transport == "sse"
    sandbox = config.servers["sandbox"]
    assert (
        sandbox.transport == "stdio"
        and sandbox.args == ("-m", "sandbox")
        and sandbox.env == {"MODE": "strict"}
    )
    assert (config.browser, config.python, config.python_tool) == ("docs", "sandbox", "run")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"servers": {"x": {"transport": "carrier-pigeon", "url": "https://a"}}}, "transport"),
        ({"servers": {"x": {"transport": "stdio"}}}, "command"),
        ({"servers": {"x": {"url": "ftp://a"}}}, "url"),
        ({"servers": {"functions": {"url": "https://a"}}}, "reserved"),
        ({"servers": {"bad label": {"url": "https://a"}}}, "label"),
        ({"servers": {"x": {"url": "https://a", "allowed_tools": "all"}}}, "allowed_tools"),
        ({"servers": {"x": {"url": "https://a", "require_approval": "sometimes"}}}, "require_approval"),
        ({"servers": {"x": {"url": "https://a"}}, "builtins": {"browser": "y"}}, "not among"),
        ({"servers": {"x": {"url": "https://a"}}, "builtins": {"container": "x"}}, "only browser"),
        ({"servers": {"x": {"url": "https://a", "headers": {"A": "${NOT_SET_ANYWHERE_42}"}}}}, "NOT_SET"),
        (["not", "a", "mapping"], "mapping"),
    ],
)
def test_invalid_configs(raw, message) -> None:
    with pytest.raises(McpConfigError, match=message):
        parse_mcp_config(raw)


def test_unreadable_and_invalid_yaml(tmp_path) -> None:
    with pytest.raises(McpConfigError, match="cannot read"):
        load_mcp_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("servers: [unclosed")
    with pytest.raises(McpConfigError, match="not valid YAML"):
        load_mcp_config(bad)
