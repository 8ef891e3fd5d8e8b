"""The `serve --demo` banner's examples, run as printed in a fresh shell: the gateway is started the way
`make demo` starts it, and each example block it prints (a `# ` comment line, then the command, up to a
blank line) runs under `env -i` with nothing but a minimal PATH and an empty HOME: no virtual environment
on PATH, nothing activated. PYTHONPATH names the source tree under test, which is what the editable
install resolves to anyway (in a worktree of the repository it is another folder).

With `--api-key`, the examples must carry the key (a request without it is a 401). The tool example must
make the simulated engine call the tool, and `render` must print the prompt of the shipped example
request (and, installed without the source tree, of a request read from standard input)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import harmony_gateway
from harmony_gateway.cli.demo import cli_command, demo_banner
from tests.support.processes import free_port

#: PATH in a fresh login shell: the system's folders, no virtual environment.
FRESH_PATH = "/usr/bin:/bin"
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not os.environ.get("CI") and not shutil.which("curl", path=FRESH_PATH),
        reason="curl is not installed (the demo's examples use it)",
    ),
]

SOURCE_TREE = Path(harmony_gateway.__file__).resolve().parents[1]
KEY = "sk-demo-key"


def fresh_env(home: Path) -> list[str]:
    """`env -i` and the variables of a fresh login: a minimal PATH and HOME, nothing else."""
    return ["env", "-i", f"PATH={FRESH_PATH}", f"HOME={home}", f"PYTHONPATH={SOURCE_TREE}"]


def example_blocks(banner: str) -> dict[str, str]:
    """The banner's examples by their comment line (without `# `)."""
    blocks = [block.strip("\n") for block in banner.split("\n\n")]
    return {block.split("\n", 1)[0][2:]: block for block in blocks if block.startswith("# ")}


async def run_in_fresh_shell(home: Path, script: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        *fresh_env(home),
        "bash",
        "-c",
        script,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, f"{script}\nexit {proc.returncode}\n{err.decode()}"
    return out.decode()


@contextlib.asynccontextmanager
async def demo_gateway(home: Path, *options: str) -> AsyncIterator[tuple[str, int]]:
    """`harmony-gateway serve --demo` in a fresh environment; yields its banner once it serves."""
    port = free_port()
    command = (
        f"{cli_command(sys.executable)} serve --demo --port {port} --storage memory:// --log-level warning"
    )
    proc = await asyncio.create_subprocess_exec(
        *fresh_env(home),
        "bash",
        "-c",
        f"exec {command} {' '.join(options)}",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not lines or lines[-1] != "Press Ctrl+C to stop.":
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, "the gateway stopped before its banner ended: " + "\n".join(lines)
            lines.append(line.decode().rstrip("\n"))
        async with httpx.AsyncClient(timeout=5) as client:
            for _ in range(600):  # the banner is printed as the server starts listening
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"http://127.0.0.1:{port}/readiness")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the demo gateway never became ready")
        yield "\n".join(lines).lstrip("\n"), port
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        await asyncio.wait_for(proc.wait(), 15)


async def check_examples(banner: str, home: Path) -> dict[str, str]:
    blocks = example_blocks(banner)
    assert len(blocks) == 4, banner
    outputs = {title: await run_in_fresh_shell(home, block) for title, block in blocks.items()}
    chat, tool, sdk, render = outputs.values()
    assert json.loads(chat)["choices"][0]["message"]["content"].startswith('You said: "What is 2+2?"')
    message = json.loads(tool)["choices"][0]["message"]
    assert json.loads(tool)["choices"][0]["finish_reason"] == "tool_calls", tool
    call = message["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"location": "Paris"}
    assert "answer:" in sdk and "This is a simulated answer." in sdk and "reasoning: The user wrote" in sdk
    assert "tokens for openai/gpt-oss-20b (chat)" in render and "<|start|>assistant" in render
    return outputs


async def test_the_demo_examples_run_as_printed_in_a_fresh_shell(tmp_path: Path) -> None:
    async with demo_gateway(tmp_path) as (banner, port):
        assert banner.startswith(f"Playground: http://127.0.0.1:{port}/")
        assert "authorization" not in banner
        assert "calls a tool only when the message names it" in banner
        outputs = await check_examples(banner, tmp_path)
        # The render example is the shipped request, which names its tool too.
        render_title = next(title for title in outputs if "Harmony prompt" in title)
        assert "examples/request.json" in example_blocks(banner)[render_title]
        assert "Call get_weather for Paris" in outputs[render_title]
        # Installed without its source tree, the banner renders a request from standard input instead.
        stdin_banner = demo_banner(host="127.0.0.1", port=port, sim_url="grpc://unused", example=None)
        (render,) = [b for t, b in example_blocks(stdin_banner).items() if "Harmony prompt" in t]
        assert " render -" in render
        output = await run_in_fresh_shell(tmp_path, render)
        assert "tokens for openai/gpt-oss-20b (chat)" in output


async def test_with_an_api_key_the_examples_carry_it(tmp_path: Path) -> None:
    async with demo_gateway(tmp_path, "--api-key", KEY) as (banner, port):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            refused = await http.post(
                "/v1/chat/completions",
                json={"model": "openai/gpt-oss-20b", "messages": [{"role": "user", "content": "Hi"}]},
            )
            assert refused.status_code == 401  # so the examples below succeed only with the key
        assert "and carries the gateway's API key" in banner
        await check_examples(banner, tmp_path)
