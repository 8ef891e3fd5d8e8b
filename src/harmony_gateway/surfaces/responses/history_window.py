"""How much stored history (a conversation's items, a `previous_response_id` chain) a Responses turn
loads and renders: no more than the model's context can show, newest first.

Two bounds, in this order. Before anything is read, a byte budget: a context of C tokens shows at most
C * MAX_TOKEN_BYTES bytes of text (no token of the vocabulary is longer), so stored items past that
many bytes, counted newest first, are never read. The budget errs on the side of reading too much:
an item's stored JSON is its text plus keys, ids and escapes, and real text averages about four bytes
a token, so the budget leaves some thirty times the visible text for that overhead. Only items made
mostly of fields the model never sees could be left out while visible, and only the client that
stored them controls that.
Then, over what was read, the exact count: messages are rendered one by one, newest first, exactly as
`PromptRenderer.render_for_completion` renders them, stopping at the first that does not fit; older ones
are never tokenized. `truncation: "auto"` keeps the ones that fit (OpenAI drops items from the start of
the conversation); `"disabled"` answers 400 `context_length_exceeded` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from ...errors import InvalidRequest
from ...harmony.encoding import PromptRenderer, assistant_header
from ...harmony.messages import Msg, PromptPrefix, drop_old_analysis
from ...pipeline.offload import batches, map_off_loop

#: Bytes of the longest token in o200k_harmony's vocabulary (a run of 128 spaces); checked against the
#: vocabulary by tests/pipeline/test_history_window.py.
MAX_TOKEN_BYTES = 128

TRUNCATION_MODES = ("auto", "disabled")


def history_byte_budget(context_tokens: int) -> int | None:
    """Stored bytes of history worth reading for a model with this context (None: unknown context,
    nothing to derive a bound from; the conversation limits still bound the read)."""
    return context_tokens * MAX_TOKEN_BYTES if context_tokens > 0 else None


def truncates(truncation: str | None) -> bool:
    """True for `truncation: "auto"`; raises InvalidRequest for a value OpenAI does not define."""
    if truncation is not None and truncation not in TRUNCATION_MODES:
        raise InvalidRequest("truncation must be 'auto' or 'disabled'", param="truncation")
    return truncation == "auto"


def history_too_long(context_tokens: int) -> InvalidRequest:
    return InvalidRequest(
        f"the stored history and this input do not fit the model's context of {context_tokens} tokens; "
        "send truncation: 'auto' to drop the oldest items, or start a new conversation",
        param="input",
        code="context_length_exceeded",
    )


async def newest_that_fit(
    renderer: PromptRenderer,
    prefix: PromptPrefix,
    history: list[Msg],
    turn: list[Msg],
    context_tokens: int,
    *,
    on_loop: bool,
) -> int:
    """How many of the newest `history` messages fit in the context together with the prefix, `turn`
    (this request's messages) and the assistant header the prompt ends with. CPU work proportional to
    what fits (plus one message), done on the loop when `on_loop` (a short history whose prefix is
    cached), else in threads a batch at a time (`offload`).

    Messages Harmony's drop rule removes anyway (analysis before a later final) cost nothing and are
    kept; the count stops at the first message that does not fit, so the kept ones are a suffix.
    """

    async def lengths(messages: Sequence[Msg]) -> list[int]:
        if on_loop:
            return [len(renderer.render_message(m)) for m in messages]
        return [len(tokens) for tokens in await map_off_loop(renderer.render_message, messages)]

    shown = {id(m) for m in drop_old_analysis([*history, *turn])}
    if on_loop or renderer.has_prefix(prefix):
        prefix_tokens = renderer.render_prefix(prefix)
    else:
        prefix_tokens = await anyio.to_thread.run_sync(renderer.render_prefix, prefix)
    used = len(prefix_tokens) + len(assistant_header())
    used += sum(await lengths([m for m in turn if id(m) in shown]))
    room = context_tokens - 1 - used  # a prompt must leave at least one token to generate
    kept = 0
    for batch in batches(history[::-1]):
        sizes = dict(
            zip(
                map(id, measured := _worth_measuring(batch, shown, room)),
                await lengths(measured),
                strict=True,
            )
        )
        for msg in batch:
            if id(msg) in shown:
                size = sizes.get(id(msg))
                if size is None or size > room:
                    return kept
                room -= size
            kept += 1
    return kept


def _worth_measuring(batch: Sequence[Msg], shown: set[int], room: int) -> list[Msg]:
    """The shown messages of `batch`, newest first, that could still fit in `room` tokens: every token is
    at most MAX_TOKEN_BYTES bytes, so text of more than `room * MAX_TOKEN_BYTES` characters (counting
    those before it) cannot fit, and is not tokenized to find out."""
    out = []
    least_tokens = 0
    for msg in batch:
        if id(msg) not in shown:
            continue
        least_tokens += -(-len(msg.text) // MAX_TOKEN_BYTES)
        if least_tokens > room:
            break
        out.append(msg)
    return out
