"""The public surface of `harmony_gateway.mcp`."""

from __future__ import annotations

import harmony_gateway.mcp as mcp_package


def test_all_names_exist() -> None:
    assert sorted(mcp_package.__all__) == mcp_package.__all__
    for name in mcp_package.__all__:
        assert getattr(mcp_package, name) is not None
    assert {"McpPool", "ToolLoop", "open_tool_loop", "load_mcp_config"} <= set(mcp_package.__all__)
