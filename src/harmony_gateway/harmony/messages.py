"""Builds Harmony messages: the system and developer prefix, history messages, and the analysis drop rule.

Pure functions over openai-harmony types; the chat and responses preparers call them, so both APIs
render identical prompts for identical conversations (REFERENCE §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from openai_harmony import (
    Author,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    TextContent,
    ToolDescription,
    ToolNamespaceConfig,
)

from ..errors import InvalidRequest

JSON_CONTENT_TYPE = "<|constrain|>json"

_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
    # Nearest level gpt-oss has for efforts clients built for other OpenAI models send.
    "minimal": ReasoningEffort.LOW,
    "xhigh": ReasoningEffort.HIGH,
    "max": ReasoningEffort.HIGH,
}


def parse_reasoning_effort(value: str | None, *, param: str) -> str:
    """Map a client effort to low/medium/high; `none` and unknown strings are 400 (gpt-oss always reasons)."""
    if value is None:
        return "medium"
    lowered = value.lower()
    if lowered == "none":
        raise InvalidRequest(
            "reasoning effort 'none' is not supported: gpt-oss always reasons; use low, medium or high",
            param=param,
        )
    if lowered not in _EFFORTS:
        raise InvalidRequest(
            f"invalid reasoning effort {value!r}; expected one of low, medium, high", param=param
        )
    return _EFFORTS[lowered].value.lower()


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any] | None
    #: Where the request declared it (`tools[2]`), named by the error if the tool cannot be rendered.
    param: str | None = field(default=None, compare=False)

    def to_description(self) -> ToolDescription:
        return ToolDescription.new(self.name, self.description, self.parameters)


@dataclass(frozen=True, slots=True)
class ToolNamespace:
    """A namespace of tools declared in the developer message (an MCP server, by its label)."""

    name: str
    description: str
    tools: tuple[FunctionTool, ...]


@dataclass(frozen=True, slots=True)
class SystemOptions:
    effort: str = "medium"
    conversation_start_date: str | None = None
    model_identity: str | None = None
    knowledge_cutoff: str | None = None
    browser_tool: bool = False
    python_tool: bool = False
    #: Pre-rendered builtin namespace configs, used instead of harmony's defaults when given.
    builtin_namespaces: tuple[Any, ...] = ()


def dedupe_function_tools(tools: Sequence[FunctionTool], *, param: str = "tools") -> list[FunctionTool]:
    seen: dict[str, FunctionTool] = {}
    for i, tool in enumerate(tools):
        prior = seen.get(tool.name)
        if prior is None:
            seen[tool.name] = tool
        elif prior.parameters != tool.parameters:
            raise InvalidRequest(
                f"tool {tool.name!r} is declared twice with different parameters", param=f"{param}[{i}]"
            )
    return list(seen.values())


def system_message(options: SystemOptions) -> Message:
    content = SystemContent.new().with_reasoning_effort(ReasoningEffort(options.effort.capitalize()))
    if options.model_identity:
        content = content.with_model_identity(options.model_identity)
    if options.knowledge_cutoff:
        content = content.with_knowledge_cutoff(options.knowledge_cutoff)
    if options.conversation_start_date:
        content = content.with_conversation_start_date(options.conversation_start_date)
    if options.browser_tool:
        content = content.with_browser_tool()
    if options.python_tool:
        content = content.with_python_tool()
    return Message.from_role_and_content(Role.SYSTEM, content)


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A structured-output schema, described to the model at the end of the developer message."""

    name: str
    description: str
    schema_json: str

    def section(self) -> str:
        comment = f"// {self.description}\n" if self.description else ""
        return f"# Response Formats\n\n## {self.name}\n\n{comment}{self.schema_json}"


def developer_message(
    instructions: str | None,
    functions: Sequence[FunctionTool],
    namespaces: Sequence[ToolNamespace] = (),
    response_format: ResponseFormat | None = None,
) -> Message | None:
    """The developer message, or None when there is nothing to say (an empty one is noise to the model)."""
    if not instructions and not functions and not namespaces and response_format is None:
        return None
    if not instructions and not functions and not namespaces:
        return Message.from_role_and_content(Role.DEVELOPER, response_format.section())  # type: ignore[union-attr]
    content = DeveloperContent.new()
    if instructions:
        content = content.with_instructions(instructions)
    if functions:
        content = content.with_function_tools([tool.to_description() for tool in functions])
    for namespace in namespaces:
        content = content.with_tools(
            ToolNamespaceConfig(
                name=namespace.name,
                description=namespace.description,
                tools=[tool.to_description() for tool in namespace.tools],
            )
        )
    if response_format is not None:
        # The Response Formats section closes the developer message (the harmony format guide).
        return Message.from_role_and_contents(
            Role.DEVELOPER, [content, TextContent(text="\n\n" + response_format.section())]
        )
    return Message.from_role_and_content(Role.DEVELOPER, content)


@dataclass(frozen=True, slots=True)
class PromptPrefix:
    """What goes into the system and developer messages. Hashable: the renderer caches its tokens, so
    the openai-harmony message objects are only built on a cache miss."""

    options: SystemOptions
    instructions: str | None = None
    functions: tuple[FunctionTool, ...] = ()
    namespaces: tuple[ToolNamespace, ...] = ()
    response_format: ResponseFormat | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        o = self.options
        return (
            o.effort,
            o.conversation_start_date,
            o.model_identity,
            o.knowledge_cutoff,
            o.browser_tool,
            o.python_tool,
            self.instructions,
            tuple((f.name, f.description, _freeze(f.parameters)) for f in self.functions),
            tuple(
                (
                    ns.name,
                    ns.description,
                    tuple((f.name, f.description, _freeze(f.parameters)) for f in ns.tools),
                )
                for ns in self.namespaces
            ),
            self.response_format,
        )

    def all_tools(self) -> list[FunctionTool]:
        return [*self.functions, *(tool for ns in self.namespaces for tool in ns.tools)]

    def messages(self) -> list[Message]:
        prefix = [system_message(self.options)]
        developer = developer_message(
            self.instructions, self.functions, self.namespaces, self.response_format
        )
        if developer is not None:
            prefix.append(developer)
        return prefix


def _freeze(value: Any) -> Any:
    # Tagged so that distinct schemas never share a cache key: True == 1 == 1.0 as dict keys, yet harmony
    # renders `default: true`, `default: 1` and `default: 1.0`; a dict and a list of pairs differ too.
    if isinstance(value, dict):
        return ("{", *((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("[", *(_freeze(v) for v in value))
    if isinstance(value, bool | float):
        return (type(value), value)
    return value


class Msg(NamedTuple):
    """A history message as plain data: cheap to build, hash and store; rendered by PromptRenderer.

    `kind` is never rendered: it tells the gateway what a message stands for where its text cannot (a
    conversation summary, `surfaces/responses/compaction.py`)."""

    role: str
    text: str
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    name: str | None = None
    kind: str | None = None

    def to_harmony(self) -> Message:
        # An empty name, channel, recipient or content type is absent from the rendered header.
        return Message(
            author=Author(role=Role(self.role), name=self.name or None),
            content=[TextContent(text=self.text)],
            channel=self.channel or None,
            recipient=self.recipient or None,
            content_type=self.content_type or None,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self._asdict().items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Msg:
        return cls(
            role=data["role"],
            text=data.get("text", ""),
            channel=data.get("channel"),
            recipient=data.get("recipient"),
            content_type=data.get("content_type"),
            name=data.get("name"),
            kind=data.get("kind"),
        )


def user(text: str) -> Msg:
    return Msg("user", text)


def developer_text(text: str) -> Msg:
    """A mid-conversation developer message (instructions that arrive after the conversation started)."""
    return Msg("developer", "# Instructions\n\n" + text)


def assistant(text: str, channel: str) -> Msg:
    return Msg("assistant", text, channel=channel)


def assistant_call(
    recipient: str, arguments: str, channel: str = "commentary", content_type: str | None = JSON_CONTENT_TYPE
) -> Msg:
    return Msg("assistant", arguments, channel=channel, recipient=recipient, content_type=content_type)


def tool_result(tool_name: str, text: str, channel: str = "commentary") -> Msg:
    return Msg("tool", text, channel=channel, recipient="assistant", name=tool_name)


def drop_old_analysis(messages: list[Msg]) -> list[Msg]:
    """Drop analysis messages before the last assistant final answer (Harmony's rule; REFERENCE §2.5).

    Analysis after the last final is kept: it is the reasoning between a tool call and its result, which
    the model needs to continue.
    """
    last_final = -1
    for i in range(len(messages) - 1, -1, -1):
        m = messages[i]
        if m.role == "assistant" and m.channel == "final":
            last_final = i
            break
    if last_final < 0:
        return messages
    # Any role: a built-in tool's result on the analysis channel goes with the analysis call that asked for
    # it (as openai-harmony's own auto_drop_analysis does), never left behind without its call.
    return [m for i, m in enumerate(messages) if not (i < last_final and m.channel == "analysis")]
