"""The simulated model's tool-loop rules: the python built-in and the follow-up call triggers."""

from __future__ import annotations

from harmony_gateway.harmony.encoding import PromptRenderer, get_encoding
from harmony_gateway.harmony.messages import (
    FunctionTool,
    Msg,
    PromptPrefix,
    SystemOptions,
    ToolNamespace,
    assistant_call,
    tool_result,
    user,
)
from harmony_gateway.sim.script import HarmonyScript

DOCS = ToolNamespace(
    "docs",
    "",
    (
        FunctionTool("search_docs", "", {"type": "object", "properties": {"query": {"type": "string"}}}),
        FunctionTool("lookup_user", "", {"type": "object", "properties": {"name": {"type": "string"}}}),
    ),
)


def reply(prefix: PromptPrefix, history: list[Msg]) -> str:
    encoding = get_encoding()
    ids = PromptRenderer(encoding).render_for_completion(prefix, history)
    return encoding.decode(HarmonyScript().reply(ids))


def test_python_builtin_is_called_with_code() -> None:
    prefix = PromptPrefix(SystemOptions(python_tool=True))
    out = reply(prefix, [user("run python for hello")])
    assert 'to=python code<|message|>print("hello")<|call|>' in out


def test_sequence_calls_the_next_named_tool_then_answers() -> None:
    prefix = PromptPrefix(SystemOptions(), namespaces=(DOCS,))
    ask = user("[[sequence]] search_docs then lookup_user for amy")
    first_call = assistant_call("docs.search_docs", '{"query":"amy"}')
    after_first = reply(prefix, [ask, first_call, tool_result("docs.search_docs", "found")])
    assert "to=docs.lookup_user" in after_first
    second_call = assistant_call("docs.lookup_user", '{"name":"amy"}')
    history = [ask, first_call, tool_result("docs.search_docs", "found"), second_call]
    final = reply(prefix, [*history, tool_result("docs.lookup_user", "admin")])
    assert "<|channel|>final" in final and "to=" not in final


def test_repeat_obeys_the_limit_message_and_stubborn_does_not() -> None:
    prefix = PromptPrefix(SystemOptions(), namespaces=(DOCS,))
    call = assistant_call("docs.search_docs", "{}")
    for trigger, limited, calls_again in (
        ("[[repeat]]", False, True),
        ("[[repeat]]", True, False),
        ("[[stubborn]]", True, True),
    ):
        output = "limit reached (max_tool_calls)" if limited else "found"
        out = reply(prefix, [user(f"{trigger} search_docs"), call, tool_result("docs.search_docs", output)])
        assert ("to=docs.search_docs" in out) is calls_again, (trigger, limited)


def test_bad_json_arguments() -> None:
    prefix = PromptPrefix(SystemOptions(), namespaces=(DOCS,))
    out = reply(prefix, [user("[[bad_json]] search_docs for x")])
    assert '<|message|>{"query":"x"<|call|>' in out
