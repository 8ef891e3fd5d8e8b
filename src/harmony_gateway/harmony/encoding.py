"""The process-wide Harmony encoding, its special-token ids and prompt rendering.

The encoding is loaded once per process (`get_encoding`), after the offline vocabulary is provisioned.
Rendering must equal openai-harmony's `render_conversation_for_completion`; the prompt is rendered as
the concatenation of per-message renders plus `<|start|>assistant`, with the system+developer prefix
cached per key, which tests prove identical to the library's one-shot rendering.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from openai_harmony import (
    Conversation,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    Role,
    load_harmony_encoding,
)

from .vocab import VocabularyUnavailable, ensure_vocab_env

START = 200006
CHANNEL = 200005
CONSTRAIN = 200003
MESSAGE = 200008
END = 200007
CALL = 200012
RETURN = 200002
START_OF_TEXT = 199998
END_OF_TEXT = 199999
#: Generation stops on these two only: stopping on <|end|> would cut after the analysis message.
ASSISTANT_STOP_IDS: tuple[int, ...] = (RETURN, CALL)
FIRST_SPECIAL_ID = 199998

_lock = threading.Lock()


@functools.cache
def get_encoding() -> HarmonyEncoding:
    """Load the HARMONY_GPT_OSS encoding once; raises VocabularyUnavailable with what to set."""
    with _lock:
        ensure_vocab_env()
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except Exception as exc:
            raise VocabularyUnavailable(
                f"cannot load the Harmony encoding ({exc}); set TIKTOKEN_ENCODINGS_BASE to a folder "
                "holding o200k_base.tiktoken"
            ) from exc


def is_special(token_id: int) -> bool:
    return token_id >= FIRST_SPECIAL_ID


@functools.cache
def _assistant_header() -> tuple[int, ...]:
    return (START, *get_encoding().encode("assistant", allowed_special="all"))


class PromptRenderer:
    """Renders Harmony prompts for completion, caching the rendered tokens of repeated prefix messages.

    Agents resend the same system and developer messages on every turn; their tokens are cached by a
    caller-supplied key (bounded LRU), and the remaining messages are rendered one by one.
    """

    def __init__(self, encoding: HarmonyEncoding | None = None, cache_size: int = 256) -> None:
        self._encoding = encoding or get_encoding()
        self._prefix_cache: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._cache_size = cache_size

    def render_message(self, message: Message) -> list[int]:
        return self._encoding.render(message)

    def render_prefix(self, key: Hashable, messages: Sequence[Message]) -> list[int]:
        cached = self._prefix_cache.get(key)
        if cached is not None:
            self._prefix_cache.move_to_end(key)
            return cached
        tokens: list[int] = []
        for message in messages:
            tokens.extend(self._encoding.render(message))
        self._prefix_cache[key] = tokens
        if len(self._prefix_cache) > self._cache_size:
            self._prefix_cache.popitem(last=False)
        return tokens

    def render_for_completion(
        self, prefix_key: Hashable, prefix: Sequence[Message], rest: Sequence[Message]
    ) -> list[int]:
        tokens = list(self.render_prefix(prefix_key, prefix))
        for message in rest:
            tokens.extend(self._encoding.render(message))
        tokens.extend(_assistant_header())
        return tokens


def render_reference(messages: Sequence[Message]) -> list[int]:
    """openai-harmony's own one-shot rendering: the oracle every fast path is tested against."""
    return get_encoding().render_conversation_for_completion(
        Conversation.from_messages(list(messages)), Role.ASSISTANT
    )


__all__ = [
    "ASSISTANT_STOP_IDS",
    "CALL",
    "CHANNEL",
    "CONSTRAIN",
    "END",
    "MESSAGE",
    "RETURN",
    "START",
    "PromptRenderer",
    "VocabularyUnavailable",
    "get_encoding",
    "is_special",
    "render_reference",
]
