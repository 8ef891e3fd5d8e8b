"""The simulated engine: a real grpc.aio SGLang or vLLM engine server driven by a deterministic script.

Tests, the demo and benchmarks use it in place of a GPU engine:

    async with await start_sim_engine(SimConfig(engine="sglang")) as sim:
        ...  # point a gateway at sim.url; inspect sim.requests / sim.aborted; sim.fail_next(...)

See docs/simulated-engine.md for the answer rules, triggers and options.
"""

from .script import (
    TRIGGERS,
    HarmonyScript,
    PromptSummary,
    ToolParam,
    ToolSpec,
    echo_reply,
    parse_tool_namespaces,
)
from .server import ReceivedRequest, RunningSim, SimConfig, serve_forever, start_sim_engine

__all__ = [
    "TRIGGERS",
    "HarmonyScript",
    "PromptSummary",
    "ReceivedRequest",
    "RunningSim",
    "SimConfig",
    "ToolParam",
    "ToolSpec",
    "echo_reply",
    "parse_tool_namespaces",
    "serve_forever",
    "start_sim_engine",
]
