"""Incremental classification of generated Harmony tokens into reasoning, answer text and tool calls.

One `HarmonyOutputParser` per choice wraps `StreamParser` (openai-harmony's `StreamableParser`, non-strict,
in linear time) and turns its state into events, decided per token and identically for streaming and
non-streaming (REFERENCE §3.1):

- `(START, msg, None)` when a message header is complete (its kind is known from recipient and channel),
- `(DELTA, msg, text)` for each piece of content text,
- `(DONE, msg, None)` when the message is terminated (or closed at end of stream).

Recoverable quirks of real gpt-oss output are tolerated: tokens after a completed message (vllm#50690),
refusals without `<|message|>` (harmony#80), bare recipients. Malformed spans (a doubled
`<|start|>assistant`, text between messages, a control token inside a message, junk in a header) close the
message they interrupt with what it had, and parsing resumes at the next `<|start|>`; so does a header
longer than `MAX_HEADER_TOKENS` or with a field longer than `MAX_HEADER_FIELD_CHARS`. Each recovery is
counted by kind in `recoveries`. Text on a channel other than analysis/commentary/final is reasoning, never
answer text; text on no channel at all (no header, or a bare `<|start|>assistant` refusal) is kept as the
answer and counted too (`no_header`). Output from which nothing usable was parsed raises `UpstreamBadOutput` when it ends, so no
special-token text ever reaches a client.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Callable, Iterable, Sequence

from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamState

from ..errors import UpstreamBadOutput
from .encoding import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    FIRST_SPECIAL_ID,
    MAX_HEADER_FIELD_CHARS,
    MESSAGE,
    RETURN,
)
from .encoding import START as START_TOKEN
from .stream_parser import StreamParser
from .stream_parser import token_bytes as _token_bytes

# Message kinds.
REASONING = 0  # analysis channel, or a call to a tool that is not enabled
ANSWER = 1  # final channel, or a message without a channel
PREAMBLE = 2  # commentary without a recipient: answer text the user may see
FUNCTION_CALL = 3  # a call to a client-side function
TOOL_CALL = 4  # a call to a gateway-executed tool (built-in or MCP namespace)
DROPPED = 5  # a message the model wrote in another role's name

# Event types.
START = 0
DELTA = 1
DONE = 2

INVALID_TOOL_NAME = "__invalid_tool__"
_SPECIAL_TEXTS = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
    "<|endoftext|>",
    "<|startoftext|>",
)
_HEADER_SPECIALS = frozenset({START_TOKEN, CHANNEL, CONSTRAIN})
_ROLE_WORD = re.compile(r"[^\s<]*")
_HEADER_WORD = re.compile(r"\s*(\S+)")
_STATE_CONTENT = StreamState.CONTENT
_STATE_EXPECT_START = StreamState.EXPECT_START
_STATE_HEADER = StreamState.HEADER
_TERMINATORS = frozenset({END, CALL, RETURN})
_Utf8Decoder = codecs.getincrementaldecoder("utf-8")

# States of the streaming fast path (`HarmonyOutputParser._fast_token`).
_F_FIRST = 0  # before the first message: expecting <|channel|>
_F_NEXT = 1  # after <|end|>: expecting <|start|>
_F_ROLE = 2  # after <|start|>: the role word `assistant`, then <|channel|>
_F_CHANNEL = 3  # after <|channel|>: the channel name, then <|message|>
_F_CONTENT = 4  # message text, until <|end|>, <|return|> or <|call|>
_F_STOPPED = 5  # after <|return|>/<|call|>, or after `finish`: anything more falls back
_MAX_CHANNEL_TOKENS = 4
#: A message header (role, channel, recipient, content type) longer than this is malformed: real ones are a
#: few tokens. Bounding it bounds the parser's work per header.
MAX_HEADER_TOKENS = 256
# Nor may its channel, recipient or content type be longer than MAX_HEADER_FIELD_CHARS (one token can hold
# many characters; tool names are at most 64): the bound history messages are held to in prompts too.
_LONG_FIELD = f"a message header field longer than {MAX_HEADER_FIELD_CHARS} characters"
_KNOWN_CHANNELS = frozenset({"analysis", "commentary", "final"})

# Recovery kinds (`HarmonyOutputParser.recoveries`, the `kind` label of gateway_harmony_channel_parse_errors_total).
RECOVERED_HEADER = "broken_header"  # a header openai-harmony rejects (doubled <|start|>assistant, junk)
RECOVERED_STRAY_TEXT = "stray_text"  # tokens between messages, skipped up to the next <|start|>
RECOVERED_CONTROL_IN_CONTENT = "control_token_in_content"  # a control token where text was expected
RECOVERED_UNKNOWN_CHANNEL = "unknown_channel"  # text on a channel that is not analysis/commentary/final
RECOVERED_LONG_HEADER = (
    "header_too_long"  # a header or header field over its cap, skipped to the next <|start|>
)
RECOVERED_NO_HEADER = "no_header"  # answer text with no channel: no header at all, or a bare refusal
# Unexpected order (gateway_harmony_channel_unexpected_order_total): a reply ended by <|return|> on a message that is
# not the final answer, or analysis/commentary written after the final answer.


def _too_long(*fields: str | None) -> bool:
    """Some header field is longer than MAX_HEADER_FIELD_CHARS."""
    return any(field is not None and len(field) > MAX_HEADER_FIELD_CHARS for field in fields)


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def clean_recipient(recipient: str | None) -> str | None:
    """Strip leaked control tokens (`<|...`) and whitespace from a recipient; None when nothing is left."""
    if not recipient:
        return None
    cut = recipient.find("<|")
    if cut >= 0:
        recipient = recipient[:cut]
    recipient = recipient.strip()
    return recipient or None


def has_special_text(text: str) -> bool:
    return "<|" in text and any(marker in text for marker in _SPECIAL_TEXTS)


def split_header_only(
    header: str,
) -> tuple[str | None, str | None, str | None, str | None, str]:
    """(role, channel, recipient, content_type, text) of a message whose header ended without `<|message|>`.

    `header` is the decoded header, starting with `<|start|>{role}` except for the first message of the
    output (whose role is the assistant's, so `role` is None). After the channel name come optional
    `to=RECIPIENT` and `<|constrain|>TYPE` words, then the text:

        <|start|>assistant<|channel|>final I'm sorry.  ->  ("assistant", "final", None, None, "I'm sorry.")
        Hello there                                    ->  (None, None, None, None, "Hello there")
    """
    role = None
    rest = header.replace("<|constrain|>", " <|constrain|>")
    if rest.startswith("<|start|>"):
        match = _ROLE_WORD.match(rest, 9)
        assert match is not None  # the pattern matches the empty string too
        role, rest = match.group(0), rest[match.end() :]
    before, sep, after = rest.partition("<|channel|>")
    if not sep:
        if role is None:
            return None, None, None, None, header  # no header at all: plain text
        before, after = "", rest
    recipient = None
    for word in before.split():
        if word.startswith("to="):
            recipient = word[3:]
    channel = None
    if sep:
        match = _HEADER_WORD.match(after)
        if match is None:
            return role, None, recipient, None, ""
        channel, pos = match.group(1), match.end()
    else:
        pos = 0
    content_type = None
    while (match := _HEADER_WORD.match(after, pos)) is not None:
        word = match.group(1)
        if word.startswith("to=") and recipient is None:
            recipient = word[3:]
        elif word.startswith("<|constrain|>") and content_type is None:
            content_type = word
        else:
            break
        pos = match.end()
    return role, channel, recipient, content_type, after[pos:].lstrip()


class ParsedMessage:
    """One generated message: its header, classification and text. Mutated while it streams."""

    __slots__ = (
        "call_id",
        "call_index",
        "channel",
        "content_type",
        "item_id",
        "kind",
        "name",
        "parts",
        "recipient",
        "terminated",
        "terminator",
        "tokens",
    )

    def __init__(
        self, kind: int, channel: str | None, recipient: str | None, content_type: str | None
    ) -> None:
        self.kind = kind
        self.channel = channel
        self.recipient = recipient
        self.content_type = content_type
        self.name: str | None = None
        self.parts: list[str] = []
        self.terminated = False
        self.terminator: int | None = None
        self.tokens = 0
        self.call_id: str | None = None
        self.call_index = -1
        self.item_id: str | None = None

    @property
    def text(self) -> str:
        if len(self.parts) != 1:
            self.parts = ["".join(self.parts)]
        return self.parts[0]

    def __repr__(self) -> str:
        return f"ParsedMessage(kind={self.kind}, channel={self.channel!r}, recipient={self.recipient!r}, text={self.text!r})"


Event = tuple[int, ParsedMessage, str | None]


class HarmonyOutputParser:
    """Parses one choice's output tokens. Not thread-safe; feed tokens in order, then call `finish`."""

    def __init__(
        self,
        encoding: HarmonyEncoding,
        function_names: frozenset[str] = frozenset(),
        tool_namespaces: frozenset[str] = frozenset(),
        *,
        max_header_tokens: int = MAX_HEADER_TOKENS,
    ) -> None:
        # Built on first use: a whole output in canonical shape never needs it (`parse_complete`).
        self._streamable: StreamParser | None = None
        self.max_header_tokens = max_header_tokens
        self._encoding = encoding
        self._functions = function_names
        self._namespaces = tool_namespaces
        self.messages: list[ParsedMessage] = []
        self._open: ParsedMessage | None = None
        self._in_content = False
        self._header_tokens = 0
        #: Ids of the header being read: a header that ends without `<|message|>` is parsed from them.
        self._header_ids: list[int] = []
        self._completed = 0
        self._halted = False
        self.calls = 0
        self.reasoning_tokens = 0
        self.output_tokens = 0
        #: Tokens ignored after the output stopped being parseable (trailing quirks); for metrics and logs.
        self.ignored_tokens = 0
        self.parse_error: str | None = None
        #: Malformed spans recovered from, by kind (`RECOVERED_*`), and messages out of the expected order.
        self.recoveries: dict[str, int] = {}
        self.unexpected_order = 0
        #: Skipping tokens up to the next <|start|> after a malformed span.
        self._resync = False
        self._stopped = False
        self._seen_final = False
        # Streaming fast path: canonical output is parsed here, token by token, in pure Python; at the first
        # token it does not handle, the tokens seen so far are replayed into openai-harmony's parser, which
        # takes over (`_fall_back`). Proven identical by tests/harmony/test_token_parser_stream_fast_path.py.
        self._fast = True
        self._fstate = _F_FIRST
        self._seen: list[int] = []
        self._role_pos = 0
        self._channel_at = 0
        self._decoder: codecs.IncrementalDecoder | None = None
        self._fast_eos = False

    # -- classification -------------------------------------------------------------------------
    def classify(self, channel: str | None, recipient: str | None, role: str | None) -> ParsedMessage:
        recipient = clean_recipient(recipient)
        if role is not None and role != "assistant":
            return ParsedMessage(DROPPED, channel, recipient, None)
        if recipient and recipient != "assistant":
            if recipient.startswith("functions."):
                msg = ParsedMessage(FUNCTION_CALL, channel, recipient, None)
                msg.name = clean_recipient(recipient[10:]) or INVALID_TOOL_NAME
                return msg
            if recipient in self._functions:
                msg = ParsedMessage(FUNCTION_CALL, channel, recipient, None)
                msg.name = recipient
                return msg
            namespace = recipient.split(".", 1)[0]
            if namespace in self._namespaces or recipient in self._namespaces:
                msg = ParsedMessage(TOOL_CALL, channel, recipient, None)
                msg.name = recipient
                return msg
            return ParsedMessage(REASONING, channel, recipient, None)
        if channel == "analysis":
            return ParsedMessage(REASONING, channel, None, None)
        if channel == "commentary":
            return ParsedMessage(PREAMBLE, channel, None, None)
        if channel is not None and channel not in _KNOWN_CHANNELS:
            # Junk in the header (`––commentary`, harmony#38) or an invented channel: not the answer.
            self._recovered(RECOVERED_UNKNOWN_CHANNEL, f"unknown channel {channel!r}")
            return ParsedMessage(REASONING, channel, None, None)
        return ParsedMessage(ANSWER, channel, None, None)

    def _recovered(self, kind: str, reason: str) -> None:
        self.recoveries[kind] = self.recoveries.get(kind, 0) + 1
        if self.parse_error is None:
            self.parse_error = reason

    def _start(self, msg: ParsedMessage, events: list[Event]) -> None:
        if msg.channel == "final" and msg.kind == ANSWER:
            self._seen_final = True
        elif self._seen_final and msg.kind in (REASONING, PREAMBLE):
            self.unexpected_order += 1
        if msg.kind == FUNCTION_CALL:
            msg.call_index = self.calls
            msg.call_id = new_call_id()
            self.calls += 1
        self.messages.append(msg)
        self._open = msg
        events.append((START, msg, None))

    def _close(self, completed_text: str | None, terminator: int | None, events: list[Event]) -> None:
        """Close the open message; emit text the deltas did not carry (refusals carry none)."""
        msg = self._open
        if msg is None:
            return
        if completed_text is not None:
            emitted = msg.text
            if completed_text != emitted and completed_text.startswith(emitted):
                rest = completed_text[len(emitted) :]
                msg.parts.append(rest)
                events.append((DELTA, msg, rest))
        msg.terminated = terminator is not None
        msg.terminator = terminator
        if terminator == RETURN:
            self._stopped = True
        if terminator == RETURN and msg.kind not in (ANSWER, PREAMBLE):
            self.unexpected_order += 1  # vllm#46464: <|return|> right after an analysis message
        if msg.kind == REASONING:
            self.reasoning_tokens += msg.tokens
        events.append((DONE, msg, None))
        self._open = None
        if completed_text is not None:
            self._completed += 1

    def _halt(self, reason: str) -> None:
        """Stop parsing. Fatal only when nothing usable was produced: output that is not Harmony."""
        self._halted = True
        self.parse_error = reason
        if not self.usable:
            raise UpstreamBadOutput(f"the model output is not valid Harmony ({reason})")

    @property
    def usable(self) -> bool:
        """Some message carried text or a call: what a reply can be made of."""
        return any(
            m.kind in (FUNCTION_CALL, TOOL_CALL) or (m.kind != DROPPED and m.text) for m in self.messages
        )

    def _recover(self, kind: str, reason: str, token: int, events: list[Event]) -> list[int]:
        """Close what a malformed span interrupted and resume at the next message boundary: a `<|start|>`
        inside the header being read (a doubled `<|start|>assistant`), or `token` itself when it is one;
        otherwise skip tokens until the next `<|start|>`. Returns the tokens to feed again."""
        self._drop_open(events)
        self._recovered(kind, reason)
        header = self._header_ids
        replay: list[int] = []
        role = None
        if token == START_TOKEN:
            replay = [token]
        elif token == CHANNEL and not header:
            replay = [token]  # a header without its `<|start|>assistant`: the text parser reads it too
            role = Role.ASSISTANT
        else:
            for i in range(len(header) - 1, 0, -1):
                if header[i] == START_TOKEN:
                    replay = [*header[i:], token]
                    break
        self._header_ids = []
        self._header_tokens = 0
        self._streamable = self.stream_parser(self._encoding, role)
        self._resync = not replay
        return replay

    def _skip_malformed(self, kind: str, reason: str, token: int, events: list[Event]) -> None:
        """`_recover` from a malformed span ended by `token`: feed what it gives back, or skip `token`."""
        replay = self._recover(kind, reason, token, events)
        if replay:
            self.output_tokens -= len(replay)  # counted again as they are fed
            events += self._feed_slow(replay)
        else:
            self.ignored_tokens += 1

    def _abandon_header(self) -> None:
        """A header longer than `max_header_tokens` (a degenerate run of control tokens or text) is
        malformed: dropped unparsed, and parsing resumes at the next `<|start|>`."""
        self._recovered(RECOVERED_LONG_HEADER, f"message header longer than {self.max_header_tokens} tokens")
        self._header_ids = []
        self._header_tokens = 0
        self._streamable = self.stream_parser(self._encoding, None)
        self._resync = True

    #: Builds the token-level parser for (encoding, role); tests put openai-harmony's own here.
    stream_parser: Callable[[HarmonyEncoding, Role | None], StreamParser] = StreamParser

    @property
    def _parser(self) -> StreamParser:
        parser = self._streamable
        if parser is None:
            parser = self._streamable = self.stream_parser(self._encoding, Role.ASSISTANT)
        return parser

    @property
    def fresh(self) -> bool:
        """Nothing was fed yet."""
        return self.output_tokens == 0 and not self._halted

    # -- feeding ---------------------------------------------------------------------------------
    def parse_complete(self, token_ids: Sequence[int], stop_token: int | None) -> list[Event] | None:
        """Parse a whole output at once (a non-stream engine reply) without openai-harmony, when it has the
        canonical shape: messages `[<|start|>assistant]<|channel|>analysis|commentary|final<|message|>TEXT`,
        each ended by `<|end|>` (then another message) or by `<|return|>`/`<|call|>` as the last token, the
        last one possibly open (cut by length, or its stop token stripped: then `stop_token` closes it),
        and the text valid UTF-8. Returns None for anything else, with the parser untouched, so the caller
        feeds the tokens as usual; otherwise the same messages, counts and (merged) deltas as
        `feed(token_ids)`, `feed([stop_token])` when the last message is open, and `finish()` would give
        (proven by tests/harmony/test_token_parser_fast_path.py). The parser is finished afterwards."""
        if not self.fresh:
            return None
        spans = _canonical_spans(self._encoding, token_ids, stop_token)
        if spans is None:
            return None
        decode = self._encoding.decode_utf8
        texts = []
        for _, _, content_start, content_end, _ in spans:
            try:
                texts.append(decode(token_ids[content_start:content_end]))
            except HarmonyError:
                return None  # invalid or partial characters: openai-harmony decides what to show
        events: list[Event] = []
        for (channel, header_start, content_start, content_end, terminator), text in zip(
            spans, texts, strict=True
        ):
            msg = self.classify(channel, None, "assistant")
            msg.tokens = content_start - header_start
            self._start(msg, events)
            if text:
                msg.parts.append(text)
                events.append((DELTA, msg, text))
            msg.tokens += content_end - content_start + (terminator is not None)
            self._close(text, terminator, events)
        last = spans[-1]
        self.output_tokens = len(token_ids) + (last[4] is not None and last[3] == len(token_ids))
        return events

    def feed(self, token_ids: Iterable[int]) -> list[Event]:
        if self._fast and not self._halted:
            events: list[Event] = []
            tokens = list(token_ids)
            fast_token = self._fast_token
            for i, token in enumerate(tokens):
                if not fast_token(token, events):
                    self._fall_back()
                    events += self._feed_slow(tokens[i:])
                    break
            return events
        return self._feed_slow(token_ids)

    def _fall_back(self) -> None:
        """Hand over to openai-harmony: replay the tokens the fast path consumed (their events were already
        given, and the state they left is the one the slow path would have left)."""
        self._fast = False
        parser = self._parser
        for token in self._seen:
            parser.process(token)
        if self._fast_eos:
            parser.process_eos()
        self._seen = []
        self._decoder = None

    def _fast_token(self, token: int, events: list[Event]) -> bool:
        """Consume one token of canonical output; False (nothing changed) for anything else."""
        state = self._fstate
        if state == _F_CONTENT:
            # `_F_CONTENT` is entered with `_open` and `_decoder` set; the ignores below stand for asserts
            # that would cost time on every token.
            if token < FIRST_SPECIAL_ID:
                try:
                    text = self._decoder.decode(_token_bytes()(token))  # type: ignore[union-attr]
                except UnicodeDecodeError:
                    return False
                self.output_tokens += 1
                self._seen.append(token)
                msg = self._open
                msg.tokens += 1  # type: ignore[union-attr]
                if text:
                    msg.parts.append(text)  # type: ignore[union-attr]
                    events.append((DELTA, msg, text))  # type: ignore[arg-type]
                return True
            if token not in _TERMINATORS or self._decoder.getstate()[0]:  # type: ignore[union-attr]
                return False
            self.output_tokens += 1
            self._seen.append(token)
            msg = self._open
            msg.tokens += 1  # type: ignore[union-attr]
            self._in_content = False
            self._close(msg.text, token, events)  # type: ignore[union-attr]
            self._fstate = _F_NEXT if token == END else _F_STOPPED
            return True
        if state == _F_CHANNEL:
            if token < FIRST_SPECIAL_ID:
                if len(self._header_ids) >= self._channel_at + _MAX_CHANNEL_TOKENS:
                    return False
            elif token == MESSAGE:
                channel = _header_words(self._encoding)[1].get(tuple(self._header_ids[self._channel_at :]))
                if channel is None:
                    return False
                self.output_tokens += 1
                self._seen.append(token)
                msg = self.classify(channel, None, "assistant")
                msg.tokens = self._header_tokens + 1
                self._header_tokens = 0
                self._header_ids.clear()
                self._in_content = True
                self._decoder = _Utf8Decoder()
                self._fstate = _F_CONTENT
                self._start(msg, events)
                return True
            else:
                return False
        elif state == _F_ROLE:
            assistant = _header_words(self._encoding)[0]
            if self._role_pos < len(assistant):
                if token != assistant[self._role_pos]:
                    return False
                self._role_pos += 1
            elif token == CHANNEL:
                self._fstate = _F_CHANNEL
                self._channel_at = len(self._header_ids) + 1
            else:
                return False
        elif state == _F_NEXT:
            if token != START_TOKEN:
                return False
            self._fstate = _F_ROLE
            self._role_pos = 0
        elif state == _F_FIRST:
            if token != CHANNEL:
                return False
            self._fstate = _F_CHANNEL
            self._channel_at = 1
        else:
            return False
        self.output_tokens += 1
        self._seen.append(token)
        self._header_tokens += 1
        self._header_ids.append(token)
        return True

    def _feed_slow(self, token_ids: Iterable[int]) -> list[Event]:
        events: list[Event] = []
        if self._halted:
            for _ in token_ids:
                self.ignored_tokens += 1
            return events
        parser = self._parser
        max_header = self.max_header_tokens
        for token in token_ids:
            self.output_tokens += 1
            if self._stopped:
                self.ignored_tokens += 1  # text after the end (vllm#50690): the reply is over
                continue
            if (
                len(self._header_ids) >= max_header
                and token != MESSAGE
                and token not in _TERMINATORS
                and parser.state == _STATE_HEADER
            ):
                self._abandon_header()  # before the token would make the header longer
                parser = self._parser
            if self._resync:
                if token == CHANNEL:
                    self._streamable = parser = self.stream_parser(self._encoding, Role.ASSISTANT)
                elif token != START_TOKEN:
                    self.ignored_tokens += 1
                    continue
                self._resync = False
            try:
                parser.process(token)
            except HarmonyError as exc:
                kind = RECOVERED_STRAY_TEXT if parser.state == _STATE_EXPECT_START else RECOVERED_HEADER
                self._skip_malformed(kind, str(exc), token, events)
                parser = self._parser
                continue
            if token < FIRST_SPECIAL_ID:
                if self._in_content:
                    # `_in_content` implies an open message; no assert on this per-token path.
                    msg = self._open
                    msg.tokens += 1  # type: ignore[union-attr]
                    delta = parser.last_content_delta
                    if delta:
                        msg.parts.append(delta)  # type: ignore[union-attr]
                        events.append((DELTA, msg, delta))  # type: ignore[arg-type]
                else:
                    self._header_tokens += 1
                    self._header_ids.append(token)
                continue
            state = parser.state
            if state == _STATE_CONTENT:
                if self._in_content:
                    # A control token swallowed as text: close the message with the text it had (no
                    # special-token text is ever emitted) and resume at the next message.
                    replay = self._recover(
                        RECOVERED_CONTROL_IN_CONTENT,
                        f"control token {token} inside message content",
                        token,
                        events,
                    )
                    if replay:
                        self.output_tokens -= len(replay)  # counted again as they are fed
                        events += self._feed_slow(replay)
                    parser = self._parser
                    continue
                if token == MESSAGE:
                    channel, recipient = parser.current_channel, parser.current_recipient
                    content_type = parser.current_content_type
                    if _too_long(channel, recipient, content_type):
                        self._skip_malformed(RECOVERED_LONG_HEADER, _LONG_FIELD, token, events)
                        parser = self._parser
                        continue
                    role = parser.current_role
                    msg = self.classify(channel, recipient, role.value if role is not None else None)
                    if channel is None and msg.kind == ANSWER:
                        self._recovered(RECOVERED_NO_HEADER, "a message header without a channel")
                    msg.content_type = content_type
                    msg.tokens = self._header_tokens + 1
                    self._header_tokens = 0
                    self._header_ids.clear()
                    self._in_content = True
                    self._start(msg, events)
                continue
            if state == _STATE_EXPECT_START and token in (END, CALL, RETURN):
                if self._open is None:
                    self._complete_header_only(token, events)
                else:
                    self._complete(token, events)
            else:
                self._header_tokens += 1
                self._header_ids.append(token)
        return events

    def _complete(self, terminator: int | None, events: list[Event]) -> None:
        # No special-text check here: a special id absorbed as text already halted in `feed`, so any `<|end|>`
        # left in the text was written with ordinary tokens (the model quoting the format) and is real text.
        text = self._parser.messages[-1].text
        assert self._open is not None
        self._open.tokens += 1
        self._in_content = False
        self._close(text, terminator, events)

    def _complete_header_only(self, terminator: int | None, events: list[Event]) -> None:
        """A message whose header ended without `<|message|>` (a refusal, harmony#80): its text arrives all at
        once. Parsed from our own header ids: openai-harmony 0.0.8 drops such a message when it is not the
        first one, and puts recipient and content type into the text when it is."""
        header = self._header_ids
        for i in range(len(header) - 1, 0, -1):
            if header[i] == START_TOKEN:  # a doubled `<|start|>assistant`: the last one opens the message
                self._recovered(RECOVERED_HEADER, "doubled <|start|> in a message header")
                del header[:i]
                break
        junk = any(t >= FIRST_SPECIAL_ID and t not in _HEADER_SPECIALS for t in header)
        role, channel, recipient, content_type, text = split_header_only(self._encoding.decode(header))
        tokens = self._header_tokens + (terminator is not None)
        self._header_tokens = 0
        header.clear()
        if junk or has_special_text(text):
            self._recovered(RECOVERED_HEADER, "control-token text inside a message header")
            return
        if terminator is None and not text:
            return  # a header cut by the end of output: nothing was said
        if _too_long(channel, recipient, content_type):
            self._recovered(RECOVERED_LONG_HEADER, _LONG_FIELD)
            return
        msg = self.classify(channel, recipient, role)
        if channel is None and msg.kind == ANSWER and text:
            self._recovered(RECOVERED_NO_HEADER, "answer text without a Harmony header (no channel)")
        msg.content_type = content_type
        msg.tokens = tokens
        self._start(msg, events)
        self._close(text, terminator, events)

    def _drop_open(self, events: list[Event]) -> None:
        """Close a message interrupted by unparseable output; it stays unterminated (incomplete)."""
        if self._open is not None:
            self._close(None, None, events)
        self._in_content = False

    def finish(self) -> list[Event]:
        """Close an unterminated message (the engine stopped for length, or stripped the stop token).
        Raises `UpstreamBadOutput` when the output had malformed spans and nothing usable."""
        events = self._finish()
        if self.recoveries and not self._halted and not self.usable:
            self._halted = True
            raise UpstreamBadOutput(f"the model output is not valid Harmony ({self.parse_error})")
        return events

    def _finish(self) -> list[Event]:
        events: list[Event] = []
        if self._halted:
            return events
        if self._fast:
            if self._fstate == _F_CONTENT:
                assert self._decoder is not None and self._open is not None
                if not self._decoder.getstate()[0]:
                    # process_eos() closes open canonical text as it is: nothing more to emit.
                    self._fast_eos = True
                    self._fstate = _F_STOPPED
                    self._in_content = False
                    self._close(self._open.text, None, events)
                    return events
            if self._open is None and not self._header_ids:
                return events  # between messages: nothing to close
            self._fall_back()
        if self._open is None:
            if self._header_ids:
                # Output ended inside a header: a refusal whose stop token the engine stripped, or a
                # header cut by length (not an error: the reply is simply empty).
                self._complete_header_only(None, events)
            return events
        emitted_before = self._open.text
        try:
            self._parser.process_eos()
        except HarmonyError as exc:
            self._drop_open(events)
            self._halt(str(exc))
            return events
        self._in_content = False
        self._close(emitted_before, None, events)
        return events

    # -- results ---------------------------------------------------------------------------------
    @property
    def open_message(self) -> ParsedMessage | None:
        return self._open

    @property
    def halted(self) -> bool:
        return self._halted

    @property
    def in_message(self) -> bool:
        """A message (or a header) is open: a stop token the engine stripped still has to close it."""
        return self._open is not None or bool(self._header_ids)


@functools.cache
def _header_words(encoding: HarmonyEncoding) -> tuple[tuple[int, ...], dict[tuple[int, ...], str]]:
    """Token ids of the role word `assistant` and of the three channel names, as the model writes them."""
    channels = {tuple(encoding.encode(name, allowed_special="all")): name for name in _CHANNELS}
    return tuple(encoding.encode("assistant", allowed_special="all")), channels


_CHANNELS = ("analysis", "commentary", "final")


def _canonical_spans(
    encoding: HarmonyEncoding, ids: Sequence[int], stop_token: int | None
) -> list[tuple[str, int, int, int, int | None]] | None:
    """(channel, header start, content start, content end, terminator) per message of an output in
    canonical shape (see `HarmonyOutputParser.parse_complete`), or None."""
    assistant, channels = _header_words(encoding)
    n = len(ids)
    spans: list[tuple[str, int, int, int, int | None]] = []
    pos = 0
    while pos < n:
        start = pos
        if spans:  # later messages open with <|start|>assistant
            if ids[pos] != START_TOKEN:
                return None
            pos += 1
            role_end = pos + len(assistant)
            if tuple(ids[pos:role_end]) != assistant:
                return None
            pos = role_end
        if pos >= n or ids[pos] != CHANNEL:
            return None
        pos += 1
        header_end = pos
        while header_end < n and ids[header_end] < FIRST_SPECIAL_ID:
            header_end += 1
        if header_end >= n or ids[header_end] != MESSAGE:
            return None
        channel = channels.get(tuple(ids[pos:header_end]))
        if channel is None:
            return None
        content_start = header_end + 1
        end = content_start
        while end < n and ids[end] < FIRST_SPECIAL_ID:
            end += 1
        if end == n:  # open at the end of the output
            terminator = stop_token if stop_token in (CALL, RETURN) else None
            spans.append((channel, start, content_start, end, terminator))
            return spans
        terminator = ids[end]
        if terminator not in _TERMINATORS or (terminator != END and end + 1 != n):
            return None
        spans.append((channel, start, content_start, end, terminator))
        pos = end + 1
    return spans or None


__all__ = [
    "ANSWER",
    "DELTA",
    "DONE",
    "DROPPED",
    "FUNCTION_CALL",
    "PREAMBLE",
    "REASONING",
    "START",
    "TOOL_CALL",
    "HarmonyOutputParser",
    "ParsedMessage",
    "clean_recipient",
    "has_special_text",
    "new_call_id",
]
