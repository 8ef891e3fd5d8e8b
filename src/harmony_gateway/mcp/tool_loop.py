"""The gateway-executed tools of one Responses request: MCP servers and the built-in `browser` / `python`
tools, how the model sees them (Harmony namespaces), and how one call the model made is run.

`ToolLoop` is built per request by `open_tool_loop()`: it validates the request's `mcp`,
`web_search(_preview)` and `code_interpreter` tools, guards request `server_url`s against SSRF, connects
(pooled connections for configured servers, fresh ones for request-declared servers) and lists tools, all
before generation, so an unreachable server fails the request with an HTTP error. During generation the
output builder asks `decide()` how each tool call is reported (executed, approval request, or over the
`max_tool_calls` limit) and the pipeline awaits `execute()` for the calls that run. Every call counts
against the limit, those the model makes and those the user approved (`take_call()`). Tool errors and
timeouts never raise: they become the call's `error` and the text the model reads. `aclose()` closes the
request's own connections.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest
from ..harmony.messages import FunctionTool, ToolNamespace
from ..types.tool_names import is_tool_name
from .approval import ApprovalIds, approval_request_item, needs_approval, validate_policy
from .client import McpConnection, McpServerUnavailable, McpTool, McpToolFailed
from .config import ServerConfig
from .pool import PoolLimits
from .security import check_server_url

if TYPE_CHECKING:
    from ..observability.metrics import GatewayMetrics

#: Request tool types served here; function tools stay with the pipeline.
GATEWAY_TOOL_TYPES = frozenset({"mcp", "web_search", "web_search_preview", "code_interpreter"})
RESERVED_LABELS = frozenset({"functions", "browser", "python", "container", "assistant", "multi_tool_use"})
BROWSER_TOOLS = ("search", "open", "find")

# Decision kinds.
EXECUTE = "execute"  # run it now
APPROVAL = "approval"  # report an mcp_approval_request and stop
OVER_LIMIT = "over_limit"  # max_tool_calls reached: not run, the model is told

INVALID_JSON_TEXT = (
    "Error: the arguments of this tool call are not valid JSON ({detail}). "
    "Call the tool again with a single JSON object as its arguments."
)


@dataclass(frozen=True, slots=True)
class McpToolRequest:
    """One `{"type": "mcp", ...}` entry of a request's `tools`."""

    index: int
    label: str
    url: str | None
    headers: dict[str, str] = field(repr=False)
    allowed_tools: tuple[str, ...] | None
    allowed_read_only: bool
    require_approval: Any
    description: str | None

    @property
    def param(self) -> str:
        return f"tools[{self.index}]"


@dataclass(frozen=True, slots=True)
class GatewayTools:
    """What a request asks the gateway to run."""

    mcp: tuple[McpToolRequest, ...] = ()
    web_search: int | None = None  # index in `tools`
    code_interpreter: int | None = None

    def __bool__(self) -> bool:
        return bool(self.mcp) or self.web_search is not None or self.code_interpreter is not None


def _allowed(raw: Any, param: str) -> tuple[tuple[str, ...] | None, bool]:
    if raw is None:
        return None, False
    if isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        return tuple(raw), False
    if isinstance(raw, dict):
        names = raw.get("tool_names")
        if names is not None and not (isinstance(names, list) and all(isinstance(x, str) for x in names)):
            raise InvalidRequest("allowed_tools.tool_names must be a list of names", param=param)
        return (tuple(names) if names is not None else None), bool(raw.get("read_only"))
    raise InvalidRequest("allowed_tools must be a list of tool names or a filter object", param=param)


def parse_gateway_tools(tools: Iterable[dict[str, Any]] | None) -> GatewayTools:
    """Validate the request's gateway-executed tools; raises InvalidRequest naming `tools[i].field`."""
    mcp: list[McpToolRequest] = []
    web_search = code_interpreter = None
    labels: set[str] = set()
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        where = f"tools[{i}]"
        if kind in ("web_search", "web_search_preview"):
            web_search = i
        elif kind == "code_interpreter":
            code_interpreter = i
        elif kind == "mcp":
            label = tool.get("server_label")
            if not isinstance(label, str) or not is_tool_name(label):  # it prefixes the tools' names
                raise InvalidRequest(
                    "server_label must be 1-64 letters, digits, '_' or '-'", param=f"{where}.server_label"
                )
            if label in RESERVED_LABELS:
                raise InvalidRequest(f"server_label {label!r} is reserved", param=f"{where}.server_label")
            if label in labels:
                raise InvalidRequest(f"server_label {label!r} is used twice", param=f"{where}.server_label")
            labels.add(label)
            if tool.get("connector_id"):
                raise InvalidRequest(
                    "connector_id is not supported by this gateway; give a server_url",
                    param=f"{where}.connector_id",
                )
            url = tool.get("server_url")
            if url is not None and not isinstance(url, str):
                raise InvalidRequest("server_url must be a string", param=f"{where}.server_url")
            headers = tool.get("headers") or {}
            if not isinstance(headers, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
            ):
                raise InvalidRequest("headers must map names to strings", param=f"{where}.headers")
            if tool.get("authorization"):
                headers = {**headers, "Authorization": f"Bearer {tool['authorization']}"}
            allowed, read_only = _allowed(tool.get("allowed_tools"), f"{where}.allowed_tools")
            approval = tool.get("require_approval")
            validate_policy(approval, param=f"{where}.require_approval")
            description = tool.get("server_description")
            mcp.append(
                McpToolRequest(
                    i,
                    label,
                    url,
                    headers,
                    allowed,
                    read_only,
                    approval,
                    description if isinstance(description, str) else None,
                )
            )
    return GatewayTools(tuple(mcp), web_search, code_interpreter)


@dataclass(eq=False)
class BoundServer:
    """A server of this request: its connection, the tools offered to the model and its approval policy."""

    label: str
    connection: McpConnection
    tools: dict[str, McpTool]
    approval: Any
    owned: bool  # a request-declared connection, closed with the request
    description: str = ""
    list_item: dict[str, Any] | None = None  # to report (None: the chain listed it already)


@dataclass(slots=True)
class Decision:
    """How one tool call the model made is handled; fixed when its header is parsed."""

    kind: str
    recipient: str
    item: str  # output item type: mcp_call | web_search_call | code_interpreter_call
    server: BoundServer | None = None
    tool: str = ""  # the server-side tool name


@dataclass(slots=True)
class CallOutcome:
    output: str | None
    error: dict[str, Any] | None  # the openai SDK's McpToolCallError shape
    model_text: str  # the tool message the model reads


def protocol_error(message: str, code: int = -32602) -> dict[str, Any]:
    return {"type": "mcp_protocol_error", "code": code, "message": message}


def error_text(error: Any) -> str:
    """Readable text of an mcp_call error: a string (older clients) or an McpToolCallError object."""
    if isinstance(error, str):
        return error
    if not isinstance(error, dict):
        return ""
    message = error.get("message")
    if isinstance(message, str):
        return message
    pieces = [
        str(block.get("text", ""))
        for block in error.get("content") or ()
        if isinstance(block, dict) and block.get("type") == "text"
    ]
    return "\n".join(pieces) or "the tool reported an error"


def _filter_tools(
    tools: Iterable[McpTool], allowed: tuple[str, ...] | None, read_only: bool
) -> list[McpTool]:
    out = []
    for tool in tools:
        if allowed is not None and tool.name not in allowed and not (read_only and tool.read_only):
            continue
        if allowed is None and read_only and not tool.read_only:
            continue
        out.append(tool)
    return out


def cap_output(text: str, limit: int) -> str:
    if limit <= 0 or len(text) <= limit:
        return text
    return text[:limit] + f"\n[output truncated: {limit} of {len(text)} characters shown]"


def list_tools_item(
    item_id: str, label: str, tools: list[McpTool], error: str | None = None
) -> dict[str, Any]:
    item: dict[str, Any] = {
        "type": "mcp_list_tools",
        "id": item_id,
        "server_label": label,
        "tools": [t.to_item() for t in tools],
    }
    if error is not None:
        item["error"] = error
    return item


class ToolLoop:
    """The gateway-executed tools of one request (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        *,
        max_calls: int,
        limits: PoolLimits,
        approval_ids: ApprovalIds,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.max_calls = max_calls
        self.approval_ids = approval_ids
        #: The pool's timeouts and output cap, which every call of the loop keeps to.
        self.limits = limits
        self.metrics = metrics
        self.servers: dict[str, BoundServer] = {}
        self.browser: BoundServer | None = None
        self.python: BoundServer | None = None
        self.python_tool = "python"
        self.calls = 0  # calls run so far, approved ones included (the limit counts them)
        self.over_limit = 0  # calls refused for the limit

    # -- what the model sees -------------------------------------------------------------------
    @property
    def namespaces(self) -> tuple[ToolNamespace, ...]:
        out = []
        for server in self.servers.values():
            tools = tuple(
                FunctionTool(t.name, t.description, t.input_schema or None) for t in server.tools.values()
            )
            out.append(ToolNamespace(server.label, server.description, tools))
        return tuple(out)

    @property
    def tool_namespaces(self) -> frozenset[str]:
        names = set(self.servers)
        if self.browser is not None:
            names.add("browser")
        if self.python is not None:
            names.add("python")
        return frozenset(names)

    def list_items(self) -> list[dict[str, Any]]:
        return [s.list_item for s in self.servers.values() if s.list_item is not None]

    # -- deciding and running ------------------------------------------------------------------
    def resolve(self, recipient: str) -> Decision:
        """Which server and tool a recipient names (approval and limits not applied)."""
        namespace, _, tool = recipient.partition(".")
        if namespace == "browser" and self.browser is not None:
            return Decision(EXECUTE, recipient, "web_search_call", self.browser, tool)
        if namespace == "python" and self.python is not None:
            return Decision(EXECUTE, recipient, "code_interpreter_call", self.python, self.python_tool)
        return Decision(EXECUTE, recipient, "mcp_call", self.servers.get(namespace), tool)

    def decide(self, recipient: str) -> Decision:
        decision = self.resolve(recipient)
        server = decision.server
        if decision.item == "mcp_call" and server is not None:
            tool = server.tools.get(decision.tool)
            if tool is not None and needs_approval(server.approval, tool, decision.tool):
                decision.kind = APPROVAL
                return decision
        if not self.take_call():
            decision.kind = OVER_LIMIT
        return decision

    def take_call(self) -> bool:
        """Count one call about to run against `max_tool_calls`; False (and counted as refused) when the
        limit is reached, so the call must not run."""
        if self.calls >= self.max_calls:
            self.over_limit += 1
            return False
        self.calls += 1
        return True

    def approval_request(self, decision: Decision, arguments: str) -> dict[str, Any]:
        """The `mcp_approval_request` item for a call decided APPROVAL, its id issued for this tenant and
        call (only such ids are accepted as answered later)."""
        label = decision.server.label if decision.server is not None else ""
        return approval_request_item(self.approval_ids, label, decision.tool, arguments)

    def limit_text(self) -> str:
        return (
            f"Tool call limit reached: this response may make at most {self.max_calls} tool calls "
            "(max_tool_calls), so this call was not executed. Do not call any more tools; answer the "
            "user now with the information you already have."
        )

    async def execute(self, decision: Decision, arguments: str) -> CallOutcome:
        """Run one call; never raises for tool problems (they become the outcome's error)."""
        server = decision.server
        label = server.label if server is not None else decision.recipient.partition(".")[0]
        if server is None:
            error = protocol_error(f"unknown tool {decision.recipient!r}")
            return self._failed(label, decision.tool, error, 0.0)
        if decision.item == "code_interpreter_call":
            args: dict[str, Any] = {"code": arguments}
        else:
            try:
                parsed = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                return self._invalid_arguments(label, decision.tool, str(exc))
            if not isinstance(parsed, dict):
                return self._invalid_arguments(label, decision.tool, "expected an object")
            args = parsed
            if decision.item == "mcp_call" and decision.tool not in server.tools:
                error = protocol_error(f"tool {decision.tool!r} is not offered by server {label!r}")
                return self._failed(label, decision.tool, error, 0.0)
        started = time.perf_counter()
        connection = server.connection
        try:
            if not server.owned and not connection.alive:
                connection = server.connection = await self.pool.get(label)
            result = await connection.call_tool(decision.tool, args, self.limits.tool_timeout)
        except McpToolFailed as exc:
            outcome = "timeout" if exc.timed_out else "error"
            return self._failed(label, decision.tool, exc.to_error(), time.perf_counter() - started, outcome)
        except McpServerUnavailable as exc:
            error = {"type": "http_error", "code": 502, "message": exc.message}
            return self._failed(label, decision.tool, error, time.perf_counter() - started)
        elapsed = time.perf_counter() - started
        text = cap_output(result.text, self.limits.max_output_chars)
        if result.is_error:
            content = [
                dict(block, text=cap_output(block["text"], self.limits.max_output_chars))
                if isinstance(block.get("text"), str)
                else block
                for block in result.content
            ] or [{"type": "text", "text": text or "the tool reported an error"}]
            error = {"type": "mcp_tool_execution_error", "content": content}
            return self._failed(label, decision.tool, error, elapsed, "tool_error")
        self._record(label, decision.tool, "success", elapsed)
        return CallOutcome(text, None, text)

    def _invalid_arguments(self, label: str, tool: str, detail: str) -> CallOutcome:
        self._record(label, tool, "invalid_arguments", None)
        error = protocol_error(f"invalid JSON arguments: {detail}")
        return CallOutcome(None, error, INVALID_JSON_TEXT.format(detail=detail))

    def _failed(
        self, label: str, tool: str, error: dict[str, Any], elapsed: float, outcome: str = "error"
    ) -> CallOutcome:
        self._record(label, tool, outcome, elapsed if elapsed else None)
        if isinstance(error.get("message"), str):
            error["message"] = cap_output(error["message"], self.limits.max_output_chars)
        return CallOutcome(None, error, f"Error: {error_text(error)}")

    def _record(self, label: str, tool: str, outcome: str, elapsed: float | None) -> None:
        metrics = self.metrics
        if metrics is None:
            return
        metrics.mcp_tool_calls.labels(label, tool, outcome).inc()
        if elapsed is not None:
            metrics.mcp_tool_latency.labels(label, tool).observe(elapsed)

    async def aclose(self) -> None:
        for server in {id(s): s for s in (*self.servers.values(), self.browser, self.python) if s}.values():
            if server.owned:
                await server.connection.close()


async def open_tool_loop(
    pool: Any,
    requested: GatewayTools,
    *,
    max_calls: int,
    listed: dict[str, list[McpTool]],
    new_id: Any,
    approval_ids: ApprovalIds,
    metrics: GatewayMetrics | None = None,
) -> ToolLoop:
    """Connect and list every server the request uses; raises InvalidRequest (bad or refused tools) or
    McpServerUnavailable (a server that cannot be reached), closing what was opened."""
    if pool is None:
        raise McpServerUnavailable("MCP tools are not available on this gateway", param="tools")
    limits = pool.limits
    loop = ToolLoop(
        pool,
        max_calls=max_calls,
        limits=limits,
        approval_ids=approval_ids,
        metrics=metrics,
    )
    config = pool.config
    try:
        for spec in requested.mcp:
            configured = config.servers.get(spec.label)
            if spec.url is None:
                if configured is None:
                    raise InvalidRequest(
                        f"server_label {spec.label!r} is not a server configured on this gateway; "
                        "give its server_url",
                        param=f"{spec.param}.server_url",
                    )
                connection = await pool.get(spec.label)
                owned = False
                allowed = spec.allowed_tools
                if configured.allowed_tools is not None:
                    allowed = tuple(
                        t for t in (allowed or configured.allowed_tools) if t in configured.allowed_tools
                    )
                approval = (
                    spec.require_approval
                    if spec.require_approval is not None
                    else configured.require_approval
                )
            else:
                await check_server_url(spec.url, pool.allow_hosts, param=f"{spec.param}.server_url")
                server_config = ServerConfig(
                    label=spec.label,
                    transport="streamable_http",
                    url=spec.url,
                    headers=spec.headers,
                    configured=False,
                )
                connection = await pool.connect(server_config)
                owned = True
                allowed = spec.allowed_tools
                approval = spec.require_approval
            server = BoundServer(spec.label, connection, {}, approval, owned, spec.description or "")
            loop.servers[spec.label] = server
            previous = listed.get(spec.label)
            if previous is not None:
                tools = previous
            else:
                tools = await connection.list_tools(limits.list_timeout)
            tools = _filter_tools(tools, allowed, spec.allowed_read_only)
            server.tools = {t.name: t for t in tools}
            if previous is None:
                server.list_item = list_tools_item(new_id("mcpl"), spec.label, tools)
        if requested.web_search is not None:
            loop.browser = await _builtin(pool, config.browser, "browser", requested.web_search, "web_search")
        if requested.code_interpreter is not None:
            loop.python = await _builtin(
                pool, config.python, "python", requested.code_interpreter, "code_interpreter"
            )
            loop.python_tool = config.python_tool
    except BaseException:
        await loop.aclose()
        raise
    return loop


async def _builtin(pool: Any, label: str | None, builtin: str, index: int, kind: str) -> BoundServer:
    if label is None:
        raise InvalidRequest(
            f"the {kind} tool needs an MCP server backing the '{builtin}' built-in "
            f"(builtins.{builtin} in --mcp-config); none is configured",
            param=f"tools[{index}].type",
        )
    connection = await pool.get(label)
    return BoundServer(label, connection, {}, "never", False)


__all__ = [
    "APPROVAL",
    "EXECUTE",
    "GATEWAY_TOOL_TYPES",
    "OVER_LIMIT",
    "CallOutcome",
    "Decision",
    "GatewayTools",
    "McpToolRequest",
    "ToolLoop",
    "cap_output",
    "list_tools_item",
    "open_tool_loop",
    "parse_gateway_tools",
]
