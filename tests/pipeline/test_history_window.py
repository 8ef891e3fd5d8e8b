"""`history_window`: the byte bound holds for the vocabulary, and the newest-first count keeps exactly
the longest suffix of the history that renders within the context."""

from __future__ import annotations

import asyncio
from unittest import mock

import quicktok
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_gateway.harmony.encoding import FIRST_SPECIAL_ID, PromptRenderer
from harmony_gateway.harmony.messages import Msg, PromptPrefix, SystemOptions, drop_old_analysis
from harmony_gateway.pipeline import offload
from harmony_gateway.surfaces.responses.history_window import (
    MAX_TOKEN_BYTES,
    history_byte_budget,
    newest_that_fit,
)

_renderer = PromptRenderer()
_prefix = PromptPrefix(SystemOptions(), "Be brief.")


def test_no_token_is_longer_than_the_bound() -> None:
    vocabulary = quicktok.get_encoding("o200k_base")
    longest = max(len(vocabulary.decode_single_token_bytes(i)) for i in range(FIRST_SPECIAL_ID))
    assert longest == MAX_TOKEN_BYTES


def test_the_budget_follows_the_context() -> None:
    assert history_byte_budget(131_072) == 131_072 * MAX_TOKEN_BYTES
    assert history_byte_budget(0) is None  # an unknown context gives no bound


messages = st.builds(
    Msg,
    role=st.sampled_from(["user", "assistant"]),
    text=st.text(alphabet="ab 1é\n", max_size=300),
    channel=st.sampled_from([None, "final", "analysis"]),
)


def rendered_length(history: list[Msg], turn: list[Msg]) -> int:
    return len(_renderer.render_for_completion(_prefix, drop_old_analysis([*history, *turn])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    history=st.lists(messages, max_size=12),
    turn=st.lists(messages, min_size=1, max_size=2),
    context=st.integers(min_value=1, max_value=1500),
    on_loop=st.booleans(),
    thread_batch=st.integers(min_value=1, max_value=5),
)
def test_keeps_the_longest_suffix_that_renders_within_the_context(
    history: list[Msg], turn: list[Msg], context: int, on_loop: bool, thread_batch: int
) -> None:
    with mock.patch.object(offload, "THREAD_BATCH", thread_batch):  # batches end anywhere in the history
        kept = asyncio.run(newest_that_fit(_renderer, _prefix, history, turn, context, on_loop=on_loop))
    suffix = history[len(history) - kept :]
    if rendered_length(suffix, turn) >= context:
        # Only the messages the drop rule removes anyway can be kept when nothing else fits.
        assert all(m.channel == "analysis" for m in suffix)
        return
    if kept < len(history):
        # One more message would not have fitted (or the prompt without history already does not).
        longer = history[len(history) - kept - 1 :]
        assert rendered_length(longer, turn) >= context
