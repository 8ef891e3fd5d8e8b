"""An agentic trace to replay against a fleet: sessions of growing contexts over shared tool prompts.

Each session is an agent loop: a shared system/tool prompt (one of a few families, 3–6k tokens), then
turns that each add a tool result or user message (so the context grows to ~30k tokens) and the model's
answer from the turn before. Between turns the agent "thinks" (an exponential pause). Sessions start
spread uniformly over `ramp_seconds`, so some end while others begin, as on a fleet that is never idle.

A fraction of sessions (`hop_fraction`) hop between two gateway replicas on every turn, as sessions
behind a load balancer without affinity do; the others stay on their home replica. The trace is the same
whatever the number of replicas it is replayed on (`Session.replica`): with one, every turn goes to it.
Everything is derived from one seed, so every policy replays the same trace.

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
    #: Seconds after the replay's start when the first turn is sent.
    start: float
    #: The replica this session's pinned turns go to (among two), and whether it alternates instead.
    home: int
    hops: bool

    def replica(self, turn: int, replicas: int) -> int:
        """The gateway replica (0-based) turn `turn` is sent to when there are `replicas` of them."""
        if replicas <= 1:
            return 0
        return (self.home + turn) % replicas if self.hops else self.home % replicas


@dataclass(frozen=True, slots=True)
class TraceConfig:
    sessions: int = 48
    turns: int = 12
    families: int = 4
    system_tokens: tuple[int, int] = (3000, 6000)
    final_context_tokens: int = 30_000
    think_seconds: float = 1.5
    #: Sessions start spread over this many seconds.
    ramp_seconds: float = 30.0
    hop_fraction: float = 0.25
    seed: int = 7


@dataclass
class Trace:
    config: TraceConfig
    sessions: list[Session] = field(default_factory=list)

    def turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def working_set_tokens(self, answer_tokens: int = 0, overhead_tokens: int = 0) -> int:
        """An estimate of the tokens caches would hold to miss nothing: every family's system prompt
        once, plus every session's own context at its largest (its messages, plus `answer_tokens` per
        answer kept and `overhead_tokens` of framing per message). The benchmark reports the exact figure
        from the prompts the engines received."""
        families = {s.family: len(s.system.split()) for s in self.sessions}
        own = sum(
            sum(len(t.message.split()) + overhead_tokens for t in s.turns)
            + (len(s.turns) - 1) * (answer_tokens + overhead_tokens)
            for s in self.sessions
        )
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
        hops = rng.random() < config.hop_fraction
        start = rng.uniform(0, config.ramp_seconds)
        trace.sessions.append(Session(sid, family, systems[family], turns, start, sid % 2, hops))
    return trace
