"""Chooses SGLang's per-request `stream_interval` (tokens per streamed engine message) for `--stream-interval
auto`, the default.

Each gRPC message costs the gateway far more CPU than a token does, so fewer, larger messages are the
cheapest lever on streaming throughput. The catch is what a client sees: an engine honouring an interval N
sends the first token at once and then one message per N tokens, so at a realistic decode rate (50 tokens/s,
20 ms a token) any N > 1 makes the stream visibly coarser. Two signals decide, and the larger answer wins:

- **Decode rate.** Per worker, an average of the seconds per token seen between consecutive messages of a
  stream (the interval cancels out: N tokens arrive N token-times apart). N is as many tokens as fit in
  `VISIBLE_GAP_SECONDS`, so a fast engine gets big messages and a 50 tokens/s one gets one per token.
- **Gateway saturation.** When the gateway is the bottleneck, the rate it sees is its own backlog, not the
  engine's, and per-token messages keep it there. The event loop's lag (how late a timer fires) measures
  that directly: the load level doubles while the loop lags and halves once it keeps time again.

Until a worker has been measured it streams one token per message.
"""

from __future__ import annotations

import asyncio
import time

from ..routing.workers import Worker

#: The largest gap between two streamed pieces that a reader does not notice (below a 60 Hz frame).
VISIBLE_GAP_SECONDS = 0.010
MAX_INTERVAL = 16
#: Weight of one observation in a worker's seconds-per-token average.
RATE_WEIGHT = 0.05
#: Loop lag above which the gateway counts as saturated, and below which it has recovered.
SATURATED_LAG_SECONDS = 0.005
RECOVERED_LAG_SECONDS = 0.001
PROBE_PERIOD_SECONDS = 0.1
#: Consecutive probes on one side of a threshold before the load level moves.
PROBES_PER_STEP = 5


class StreamIntervalTuner:
    """One per gateway process. `interval_for` is called per dispatched stream, `observe` per engine
    message; `run` probes the event loop's lag until cancelled (the lifespan task group owns it)."""

    def __init__(self) -> None:
        self.load_interval = 1
        self._lagging = 0
        self._keeping_time = 0

    def interval_for(self, worker: Worker) -> int:
        by_rate = 1
        seconds = worker.token_seconds
        if seconds is not None and seconds > 0.0:
            # The tolerance keeps an average that converged to 1 ms from rounding 10 tokens down to 9.
            by_rate = min(MAX_INTERVAL, max(1, int(VISIBLE_GAP_SECONDS / seconds * 1.000001)))
        return max(by_rate, self.load_interval)

    @staticmethod
    def observe(worker: Worker, elapsed: float, tokens: int) -> None:
        """Fold one message's timing (seconds since the stream's previous message, tokens it carried)
        into the worker's seconds-per-token average."""
        if tokens <= 0:
            return
        sample = elapsed / tokens
        seconds = worker.token_seconds
        worker.token_seconds = sample if seconds is None else seconds + RATE_WEIGHT * (sample - seconds)

    def note_lag(self, lag: float) -> None:
        if lag > SATURATED_LAG_SECONDS:
            self._keeping_time = 0
            self._lagging += 1
            if self._lagging >= PROBES_PER_STEP:
                self._lagging = 0
                self.load_interval = min(MAX_INTERVAL, self.load_interval * 2)
        elif lag < RECOVERED_LAG_SECONDS:
            self._lagging = 0
            self._keeping_time += 1
            if self._keeping_time >= PROBES_PER_STEP * 3:
                self._keeping_time = 0
                self.load_interval = max(1, self.load_interval // 2)

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(PROBE_PERIOD_SECONDS)
            self.note_lag(time.perf_counter() - start - PROBE_PERIOD_SECONDS)


__all__ = ["MAX_INTERVAL", "VISIBLE_GAP_SECONDS", "StreamIntervalTuner"]
