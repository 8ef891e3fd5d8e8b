"""`harmony-gateway render FILE` on a saved request: offline it prints openai-harmony's rendering of the
conversation; with --gateway it prints what the running gateway's /v1/harmony/render answers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from openai_harmony import (
    Conversation,
    DeveloperContent,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
)

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.support.servers import TEST_DATE, RunningGateway

SAVED = Path(__file__).parent / "data" / "render_request.json"


def expected_ids() -> list[int]:
    request = json.loads(SAVED.read_text())["request"]
    tool = request["tools"][0]["function"]
    system = SystemContent.new().with_reasoning_effort(ReasoningEffort.HIGH)
    developer = (
        DeveloperContent.new()
        .with_instructions("Answer in one word.")
        .with_function_tools([ToolDescription.new(tool["name"], tool["description"], tool["parameters"])])
    )
    conversation = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(TEST_DATE)),
            Message.from_role_and_content(Role.DEVELOPER, developer),
            Message.from_role_and_content(Role.USER, "What is the capital of France?"),
        ]
    )
    return get_encoding().render_conversation_for_completion(conversation, Role.ASSISTANT)


async def render(*args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harmony_gateway.cli",
        "render",
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_offline_render_of_a_saved_request_is_openai_harmonys() -> None:
    code, out, err = await render(str(SAVED), "--json", "--conversation-start-date", TEST_DATE)
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == expected_ids()
    assert result["prompt_text"] == get_encoding().decode(expected_ids())
    assert [m["role"] for m in result["messages"]] == ["system", "developer", "user", "assistant"]
    assert result["routing"]["worker"] is None

    code, text, err = await render(str(SAVED), "--conversation-start-date", TEST_DATE)
    assert code == 0, err
    assert text.startswith("<|start|>system<|message|>")
    assert "<|start|>user<|message|>What is the capital of France?<|end|><|start|>assistant" in text
    assert f"{len(expected_ids())} tokens for openai/gpt-oss-20b (chat)" in text
    assert f"token ids: {expected_ids()}" in text


async def test_render_through_a_running_gateway(gateway: RunningGateway, sim: RunningSim) -> None:
    bare = json.dumps(json.loads(SAVED.read_text())["request"]).encode()
    code, out, err = await render("-", "--api", "chat", "--gateway", gateway.url, "--json", stdin=bare)
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == expected_ids()
    assert "worker" not in result["routing"] and sim.url not in out  # the fleet is for admins


async def test_unreadable_files_and_bad_requests_fail_in_one_line(tmp_path: Path) -> None:
    code, _, err = await render(str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in err and err.strip().count("\n") == 0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"api": "chat", "request": {"model": "m", "messages": []}}))
    code, _, err = await render(str(bad))
    assert code == 1 and err.startswith("harmony-gateway render: ") and err.strip().count("\n") == 0
