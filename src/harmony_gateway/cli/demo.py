"""The banner `serve --demo` prints: the playground's address, then commands that run as printed in any
shell, from any folder, with or without the virtual environment activated.

Each command names the interpreter and the `harmony-gateway` script of the environment the gateway runs
from by their full paths, carries the API key when the gateway has keys, and calls the gateway on an
address a client can reach (127.0.0.1 when it listens on every address). Each example is a block of
lines that starts with a `# ` comment line and ends at a blank line, so a test can run them one by one.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

#: The model the simulated engine serves.
DEMO_MODEL = "openai/gpt-oss-20b"
#: The saved request `render` reads in a source checkout (`examples/request.json`); None when the
#: package is installed without its source tree.
EXAMPLE_REQUEST: Path | None = Path(__file__).resolve().parents[3] / "examples" / "request.json"
#: The tool the tool-call example declares; the simulated engine calls a tool only when the user
#: message names it (sim/script.py, rule 2).
_WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string"}},
            "required": ["location"],
        },
    },
}


def client_address(host: str, port: int) -> str:
    """`http://HOST:PORT` a local client can reach the gateway listening on `host` at."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def cli_command(python: str) -> str:
    """How to run `harmony-gateway` with the interpreter `python`: the environment's script when it has
    one next to the interpreter, else `python -m harmony_gateway.cli`."""
    script = Path(python).parent / "harmony-gateway"
    if script.is_file():
        return shlex.quote(str(script))
    return f"{shlex.quote(python)} -m harmony_gateway.cli"


def demo_banner(
    *,
    host: str,
    port: int,
    sim_url: str,
    api_key: str | None = None,
    python: str = sys.executable,
    example: Path | None = EXAMPLE_REQUEST,
) -> str:
    """The banner's text. `api_key` is one of the gateway's keys, which the examples then send; `python`
    the interpreter whose environment runs the examples; `example` a saved request for `render` (else the
    render example reads its request from standard input)."""
    base = client_address(host, port)
    key_header = f" \\\n  -H {shlex.quote(f'authorization: Bearer {api_key}')}" if api_key else ""

    def curl(body: Mapping[str, object]) -> str:
        return (
            f"curl -s {base}/v1/chat/completions -H 'content-type: application/json'{key_header} \\\n"
            f"  -d {shlex.quote(json.dumps(body))}"
        )

    hello = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "What is 2+2?"}]}
    tool_call = {
        "model": DEMO_MODEL,
        "messages": [{"role": "user", "content": "Call get_weather for Paris"}],
        "tools": [_WEATHER_TOOL],
    }
    py = shlex.quote(python)
    sdk_note = ""
    if importlib.util.find_spec("openai") is None:
        sdk_note = f" (install it first: {py} -m pip install openai)"
    cli = cli_command(python)
    if example is not None and example.is_file():
        render = f"{cli} render {shlex.quote(str(example))}"
        render_note = f"the saved request {example.name}"
    else:
        saved = {"api": "chat", "request": hello}
        render = f"echo {shlex.quote(json.dumps(saved))} | {cli} render -"
        render_note = "a request read from standard input"
    blocks = [
        f"Playground: {base}/   (open it in a browser)",
        f"harmony-gateway demo: gateway {base}/v1 -> simulated gpt-oss engine {sim_url}\n"
        "Each example below runs as printed in any shell"
        + (" and carries the gateway's API key." if api_key else "."),
        f"# Chat Completions with curl\n{curl(hello)}",
        "# A tool call: the simulated engine calls a tool only when the message names it (get_weather "
        f"here)\n{curl(tool_call)}",
        f"# The official openai SDK{sdk_note}\n"
        f"{py} - <<'PY'\n"
        "from openai import OpenAI\n"
        f"client = OpenAI(base_url={json.dumps(base + '/v1')}, api_key={json.dumps(api_key or 'unused')})\n"
        f"r = client.chat.completions.create(model={json.dumps(DEMO_MODEL)}, "
        'messages=[{"role": "user", "content": "Hello!"}])\n'
        'print("reasoning:", r.choices[0].message.reasoning_content)\n'
        'print("answer:   ", r.choices[0].message.content)\n'
        "PY",
        f"# The exact Harmony prompt of {render_note}, rendered locally (no engine)\n{render}",
    ]
    if sys.prefix != sys.base_prefix and Path(python).parent == Path(sys.prefix) / "bin":
        activate = Path(sys.prefix) / "bin" / "activate"
        blocks.append(
            f"To use harmony-gateway and python by their names: source {shlex.quote(str(activate))}"
        )
    blocks.append("Press Ctrl+C to stop.")
    return "\n" + "\n\n".join(blocks) + "\n"
