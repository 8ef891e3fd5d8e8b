"""The simulated engine: a real grpc.aio engine server (SGLang, vLLM, MLX, TRT-LLM or TokenSpeed wire)
driven by a deterministic script, and a cluster twin for routing (KV cache, scheduler, KV events).

Tests, the demo and benchmarks use it in place of a GPU engine:

    async with await start_sim_engine(SimConfig(engine="sglang")) as sim:
        ...  # point a gateway at sim.url; inspect sim.requests / sim.aborted; sim.fail_next(...)
        sim.announce_prefix(ids); sim.cache_state(); sim.load(); sim.wedge()

See docs/simulated-engine.md for the answer rules, triggers, options and the twin's model.
"""

from .scheduler import LoadFigures
from .script import (
    TRIGGERS,
    HarmonyScript,
    PromptSummary,
    ToolParam,
    ToolSpec,
    echo_reply,
    parse_tool_namespaces,
)
from .server import CacheState, ReceivedRequest, RunningSim, SimConfig, serve_forever, start_sim_engine

__all__ = [
    "TRIGGERS",
    "CacheState",
    "HarmonyScript",
    "LoadFigures",
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
