"""MCP for the Responses API: server connections (`client`, `pool`), the `--mcp-config` file (`config`),
the SSRF guard (`security`), approvals (`approval`) and the per-request tool set of the loop
(`tool_loop`). The loop's iterations themselves run in `surfaces/responses/service/turns.py`."""

from .client import McpConnection, McpServerUnavailable, McpTool, McpToolFailed, ToolResult
from .config import McpConfig, McpConfigError, ServerConfig, load_mcp_config, parse_mcp_config
from .pool import McpPool, open_mcp_pool
from .tool_loop import GatewayTools, ToolLoop, open_tool_loop, parse_gateway_tools

__all__ = [
    "GatewayTools",
    "McpConfig",
    "McpConfigError",
    "McpConnection",
    "McpPool",
    "McpServerUnavailable",
    "McpTool",
    "McpToolFailed",
    "ServerConfig",
    "ToolLoop",
    "ToolResult",
    "load_mcp_config",
    "open_mcp_pool",
    "open_tool_loop",
    "parse_gateway_tools",
    "parse_mcp_config",
]
