"""The container image recipe (Dockerfile at the repository root), checked without a Docker daemon:
hadolint's rules, then what the image promises, each against the real gateway: two stages, an
unprivileged user, a health check that tells a serving gateway from a stopped one, the o200k vocabulary
written at build time where the gateway finds it without writing anything, and an entry point whose
options are `serve` options."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harmony_gateway.sim import SimConfig, start_sim_engine
from harmony_gateway.storage.registry import default_storage_url
from tests.deploy.kit import DOCKERFILE, ROOT, require, serve_parser
from tests.support.processes import free_port
from tests.support.servers import running_gateway, test_settings


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    out: list[Instruction] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        out.append(Instruction(keyword.upper(), " ".join(arguments.split())))
        pending = ""
    return out


def stages() -> list[list[Instruction]]:
    """The build stages, each from its FROM on."""
    out: list[list[Instruction]] = []
    for instruction in instructions(DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            out.append([])
        if out:
            out[-1].append(instruction)
    return out


def one(stage: list[Instruction], keyword: str) -> str:
    (found,) = [i.arguments for i in stage if i.keyword == keyword]
    return found


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for arguments in (i.arguments for i in stage if i.keyword == "ENV"):
        for pair in arguments.split():
            name, _, value = pair.partition("=")
            env[name] = value
    return env


def test_hadolint_finds_nothing() -> None:
    hadolint = require("hadolint")
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_is_built_in_one_stage_and_runs_from_another_unprivileged() -> None:
    build, runtime = stages()
    assert one(build, "FROM").endswith(" AS build")
    copied = [i.arguments for i in runtime if i.keyword == "COPY"]
    assert copied == ["--from=build /opt/harmony-gateway /opt/harmony-gateway"]  # nothing but the venv
    user = one(runtime, "USER")
    assert user.split(":")[0] not in ("root", "0")
    assert user == "10001:10001"  # the uid/gid deploy/kubernetes/deployment.yaml runs as
    # What the build copies exists, and .dockerignore lets it through.
    allowed = {
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"
    }
    for instruction in build:
        if instruction.keyword == "COPY":
            *sources, _ = instruction.arguments.split()
            for source in sources:
                assert (ROOT / source).exists() and source.rstrip("/") in allowed, source


def test_the_entry_point_is_serve_with_options_it_takes() -> None:
    _, runtime = stages()
    assert json.loads(one(runtime, "ENTRYPOINT")) == ["harmony-gateway", "serve"]
    args = serve_parser().parse_args(json.loads(one(runtime, "CMD")))
    assert args.host == "0.0.0.0" and args.log_json
    assert one(runtime, "EXPOSE") == str(args.port)


def test_the_vocabulary_written_at_build_time_is_the_one_the_gateway_loads(tmp_path: Path) -> None:
    """The build stage's `harmony-gateway vocab --out DIR` and the runtime's HARMONY_GATEWAY_CACHE_DIR
    agree: started with that folder, the gateway checks the file and loads it, writing nothing there (the
    root file system may be read-only)."""
    build, runtime = stages()
    (run,) = [i.arguments for i in build if i.keyword == "RUN" and "harmony-gateway vocab" in i.arguments]
    out = run.split("harmony-gateway vocab --out ", 1)[1].split()[0]
    cache = env_of(runtime)["HARMONY_GATEWAY_CACHE_DIR"]
    assert out == f"{cache}/vocab"
    local_cache = tmp_path / cache.lstrip("/")
    env = {k: v for k, v in os.environ.items() if k != "TIKTOKEN_ENCODINGS_BASE"}
    subprocess.run(
        [sys.executable, "-m", "harmony_gateway.cli", "vocab", "--out", str(local_cache / "vocab")],
        check=True,
        env=env,
        timeout=120,
        capture_output=True,
    )
    written = {p: p.stat().st_mtime_ns for p in local_cache.rglob("*")}
    assert [p.name for p in written] == ["vocab", "o200k_base.tiktoken"]
    load = "from harmony_gateway.app import load_vocabularies; load_vocabularies(); import os; print(os.environ['TIKTOKEN_ENCODINGS_BASE'])"
    loaded = subprocess.run(
        [sys.executable, "-c", load],
        check=True,
        env=env | {"HARMONY_GATEWAY_CACHE_DIR": str(local_cache)},
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert loaded.stdout.strip() == str(local_cache / "vocab")
    assert {p: p.stat().st_mtime_ns for p in local_cache.rglob("*")} == written


def test_the_default_storage_lives_on_the_image_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    _, runtime = stages()
    data_home = env_of(runtime)["XDG_DATA_HOME"]
    assert json.loads(one(runtime, "VOLUME")) == [data_home]
    monkeypatch.setenv("XDG_DATA_HOME", data_home)
    assert default_storage_url().startswith(f"sqlite:///{data_home}/")


async def test_the_health_check_tells_a_serving_gateway_from_a_stopped_one() -> None:
    _, runtime = stages()
    healthcheck = one(runtime, "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert "--interval=" in options and "--timeout=" in options
    argv = json.loads(command)
    assert argv[0] == "python" and "http://127.0.0.1:8000/health" in argv[-1]

    async def check(port: int) -> int:
        # `python` in the image is the venv's: the interpreter running these tests here.
        script = argv[-1].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *argv[1:-1], script, stderr=asyncio.subprocess.DEVNULL
        )
        return await asyncio.wait_for(proc.wait(), 30)

    async with (
        await start_sim_engine(SimConfig(port=0)) as engine,
        running_gateway(test_settings(worker_urls=(engine.url,))) as gateway,
    ):
        assert await check(int(gateway.url.rsplit(":", 1)[1])) == 0
    assert await check(free_port()) != 0
