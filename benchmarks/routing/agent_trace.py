"""An agentic trace to replay against a fleet: sessions of growing contexts over shared tool prompts.

Each session is an agent loop: a shared system/tool prompt (one of a few families, 3–6k tokens), then
turns that each add a tool result or user message (so the context grows to ~30k tokens) and the model's
answer from the turn before. Between turns the agent "thinks" (an exponential pause). A fraction of
sessions hop between two gateway replicas on every turn, as sessions behind a load balancer without
affinity do. Everything is derived from one seed, so every policy replays the same trace.

Text is built from words that are one o200k token each, so a passage of N words is about N tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# Common words that o200k encodes as one token each with their leading space.
_WORDS = (
    "the of and to in is that for it as with was on be by at this are from or an have not but they "
    "which one you were all we her she there can their has more if will when what about would up out "
    "so them some into other than then time its only new these two may first any like now also over "
    "after use could work well way even because through good each such just where most make many "
    "before those long being here should get world both between under last never while same another "
    "know year must might great back still since life without high set against each during every"
).split()


def passage(rng: random.Random, words: int) -> str:
    """About `words` tokens of text."""
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass(frozen=True, slots=True)
class Turn:
    #: The message this turn adds before asking the model (a tool result or a user request).
    message: str
    #: Seconds the agent waits after the previous answer before sending this turn.
    think: float


@dataclass(frozen=True, slots=True)
class Session:
    id: int
    family: int
    system: str
    turns: tuple[Turn, ...]
    #: Replica index per turn (0 or 1): pinned sessions keep one, hopping sessions alternate.
    replicas: tuple[int, ...]
    start: float


@dataclass(frozen=True, slots=True)
class TraceConfig:
    sessions: int = 48
    turns: int = 12
    families: int = 4
    system_tokens: tuple[int, int] = (3000, 6000)
    final_context_tokens: int = 30_000
    think_seconds: float = 1.0
    #: Sessions start spread over this many seconds.
    ramp_seconds: float = 8.0
    hop_fraction: float = 0.25
    replicas: int = 1
    seed: int = 7


@dataclass
class Trace:
    config: TraceConfig
    sessions: list[Session] = field(default_factory=list)

    def working_set_tokens(self) -> int:
        """Tokens an oracle with unbounded caches would have to hold: every family's system prompt once,
        plus every session's own context at its largest."""
        families = {s.family: len(s.system.split()) for s in self.sessions}
        own = sum(sum(len(t.message.split()) for t in s.turns) for s in self.sessions)
        return sum(families.values()) + own


def build_trace(config: TraceConfig) -> Trace:
    rng = random.Random(config.seed)
    systems = [
        "You are a coding agent. Tools and their manuals follow.\n"
        + passage(rng, rng.randint(*config.system_tokens))
        for _ in range(config.families)
    ]
    trace = Trace(config)
    for sid in range(config.sessions):
        family = sid % config.families
        system_tokens = len(systems[family].split())
        per_turn = max(64, (config.final_context_tokens - system_tokens) // config.turns)
        turns = tuple(
            Turn(
                message=f"[session {sid} turn {t}] "
                + passage(rng, rng.randint(per_turn // 2, per_turn * 3 // 2)),
                think=0.0 if t == 0 else rng.expovariate(1.0 / config.think_seconds),
            )
            for t in range(config.turns)
        )
        hops = config.replicas > 1 and rng.random() < config.hop_fraction
        home = sid % max(1, config.replicas)
        replicas = tuple((home + t) % 2 if hops else home for t in range(config.turns))
        trace.sessions.append(
            Session(sid, family, systems[family], turns, replicas, rng.uniform(0, config.ramp_seconds))
        )
    return trace
