"""The deterministic script: answer rules, triggers, tool parsing and padding, without a server."""

from __future__ import annotations

import json

import pytest
import quicktok
from openai_harmony import (
    Conversation,
    DeveloperContent,
    HarmonyError,
    Message,
    Role,
    SystemContent,
    ToolDescription,
    ToolNamespaceConfig,
)

from harmony_gateway.harmony.encoding import CALL, END, MESSAGE, RETURN, START, get_encoding
from harmony_gateway.sim import HarmonyScript, echo_reply, parse_tool_namespaces
from harmony_gateway.sim.script import argument_word, example_value

from ._helpers import WEATHER_TOOL, developer_with_tools, parse, render, tool_result, user

SCRIPT = HarmonyScript()


def test_plain_answer_is_analysis_then_final_echoing_the_user() -> None:
    out = SCRIPT.reply(render(user("What is the capital of France?")))
    messages = parse(out)
    assert [m.channel for m in messages] == ["analysis", "final"]
    assert messages[0].content[0].text == "The user wrote 6 words. I will answer briefly."
    assert (
        messages[1].content[0].text
        == 'You said: "What is the capital of France?". This is a simulated answer.'
    )
    assert out[-1] == RETURN


def test_reply_is_deterministic_and_choices_differ() -> None:
    prompt = render(user("hello"))
    assert HarmonyScript().reply(prompt) == SCRIPT.reply(prompt)
    second = parse(SCRIPT.reply(prompt, choice=1))[-1].content[0].text
    assert second.endswith("(choice 1)")


def test_tool_named_in_user_message_is_called_with_schema_arguments() -> None:
    prompt = render(developer_with_tools(WEATHER_TOOL), user("Use get_weather for Paris please"))
    out = SCRIPT.reply(prompt)
    assert out[-1] == CALL
    call = parse(out)[-1]
    assert call.channel == "commentary"
    assert call.recipient == "functions.get_weather"
    assert call.content_type == "<|constrain|>json"
    assert json.loads(call.content[0].text) == {"location": "Paris", "unit": "c", "days": 1}


def test_first_mentioned_tool_wins() -> None:
    other = ToolDescription.new("get_time", "Time")
    prompt = render(developer_with_tools(WEATHER_TOOL, other), user("get_time then get_weather"))
    assert parse(SCRIPT.reply(prompt))[-1].recipient == "functions.get_time"


def test_tool_result_is_quoted_in_the_final_answer() -> None:
    prompt = render(
        developer_with_tools(WEATHER_TOOL),
        user("weather in Paris via get_weather"),
        Message.from_role_and_content(Role.ASSISTANT, '{"location":"Paris"}')
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        tool_result("functions.get_weather", '{"temp": 21, "sky": "clear"}' + "x" * 500),
    )
    messages = parse(SCRIPT.reply(prompt))
    assert [m.channel for m in messages] == ["analysis", "final"]
    final = messages[-1].content[0].text
    assert final.startswith('The tool functions.get_weather returned: "{"temp": 21, "sky": "clear"}xxx')
    assert len(final) < 300


def test_namespaces_and_builtins_are_parsed_from_rendered_text() -> None:
    developer = (
        DeveloperContent.new()
        .with_function_tools(
            [
                WEATHER_TOOL,
                ToolDescription.new("ping", "No args"),
                ToolDescription.new(
                    "pick",
                    "Union",
                    parameters={
                        "type": "object",
                        "properties": {
                            "y": {"oneOf": [{"type": "string"}, {"type": "number"}]},
                            "flag": {"type": "boolean"},
                            "tags": {"type": "array", "items": {"type": "string"}},
                            "opts": {"type": "object", "properties": {"a": {"type": "number"}}},
                            "after": {"type": "string"},
                        },
                    },
                ),
            ]
        )
        .with_tools(
            ToolNamespaceConfig(
                name="docs",
                description="Docs server",
                tools=[ToolDescription.new("search_docs", "Search", parameters={"type": "object"})],
            )
        )
    )
    text = get_encoding().decode(
        get_encoding().render(Message.from_role_and_content(Role.DEVELOPER, developer))
    )
    tools = {t.recipient: t for t in parse_tool_namespaces(text)}
    assert set(tools) == {"functions.get_weather", "functions.ping", "functions.pick", "docs.search_docs"}
    assert tools["functions.ping"].params == ()
    weather = tools["functions.get_weather"].params
    assert [(p.name, p.type, p.required) for p in weather] == [
        ("location", "string", True),
        ("unit", '"c" | "f"', False),
        ("days", "number", False),
    ]
    pick = {p.name: example_value(p.type, "w") for p in tools["functions.pick"].params}
    assert pick == {"y": "w", "flag": True, "tags": [], "opts": {}, "after": "w"}

    system = Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_browser_tool())
    builtins = parse_tool_namespaces(get_encoding().decode(get_encoding().render(system)), builtin=True)
    assert {t.recipient for t in builtins} == {"browser.search", "browser.open", "browser.find"}


def test_builtin_tools_are_called_on_the_analysis_channel() -> None:
    ids = get_encoding().render_conversation_for_completion(
        Conversation.from_messages(
            [
                Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_browser_tool()),
                user("search for cats"),
            ]
        ),
        Role.ASSISTANT,
    )
    call = parse(SCRIPT.reply(ids))[-1]
    assert (call.channel, call.recipient) == ("analysis", "browser.search")
    assert json.loads(call.content[0].text)["query"] == "cats"


@pytest.mark.parametrize(
    ("text", "word"),
    [("weather in Paris", "Paris"), ("in the Alps", "Alps"), ("for x-ray, now", "x-ray"), ("nothing", "sim")],
)
def test_argument_word(text: str, word: str) -> None:
    assert argument_word(text) == word


def test_long_trigger_makes_a_long_analysis() -> None:
    out = SCRIPT.reply(render(user("think hard [[long]]")))
    analysis_end = out.index(END)
    assert analysis_end > 400
    assert [m.channel for m in parse(out)] == ["analysis", "final"]


def test_preamble_trigger_adds_a_recipientless_commentary() -> None:
    messages = parse(SCRIPT.reply(render(user("go [[preamble]]"))))
    assert [(m.channel, m.recipient) for m in messages] == [
        ("analysis", None),
        ("commentary", None),
        ("final", None),
    ]


def test_unicode_trigger_splits_utf8_across_tokens() -> None:
    out = SCRIPT.reply(render(user("hi [[unicode]]")))
    assert "🌍" in parse(out)[-1].content[0].text
    # Some token on its own is not valid UTF-8: the gateway must buffer bytes across tokens.
    base = quicktok.get_encoding("o200k_base")
    pieces = [base.decode_single_token_bytes(t) for t in out if t < 199998]
    broken = 0
    for piece in pieces:
        try:
            piece.decode("utf-8")
        except UnicodeDecodeError:
            broken += 1
    assert broken > 0


def test_trailing_trigger_closes_the_final_with_end_then_return() -> None:
    out = SCRIPT.reply(render(user("hi [[trailing]]")))
    assert out[-2:] == [END, RETURN]
    with pytest.raises(HarmonyError):
        parse(out)  # vllm#50690: openai-harmony rejects the trailing <|return|>


def test_refusal_trigger_omits_the_message_token_of_the_final() -> None:
    out = SCRIPT.reply(render(user("bad [[refusal]]")))
    final_header = out[out.index(END) + 1 :]
    assert final_header[0] == START
    assert MESSAGE not in final_header
    assert "I'm sorry" in get_encoding().decode(final_header)
    assert [m.channel for m in parse(out)] == ["analysis"]  # the non-strict parser drops the header


def test_junk_trigger_is_not_harmony() -> None:
    out = SCRIPT.reply(render(user("[[junk]]")))
    assert (
        get_encoding().decode(out).startswith("<|message|><|message|>this is not harmony<|start|><|start|>")
    )
    with pytest.raises(HarmonyError):
        parse(out)


def test_two_calls_trigger_emits_two_call_messages() -> None:
    other = ToolDescription.new("get_time", "Time")
    prompt = render(developer_with_tools(WEATHER_TOOL, other), user("get_weather and get_time [[two_calls]]"))
    out = SCRIPT.reply(prompt)
    calls = [m for m in parse(out) if m.recipient]
    assert [c.recipient for c in calls] == ["functions.get_weather", "functions.get_time"]
    assert out.count(CALL) == 1 and out[-1] == CALL
    single = render(developer_with_tools(WEATHER_TOOL), user("get_weather [[two_calls]]"))
    assert [m.recipient for m in parse(SCRIPT.reply(single)) if m.recipient] == ["functions.get_weather"] * 2


@pytest.mark.parametrize("target", [20, 64, 300])
def test_output_tokens_pads_or_trims_to_the_exact_length(target: int) -> None:
    prompt = render(user("Tell me something about the sea and the sky, please."))
    out = HarmonyScript(output_tokens=target).reply(prompt)
    assert len(out) == target
    assert [m.channel for m in parse(out)] == ["analysis", "final"]


def test_junk_prompts_get_a_plain_answer() -> None:
    for prompt in ([], [1, 2, 3], [START, START, MESSAGE], [10**9, START, 5]):
        out = SCRIPT.reply(prompt)
        assert [m.channel for m in parse(out)] == ["analysis", "final"]


def test_echo_reply_for_non_harmony_models() -> None:
    assert echo_reply([5, 2, 7, 9], eos_token_id=2) == [9, 7, 5, 2]
    assert len(echo_reply(list(range(100)), eos_token_id=2)) == 33


def test_prompt_ending_inside_an_open_final_is_continued_with_answer_text_only() -> None:
    prompt = render(user("Tell me more [[long]]"))
    prompt += get_encoding().encode(
        "<|channel|>analysis<|message|>Let me think<|end|><|start|>assistant<|channel|>final<|message|>",
        allowed_special="all",
    )
    out = SCRIPT.reply(prompt)
    assert out[-1] == RETURN
    assert get_encoding().decode(out[:-1]) == 'You said: "Tell me more". This is a simulated answer.'
