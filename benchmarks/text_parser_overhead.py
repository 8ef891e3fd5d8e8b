"""Overhead of the text-level Harmony parser over passing the same chunks straight through.

Feeds a gpt-oss-like stream (about 20k tokens of analysis, a preamble, a tool call and a final answer,
as Harmony text) in ~4-character chunks through `HarmonyTextParser`, and the same chunks through a
loop that only wraps each chunk in a `ContentDelta` (what a gateway does without a parser). Prints
both times, the ratio, the parser's cost per chunk and that cost as a share of the cheapest per-chunk
cost measured for a Python gateway (REFERENCE §7.5a); the target is under 3 %. Run: `.venv/bin/python benchmarks/text_parser_overhead.py`.
"""

from __future__ import annotations

import random
import time

from harmony_gateway.harmony.text_events import ContentDelta, TextEvent
from harmony_gateway.harmony.text_parser import HarmonyTextParser

TOKENS = 20_000
CHARS_PER_CHUNK = 4
REPEATS = 5
#: CPU a Python gateway spends per streamed chunk at best (grpc.aio under uvloop, 16 streams; REFERENCE §7.5a).
GATEWAY_US_PER_CHUNK = 63.0

WORDS = (
    "the user asks about weather in Paris we need to call the tool then answer concisely "
    "let us check units celsius maybe also give a short summary of the forecast for tomorrow "
    "x < y and a | b are fine in text but <|end|> is not"
).split()


def build_stream(rng: random.Random) -> str:
    def prose(tokens: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(tokens)).replace("<|end|>", "<end>")

    analysis_tokens = TOKENS * 6 // 10
    final_tokens = TOKENS - analysis_tokens - 200
    return (
        "<|channel|>analysis<|message|>" + prose(analysis_tokens) + "<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>" + prose(60) + "<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "Paris", "unit": "celsius"}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>" + prose(final_tokens) + "<|return|>"
    )


def chunk(text: str, rng: random.Random) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = max(1, CHARS_PER_CHUNK + rng.randint(-2, 2))
        chunks.append(text[i : i + n])
        i += n
    return chunks


def run_passthrough(chunks: list[str]) -> int:
    events: list[TextEvent] = []
    # One call per chunk, as a gateway's stream loop does; a comprehension would flatter the baseline.
    for c in chunks:
        events.append(ContentDelta(c))  # noqa: PERF401
    return len(events)


def run_parser(chunks: list[str]) -> int:
    parser = HarmonyTextParser()
    n = 0
    for c in chunks:
        n += len(parser.feed(c))
    return n + len(parser.finish())


def best_of(fn, chunks: list[str]) -> float:
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn(chunks)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    rng = random.Random(0)
    text = build_stream(rng)
    chunks = chunk(text, rng)
    base = best_of(run_passthrough, chunks)
    parsed = best_of(run_parser, chunks)
    per_chunk_us = (parsed - base) / len(chunks) * 1e6
    print(f"stream: {len(text)} chars in {len(chunks)} chunks")
    print(f"pass-through loop: {base * 1e3:8.2f} ms")
    print(f"HarmonyTextParser: {parsed * 1e3:8.2f} ms")
    print(f"ratio:             {parsed / base:8.2f}x")
    print(f"parser cost:       {per_chunk_us:8.3f} µs per chunk above pass-through")
    print(
        f"in a gateway:      {per_chunk_us / GATEWAY_US_PER_CHUNK * 100:8.2f} % of its "
        f"~{GATEWAY_US_PER_CHUNK:.0f} µs per streamed chunk"
    )


if __name__ == "__main__":
    main()
