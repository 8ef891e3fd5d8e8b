"""Incremental detokenization for non-Harmony models: token ids in, text deltas out, never half a character.

The prefix-offset / read-offset scheme of vLLM (`detokenize_incrementally`) and SGLang: decode a short
window of ids that ends at the new tokens, and subtract the decode of the same window without them.
Decoding from `prefix_offset` rather than from the new token alone keeps tokenizers that rewrite a
token by context (SentencePiece's leading "▁", byte-level merges) correct; holding the text back while
it ends in U+FFFD keeps a UTF-8 sequence split over tokens from leaking as a replacement character.
`flush()` releases whatever is held when the output ends (then a truly invalid sequence does show as
U+FFFD, as in a one-shot decode).

Contract: for any split of the ids into `push` calls, `"".join(deltas) + flush()` equals
`tokenizer.decode(all_ids)` (for tokenizers whose decode of a sequence is the concatenation of
window decodes, which holds for byte-level BPE and WordLevel tokenizers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
#: How far back the window starts when it is first opened (vLLM uses 5 as well).
INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    """Text deltas for one choice. `tokenizer` is a `tokenizers.Tokenizer` (anything with
    `decode(ids, skip_special_tokens=...)`). Not thread-safe; one per choice."""

    __slots__ = ("_ids", "_prefix_offset", "_read_offset", "_skip_special", "_tokenizer")

    def __init__(
        self, tokenizer: Any, *, skip_special_tokens: bool = True, prompt_tail: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # A few prompt ids give the first output tokens their left context (a leading space, a merge).
        self._ids: list[int] = list(prompt_tail[-INITIAL_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        text: str = self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
        return text

    def push(self, token_ids: Sequence[int]) -> str:
        """Add new token ids; returns the text they complete (possibly "")."""
        if not token_ids:
            return ""
        ids = self._ids
        ids.extend(token_ids)
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            if self._prefix_offset > 64:
                # Keep the window short: only ids from prefix_offset on are ever decoded again.
                del ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return delta
        return ""

    def flush(self) -> str:
        """The held-back text at the end of the output (may contain U+FFFD for invalid bytes)."""
        ids = self._ids
        if self._read_offset >= len(ids):
            return ""
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(ids)
        return new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else new_text


__all__ = ["INITIAL_WINDOW", "IncrementalDetokenizer"]
