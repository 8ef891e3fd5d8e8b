"""Coding agents in their default configurations (only the provider pointed at the gateway): Codex CLI
and Claude Code run a shell tool round trip on the simulated model, and the second prompt the engine
sees still holds the first turn's analysis (the Harmony rule: analysis is dropped only after a final)."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from harmony_gateway.harmony.encoding import get_encoding
from harmony_gateway.sim import RunningSim
from tests.conftest import MODEL
from tests.support.servers import RunningGateway

TOOLS_BIN = Path("/work/main/.tools/node_modules/.bin")


def _cli(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=str(TOOLS_BIN))


def prompts_since(sim: RunningSim, start: int) -> list[str]:
    decode = get_encoding().decode
    return [decode(r.input_ids) for r in sim.requests[start:]]


async def run_cli(*argv: str, cwd: Path, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    return text


def codex_home(tmp_path: Path, gateway: RunningGateway, *, settings: str = "") -> dict[str, str]:
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "gw"\n{settings}\n'
        f'[model_providers.gw]\nname = "harmony-gateway"\nbase_url = "{gateway.base_url}"\n'
        'wire_api = "responses"\nenv_key = "GW_KEY"\n'
    )
    return dict(os.environ, CODEX_HOME=str(home), GW_KEY="test")


@pytest.mark.skipif(_cli("codex") is None, reason="the Codex CLI is not installed (npm i -g @openai/codex)")
async def test_codex_default_config_plain_answer(gateway: RunningGateway, tmp_path: Path) -> None:
    env = codex_home(tmp_path, gateway)
    out = await run_cli(
        _cli("codex") or "codex", "exec", "--skip-git-repo-check", "Say hello", cwd=tmp_path, env=env
    )
    assert "This is a simulated answer." in out


@pytest.mark.skipif(_cli("codex") is None, reason="the Codex CLI is not installed (npm i -g @openai/codex)")
async def test_codex_default_config_shell_round_trip(
    gateway: RunningGateway, sim: RunningSim, tmp_path: Path
) -> None:
    env = codex_home(tmp_path, gateway)
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text("")
    start = len(sim.requests)
    out = await run_cli(
        _cli("codex") or "codex",
        "exec",
        "--skip-git-repo-check",
        "Use exec_command for ls [[required]]",
        cwd=work,
        env=env,
    )
    assert "marker.txt" in out.split("Use exec_command", 1)[-1]
    prompts = [p for p in prompts_since(sim, start) if "exec_command for ls" in p]
    assert len(prompts) >= 2
    first_analysis = "The user mentioned exec_command. I will call functions.exec_command."
    assert first_analysis not in prompts[0]
    assert first_analysis in prompts[1]  # the replayed reasoning item, rendered as analysis
    assert "marker.txt" in prompts[1]


@pytest.mark.skipif(_cli("codex") is None, reason="the Codex CLI is not installed (npm i -g @openai/codex)")
async def test_codex_compacts_its_context_through_the_gateway(
    gateway: RunningGateway, sim: RunningSim, tmp_path: Path
) -> None:
    """Codex's compaction with a provider of its own (its default flow for any provider but OpenAI's):
    once a turn's usage passes its limit it asks the model for a handoff summary with a normal
    Responses request, then carries on from that summary. Only the limit is lowered here, so a short
    turn reaches it; the flow is Codex's default."""
    env = codex_home(tmp_path, gateway, settings="model_auto_compact_token_limit = 1000\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text("")
    start = len(sim.requests)
    out = await run_cli(
        _cli("codex") or "codex",
        "exec",
        "--skip-git-repo-check",
        "Use exec_command for ls [[required]]",
        cwd=work,
        env=env,
    )
    assert "context compacted" in out
    prompts = prompts_since(sim, start)
    [asked] = [i for i, p in enumerate(prompts) if "CONTEXT CHECKPOINT" in p]
    # The summary request holds the turn so far: the call and its output.
    assert "marker.txt" in prompts[asked] and "exec_command" in prompts[asked]
    # Codex carries on from the summary the model wrote, handed back as a user message.
    after = prompts[asked + 1 :]
    assert after and "Summary of the conversation" in after[0]
    assert "This is a simulated answer." in out.split("context compacted", 1)[1]


@pytest.mark.skipif(
    _cli("claude") is None, reason="Claude Code is not installed (npm i -g @anthropic-ai/claude-code)"
)
async def test_claude_code_print_mode_bash_round_trip(
    gateway: RunningGateway, sim: RunningSim, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "marker.txt").write_text("")
    env = dict(
        os.environ,
        HOME=str(tmp_path),
        ANTHROPIC_BASE_URL=gateway.url,
        ANTHROPIC_API_KEY="test",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
    )
    start = len(sim.requests)
    out = await run_cli(
        _cli("claude") or "claude",
        "-p",
        "Use Bash for ls [[required]]",
        "--model",
        MODEL,
        "--allowedTools",
        "Bash",
        cwd=work,
        env=env,
    )
    assert "marker.txt" in out
    prompts = [p for p in prompts_since(sim, start) if "Use Bash for ls" in p]
    assert len(prompts) >= 2
    first_analysis = "The user mentioned Bash. I will call functions.Bash."
    assert first_analysis not in prompts[0]
    assert first_analysis in prompts[1]
    assert "marker.txt" in prompts[1]
