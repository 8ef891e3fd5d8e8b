"""A pure-Python twin of openai-harmony's `StreamableParser` (non-strict), linear in the tokens it reads.

openai-harmony 0.0.8's parser spends tens of microseconds on every token outside message text (it renders
its formatting tokens again for each one) and serialises the whole header or message so far whenever its
`state` is read, which made a degenerate output (a run of `<|start|>`) quadratic. `StreamParser` keeps the
same three states, the same header grammar, the same incremental UTF-8 decoding of message text (a broken
sequence becomes U+FFFD exactly where openai-harmony puts it) and the same error messages, at a constant
cost per token. openai-harmony stays the reference: tests/harmony/test_stream_parser.py proves both give
the same state, header fields, deltas, messages and errors after every token of any token sequence.

Only what `HarmonyOutputParser` reads is kept: completed messages carry their header fields and text.
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Callable
from typing import NamedTuple

import quicktok
from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamState

from .encoding import CALL, END, FIRST_SPECIAL_ID, MESSAGE, RETURN, START, VOCAB_SIZE

_STOP_TOKENS = frozenset({END, CALL, RETURN})
_REPLACEMENT = "\ufffd"
_CHANNEL_MARKER = "<|channel|>"
_CONSTRAIN_MARKER = "<|constrain|>"
#: Rust's `char::is_whitespace` (Unicode White_Space) and `u8::is_ascii_whitespace` (no vertical tab).
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
_ASCII_WHITESPACE = "\t\n\x0c\r "
_ROLES = {role.value: role for role in Role}
_RUST_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"'}


class StreamMessage(NamedTuple):
    """A message the parser completed: openai-harmony's `Message` with one text part."""

    role: Role
    name: str | None
    recipient: str | None
    channel: str | None
    content_type: str | None
    text: str


class _Header(NamedTuple):
    role: Role
    name: str | None
    recipient: str | None
    channel: str | None
    content_type: str | None


@functools.cache
def token_bytes() -> Callable[[int], bytes]:
    """The bytes of one ordinary token (quicktok's o200k_base, byte-identical to the Harmony vocabulary):
    ~0.4 µs a call; a table of all ranks would save ~0.3 µs a token for ~20 MB per process."""
    decode: Callable[[int], bytes] = quicktok.get_encoding("o200k_base").decode_single_token_bytes
    return decode


class StreamParser:
    """Parses one output token by token, as `openai_harmony.StreamableParser(encoding, role, strict=False)`.

    `process` raises `HarmonyError` where openai-harmony does, leaving the state where it leaves it."""

    __slots__ = (
        "_content",
        "_encoding",
        "_header",
        "_header_tokens",
        "_next_role",
        "_special_bytes",
        "_undecoded_bytes",
        "_undecoded_tokens",
        "last_content_delta",
        "messages",
        "state",
    )

    def __init__(self, encoding: HarmonyEncoding, role: Role | None) -> None:
        self._encoding = encoding
        self._next_role = role
        self.state = StreamState.EXPECT_START if role is None else StreamState.HEADER
        self._header_tokens: list[int] = []
        self._header: _Header | None = None
        self._content: list[str] = []
        self._undecoded_tokens: list[int] = []
        self._undecoded_bytes = b""
        self._special_bytes: dict[int, bytes] = {}
        self.last_content_delta: str | None = None
        self.messages: list[StreamMessage] = []

    # -- what openai-harmony's parser exposes ------------------------------------------------------
    @property
    def current_role(self) -> Role | None:
        return self._header.role if self.state == StreamState.CONTENT and self._header else self._next_role

    @property
    def current_channel(self) -> str | None:
        return self._header.channel if self.state == StreamState.CONTENT and self._header else None

    @property
    def current_recipient(self) -> str | None:
        return self._header.recipient if self.state == StreamState.CONTENT and self._header else None

    @property
    def current_content_type(self) -> str | None:
        return self._header.content_type if self.state == StreamState.CONTENT and self._header else None

    # -- feeding -----------------------------------------------------------------------------------
    def process(self, token: int) -> None:
        state = self.state
        if state == StreamState.CONTENT:
            if token in _STOP_TOKENS:
                self._end_message()
            else:
                self._decode_content(token)
        elif state == StreamState.HEADER:
            if token == MESSAGE:
                self.state = StreamState.EXPECT_START  # where a header that fails to parse leaves it
                self._header = self._parse_header(self._next_role)
                self._next_role = None
                self._header_tokens = []
                self._content = []
                self.state = StreamState.CONTENT
            elif token in _STOP_TOKENS:
                self._header_only_message()
            else:
                self._header_tokens.append(token)
        elif token == START:
            self._header_tokens = []
            self.state = StreamState.HEADER
        else:
            raise HarmonyError(f"Unexpected token {token} while expecting start token {START}")

    def process_eos(self) -> None:
        if self.state == StreamState.CONTENT:
            self._end_message()
        elif self.state == StreamState.HEADER:
            raise HarmonyError("Unexpected EOS while waiting for message header to complete")

    # -- headers -----------------------------------------------------------------------------------
    def _header_only_message(self) -> None:
        """A stop token in a header: openai-harmony keeps the first message (its role was given), its
        header words parsed and the rest as text; later ones are dropped."""
        role = self._next_role
        if role is not None and self._header_tokens:
            header, rest = _split_header(self._decode_header(), role, parse_recipient_and_type=False)
            self.messages.append(StreamMessage(*header, rest or ""))
        self.state = StreamState.EXPECT_START
        self._next_role = None

    def _decode_header(self) -> str:
        # openai-harmony decodes a header in one piece; it is bounded by the caller (MAX_HEADER_TOKENS).
        text: str = self._encoding.decode_utf8(self._header_tokens)
        return text

    def _parse_header(self, role: Role | None) -> _Header:
        try:
            text = self._decode_header()
        except HarmonyError:
            raise HarmonyError("could not decode header") from None
        header, rest = _split_header(text, role, parse_recipient_and_type=True)
        if rest is not None:
            raise HarmonyError(f"unexpected tokens remaining in message header: Some({_rust_debug(rest)})")
        return header

    # -- message text ------------------------------------------------------------------------------
    def _bytes_of(self, token: int) -> bytes | None:
        if token < FIRST_SPECIAL_ID:
            return token_bytes()(token) if token >= 0 else None
        if token >= VOCAB_SIZE:
            return None
        found = self._special_bytes.get(token)
        if found is None:
            found = self._special_bytes[token] = self._encoding.decode([token]).encode()
        return found

    def _decode_content(self, token: int) -> None:
        """openai-harmony's incremental decoding: text is emitted once its bytes are valid UTF-8; at most one
        invalid sequence per token becomes U+FFFD, the bytes after it wait for the next token."""
        piece = None if self._undecoded_tokens else self._bytes_of(token)
        if piece is None:
            # A token outside the vocabulary: openai-harmony decodes nothing more of this message until it
            # ends, and then shows U+FFFD for all of them.
            self._undecoded_tokens.append(token)
            self.last_content_delta = None
            return
        data = self._undecoded_bytes + piece
        try:
            text = data.decode()
        except UnicodeDecodeError as exc:
            delta = data[: exc.start].decode()
            rest = data[exc.start :]
            if exc.reason != "unexpected end of data":
                delta += _REPLACEMENT
                rest = data[exc.end :]
            self._undecoded_bytes = rest
            if delta:
                self._content.append(delta)
                self.last_content_delta = delta
            else:
                self.last_content_delta = None
            return
        self._undecoded_bytes = b""
        self._content.append(text)
        self.last_content_delta = text

    def _end_message(self) -> None:
        tokens_text = _REPLACEMENT if self._undecoded_tokens else ""  # they never decode (see above)
        text = "".join(self._content) + tokens_text + self._undecoded_bytes.decode(errors="replace")
        assert self._header is not None  # content is entered with a parsed header
        self.messages.append(StreamMessage(*self._header, text))
        self.state = StreamState.EXPECT_START
        self.last_content_delta = None
        self._undecoded_tokens = []
        self._undecoded_bytes = b""
        self._content = []


def _split_header(
    text: str, role: Role | None, *, parse_recipient_and_type: bool
) -> tuple[_Header, str | None]:
    """openai-harmony's `parse_header_from_string`: channel after `<|channel|>`, role (unless given),
    then recipient and content type from the last words; returns the header and any words left over."""
    channel = None
    at = text.find(_CHANNEL_MARKER)
    if at >= 0:
        after = text[at + len(_CHANNEL_MARKER) :]
        end = next((i for i, c in enumerate(after) if c in _WHITESPACE or c == "<"), len(after))
        if end == 0:
            raise HarmonyError("channel marker present but no channel value found in header")
        channel = after[:end]
        text = text[:at] + after[end:]
    text = text.strip(_WHITESPACE)
    if _CONSTRAIN_MARKER in text:
        text = text.replace(_CONSTRAIN_MARKER, " " + _CONSTRAIN_MARKER).strip(_WHITESPACE)
    parts = _split_ascii_whitespace(text)
    role_word = None
    if role is None:
        if not parts:
            raise HarmonyError("message header did not contain a role")
        role_word = parts[0]
        role = _ROLES.get(role_word)
        if role is None:
            if len(parts) > 1 or parts[0].startswith("to="):
                del parts[0]  # an unknown role followed by more words: a tool's message
                role = Role.TOOL
            else:
                raise HarmonyError(f"Unknown role: {role_word}")
    if parts and parts[0] == role.value:
        del parts[0]
    recipient = content_type = None
    if parse_recipient_and_type and parts:
        count = len(parts)
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif count == 1:
            recipient = last
        else:
            content_type = last
            if parts:
                raw = parts.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
    rest = " ".join(parts) if parts else None
    name = role_word if role == Role.TOOL else None
    return _Header(role, name, recipient, channel, content_type), rest


def _split_ascii_whitespace(text: str) -> list[str]:
    for space in _ASCII_WHITESPACE[:-1]:
        text = text.replace(space, " ")
    return [part for part in text.split(" ") if part]


def _rust_debug(text: str) -> str:
    """`{:?}` of a Rust string: quotes, backslashes and control characters escaped, and so are combining
    marks (Grapheme_Extend, approximated by categories Mn/Me) and unprintable characters as `\\u{hex}`.
    Only an error message depends on it; characters new in Unicode after Python's tables may differ."""
    out = []
    for c in text:
        escaped = _RUST_ESCAPES.get(c)
        if escaped is None and (
            unicodedata.category(c) in ("Mn", "Me")
            or (not c.isprintable() and unicodedata.category(c) != "Zs")
        ):
            escaped = f"\\u{{{ord(c):x}}}"
        out.append(escaped or c)
    return '"' + "".join(out) + '"'
