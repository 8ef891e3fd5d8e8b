"""Incremental parsers that turn an upstream's decoded text output into reasoning, content and tool calls.

Text-only upstreams (llama.cpp, Ollama, old vLLM, hosted endpoints) return gpt-oss output as text in
which the Harmony special tokens appear literally (`<|channel|>analysis<|message|>...`) or not at all
(`analysis...assistantfinal...`). The token-level parser is always preferred (REFERENCE §9 trap 13);
this module exists for upstreams that give us nothing better. One `TextOutputParser` interface covers
Harmony text, `<think>` tags, a `===FINAL===` marker and plain pass-through; `create_text_parser(kind)`
picks one by name. Every parser is incremental over chunks of any size, never raises on any text, emits
the events of `text_events.py` and keeps `ParserStats` for the metrics layer (this module imports no
metrics library).

Recognising Harmony text
------------------------
Markers are the seven literal strings in `MARKERS`. A marker split across chunks is recognised: a
parser holds back only a suffix that could still become a marker (at most 12 characters) and releases
it as soon as it cannot. Plain text is scanned with `str.find`, never character by character.

Where output starts:
- `<|start|>assistant...` (a full completion) or `<|channel|>...` (the prompt ended in
  `<|start|>assistant`), or a short header before the first marker (`analysis<|message|>` when the
  prompt ended in `<|channel|>`).
- Stripped special tokens: the text begins with a channel name immediately followed by its text (see
  "Stripped form" below).
- Neither within `marker_window_chars` characters (or `marker_window_seconds`): the fallback chain, a
  `===FINAL===`-style marker inside the window gives `MarkerParser` behaviour, else pass-through. The
  window's text is held back while undecided, so a slow decision costs latency, not correctness.

Classification per message (REFERENCE §3.1): any `to=` recipient, on any channel, is a tool call;
otherwise `final`, recipient-less `commentary` (a preamble) and a missing channel (a refusal) are
content, while `analysis` and any unknown channel (junk in a header, `––commentary`) are reasoning
(unknown ones are logged and counted). Text between messages is skipped and counted. Messages authored
by a role other than assistant (a hallucinated tool reply) are dropped and counted as parse errors.
`<|end|>` closes a message; `<|return|>` / `<|call|>` end the stream; later text is counted in
`trailing_ignored_chars` and otherwise ignored (trap 3).

Stripped form
-------------
Some servers strip special tokens, leaving `analysisWe need...assistantfinalThe answer` or
`...assistantcommentary to=functions.get_weather json{"location":"Paris"}`. This is ambiguous by
nature, so the heuristics are narrow:
- Detected only at stream start: the text begins with `analysis`, `commentary` or `final` followed by
  a character that is not whitespace, not a lowercase ASCII letter and not `<` ("analysisThe",
  "final**"), or by ` to=RECIPIENT` not followed by a Harmony marker. Plain answers that merely start
  with "final" ("finally", "final answer") or "analysis of" therefore stay plain text.
- Message boundaries are only the literal `assistantanalysis`, `assistantcommentary` and
  `assistantfinal`; "assistant" followed by anything else is text. A boundary string inside real text
  (or tool arguments) is misread as a boundary; nothing in stripped text can tell them apart.
- After the channel name an optional ` to=RECIPIENT` (up to whitespace, `<`, `{`, `[`, quotes or `(`)
  and, only after a recipient, an optional ` json` / `<|constrain|>json` belong to the header.
- The stop token is stripped too, so a stripped stream always ends with `Terminated("eos")`.

Degrading gracefully
--------------------
Nothing here raises on bad input; anomalies are counted (`ParserStats.parse_errors`) and logged at
debug level. A header that reaches a terminator (or `_MAX_HEADER_CHARS`) without `<|message|>` is
salvaged: a leading channel name and recipient are taken as the header, the rest as the message text
(gpt-oss refusals skip `<|message|>`, trap 1). A new `<|start|>` / `<|channel|>` inside a message
closes it. Stray `<|message|>` / `<|constrain|>` inside a message are dropped, so special-token text
never reaches content (trap 6). `finish()` flushes an unterminated message.
"""

from __future__ import annotations

import enum
import logging
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from .text_events import (
    ContentDelta,
    ReasoningDelta,
    Terminated,
    TerminationReason,
    TextEvent,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)

__all__ = [
    "MARKERS",
    "HarmonyTextParser",
    "MarkerParser",
    "ParserState",
    "ParserStats",
    "PassThroughParser",
    "TEXT_PARSERS",
    "TextOutputParser",
    "ThinkTagParser",
    "create_text_parser",
]

logger = logging.getLogger(__name__)

START: Final = "<|start|>"
CHANNEL: Final = "<|channel|>"
MESSAGE: Final = "<|message|>"
END: Final = "<|end|>"
RETURN: Final = "<|return|>"
CALL: Final = "<|call|>"
CONSTRAIN: Final = "<|constrain|>"
#: The Harmony special tokens recognised in text.
MARKERS: Final = (START, CHANNEL, MESSAGE, END, RETURN, CALL, CONSTRAIN)

_MARKER_SET: Final = frozenset(MARKERS)
_MAX_MARKER_LEN: Final = max(map(len, MARKERS))
_MARKER_PREFIXES: Final = frozenset(m[:k] for m in MARKERS for k in range(1, len(m)))

CHANNELS: Final = ("analysis", "commentary", "final")
_ROLES: Final = frozenset({"assistant", "user", "system", "developer", "tool"})
#: A header longer than this without `<|message|>` is salvaged as a message (bounds the hold-back).
_MAX_HEADER_CHARS: Final = 256
#: Counter keys for messages without a channel / with a channel outside CHANNELS. Unknown names are
#: collapsed into one key so a misbehaving model cannot blow up metric cardinality.
MISSING_CHANNEL: Final = "<missing>"
UNKNOWN_CHANNEL: Final = "<unknown>"
_INVALID_TOOL_NAME: Final = "__invalid_tool__"

_STRIPPED_BOUNDARIES: Final = tuple(("assistant" + c, c) for c in CHANNELS)
# Recipient after ` to=`; stops where stripped-form arguments begin.
_STRIPPED_HEADER_RE: Final = re.compile(r" to=([^\s<{\[\"'(]+)(?: ?(?:<\|constrain\|>)?json\b)?")
# Text after a stripped-form header that may still grow into more header (" to=" awaits its recipient).
_STRIPPED_HEADER_PREFIXES: Final = frozenset(
    p[:k]
    for p in (" to=", " json", "json", " <|constrain|>json", "<|constrain|>json")
    for k in range(1, len(p) + (p == " to="))
)
_SALVAGE_RE: Final = re.compile(
    r"\s*(analysis|commentary|final)(?: to=([^\s<{\[\"'(]+)(?: ?(?:<\|constrain\|>)?json\b)?)?"
)
_RECIPIENT_RE: Final = re.compile(r"\s*to=([^\s<{\[\"'(]+)")
_ROLE_TOKEN_RE: Final = re.compile(r"[^\s<]*")
# A short text before the first marker that reads as a (role or channel) header, e.g. "analysis" or
# "commentary to=functions.f json"; anything else before the first marker is content.
_HEADERISH_RE: Final = re.compile(r"\s*[A-Za-z][\w.\-]*(?:\s+to=\S+)?(?:\s+\w+)?\s*")
_CONTENT_TYPE_RE: Final = re.compile(r" ?\w*")


class ParserState(enum.Enum):
    """Where a `HarmonyTextParser` is in the message grammar."""

    AwaitStart = "await_start"  # between messages, or before the first one
    Header = "header"  # after <|start|>: role and maybe ` to=recipient`
    Channel = "channel"  # after <|channel|>: channel name, recipient, content type
    MessageContent = "message_content"  # reasoning or content text
    ToolCall = "tool_call"  # argument text of a tool call
    Terminated = "terminated"  # <|return|>/<|call|> seen, or finish() called


@dataclass(slots=True)
class ParserStats:
    """Counters of one parser instance, read by the metrics layer after (or during) a stream.

    `channel_messages` is keyed by channel name, with `MISSING_CHANNEL` / `UNKNOWN_CHANNEL` for
    messages without a channel or with an unrecognised one (think-tag blocks count as "think").
    `unexpected_order` counts analysis/commentary messages after a final answer.
    """

    channel_messages: Counter[str] = field(default_factory=Counter)
    unexpected_order: int = 0
    parse_errors: int = 0
    marker_fallbacks: int = 0
    passthrough_fallbacks: int = 0
    unknown_channels: int = 0
    trailing_ignored_chars: int = 0
    reasoning_chars: int = 0
    content_chars: int = 0


class TextOutputParser(Protocol):
    """Incremental parser of one choice's text output.

    `feed` takes the next chunk (any size, markers may be split) and returns the events it completes;
    `finish` flushes held-back text and returns the rest, ending with `Terminated`. Neither raises on
    any text. After `finish`, `feed` returns no events and counts the text as trailing. One instance per
    stream; instances are not thread-safe.
    """

    stats: ParserStats

    def feed(self, chunk: str) -> list[TextEvent]: ...

    def finish(self) -> list[TextEvent]: ...


_BodyKind = type[ReasoningDelta] | type[ContentDelta] | type[ToolCallArgumentsDelta] | None


def _marker_at(text: str, i: int, final: bool) -> str | None:
    """The marker starting at `text[i]` (where `text[i:i+2] == "<|"`), "" while `text[i:]` could still
    grow into one (never when `final`), None if it is not a marker."""
    j = text.find("|>", i + 2, i + _MAX_MARKER_LEN)
    if j >= 0:
        candidate = text[i : j + 2]
        return candidate if candidate in _MARKER_SET else None
    if not final and len(text) - i < _MAX_MARKER_LEN and text[i:] in _MARKER_PREFIXES:
        return ""
    return None


def _partial_suffix_len(text: str, start: int, token: str) -> int:
    """Length of the longest suffix of `text[start:]` that is a proper prefix of `token`."""
    k = min(len(token) - 1, len(text) - start)
    if k <= 0 or token[0] not in text[len(text) - k :]:
        return 0
    while k > 0:
        if text.endswith(token[:k]):
            return k
        k -= 1
    return 0


def _parse_stripped_header(text: str, pos: int, final: bool) -> tuple[str | None, int] | None:
    """Parse the optional ` to=RECIPIENT[ json]` after a stripped-form channel name at `text[pos]`.

    Returns (recipient or None, end of header), or None while more text could change the answer. Only
    the first `_MAX_HEADER_CHARS` characters are looked at, so the decision is the same for any
    chunking and the hold-back is bounded.
    """
    endpos = min(len(text), pos + _MAX_HEADER_CHARS)
    final = final or endpos - pos >= _MAX_HEADER_CHARS
    m = _STRIPPED_HEADER_RE.match(text, pos, endpos)
    end = m.end() if m else pos
    if not final and (end == endpos or text[end:endpos] in _STRIPPED_HEADER_PREFIXES):
        return None
    return (m.group(1) if m else None), end


def _tool_name(recipient: str) -> str:
    """The function name a recipient calls: leaked control text cut off, `functions.` removed."""
    name = recipient.split("<|", 1)[0].strip()
    name = name.removeprefix("functions.")
    return name or _INVALID_TOOL_NAME


def _split_role(text: str) -> tuple[str, str | None, str]:
    """Split header text after `<|start|>` into (role, recipient, remainder)."""
    s = text.lstrip()
    if s.startswith("assistant"):
        role, rest = "assistant", s[len("assistant") :]
    else:
        m = _ROLE_TOKEN_RE.match(s)
        assert m is not None  # the pattern matches the empty string
        role, rest = m.group(), s[m.end() :]
    rm = _RECIPIENT_RE.match(rest)
    if rm is None:
        return role, None, rest
    return role, rm.group(1), rest[rm.end() :]


class _Emitter:
    """Shared event plumbing: coalesces same-kind deltas within one call, keeps char counters."""

    stats: ParserStats
    _out: list[TextEvent]

    def _emit_text(self, kind: _BodyKind, text: str, index: int = 0) -> None:
        if not text or kind is None:
            return
        out = self._out
        last = out[-1] if out else None
        if issubclass(kind, ToolCallArgumentsDelta):
            if type(last) is ToolCallArgumentsDelta and last.index == index:
                out[-1] = ToolCallArgumentsDelta(index, last.text + text)
            else:
                out.append(ToolCallArgumentsDelta(index, text))
            return
        if kind is ContentDelta:
            self.stats.content_chars += len(text)
        else:
            self.stats.reasoning_chars += len(text)
        if type(last) is kind:
            out[-1] = kind(last.text + text)
        else:
            out.append(kind(text))


class _RunParser(_Emitter):
    """A parser whose `_run(chunk, final)` does the work; `feed` and `finish` add the end-of-output
    bookkeeping (text after `finish` is counted and ignored, `finish` ends with `Terminated`)."""

    _finished: bool

    def feed(self, chunk: str) -> list[TextEvent]:
        if self._finished:
            self.stats.trailing_ignored_chars += len(chunk)
            return []
        if not chunk:
            return []
        self._out = []
        self._run(chunk, final=False)
        return self._out

    def finish(self) -> list[TextEvent]:
        if self._finished:
            return []
        self._out = []
        self._run("", final=True)
        self._finished = True
        self._out.append(Terminated("eos"))
        return self._out

    def _run(self, chunk: str, final: bool) -> None:
        raise NotImplementedError


class PassThroughParser(_RunParser):
    """Everything is content; nothing is held back."""

    def __init__(self, *, stats: ParserStats | None = None) -> None:
        self.stats = stats if stats is not None else ParserStats()
        self._finished = False

    def _run(self, chunk: str, final: bool) -> None:
        self._emit_text(ContentDelta, chunk)


class MarkerParser(_RunParser):
    """Text before the first `marker` is reasoning, text after it is content.

    Reasoning streams as it arrives, minus a suffix that could be the start of the marker. If the
    marker never appears everything was reasoning (the model was configured as a marker model).
    """

    def __init__(self, *, marker: str = "===FINAL===", stats: ParserStats | None = None) -> None:
        if not marker:
            raise ValueError("marker must not be empty")
        self.stats = stats if stats is not None else ParserStats()
        self.marker = marker
        self._buf = ""
        self._after = False
        self._finished = False
        self._out = []

    def _run(self, chunk: str, final: bool) -> None:
        if self._after:
            self._emit_text(ContentDelta, chunk)
            return
        buf = self._buf + chunk if self._buf else chunk
        i = buf.find(self.marker)
        if i >= 0:
            self._emit_text(ReasoningDelta, buf[:i])
            self._after = True
            self._buf = ""
            self.stats.channel_messages["final"] += 1
            self._emit_text(ContentDelta, buf[i + len(self.marker) :])
            return
        hold = 0 if final else _partial_suffix_len(buf, 0, self.marker)
        self._emit_text(ReasoningDelta, buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold :]


class ThinkTagParser(_RunParser):
    """Text inside `<think>...</think>` is reasoning, text outside is content.

    With `think_implicit_start=True` (DeepSeek-R1-style chat templates put `<think>` in the prompt) the
    output starts inside a think block, so everything before the first `</think>` is reasoning; a
    leading `<think>` is still accepted. Without it, a `</think>` outside a block is dropped and counted
    as a parse error. A tag split across chunks is recognised; an unclosed block ends at `finish()`.
    """

    def __init__(
        self,
        *,
        think_implicit_start: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
        stats: ParserStats | None = None,
    ) -> None:
        if not open_tag or not close_tag or open_tag[0] != close_tag[0]:
            raise ValueError("open_tag and close_tag must be non-empty and start with the same character")
        self.stats = stats if stats is not None else ParserStats()
        self.open_tag = open_tag
        self.close_tag = close_tag
        self._lead = open_tag[0]
        self._in_think = think_implicit_start
        if think_implicit_start:
            self.stats.channel_messages["think"] += 1
        self._buf = ""
        self._finished = False
        self._out = []

    def _run(self, chunk: str, final: bool) -> None:
        buf = self._buf + chunk if self._buf else chunk
        n = len(buf)
        pos = 0
        lead, open_tag, close_tag = self._lead, self.open_tag, self.close_tag
        while pos < n:
            kind: _BodyKind = ReasoningDelta if self._in_think else ContentDelta
            i = buf.find(lead, pos)
            if i < 0:
                self._emit_text(kind, buf[pos:])
                pos = n
                break
            self._emit_text(kind, buf[pos:i])
            pos = i
            if buf.startswith(close_tag, i):
                pos = i + len(close_tag)
                if self._in_think:
                    self._in_think = False
                else:
                    self.stats.parse_errors += 1
                    logger.debug("dropping %s outside a think block", close_tag)
            elif buf.startswith(open_tag, i):
                pos = i + len(open_tag)
                if not self._in_think:
                    self._in_think = True
                    self.stats.channel_messages["think"] += 1
            elif (
                not final
                and n - i < max(len(open_tag), len(close_tag))
                and (open_tag.startswith(buf[i:]) or close_tag.startswith(buf[i:]))
            ):
                break  # could still become a tag
            else:
                self._emit_text(kind, lead)
                pos = i + 1
        self._buf = buf[pos:]


class _Mode(enum.Enum):
    UNDETERMINED = "undetermined"
    HARMONY = "harmony"
    STRIPPED = "stripped"
    DELEGATED = "delegated"


_BODY_STATES: Final = frozenset({ParserState.MessageContent, ParserState.ToolCall})
# Plain names for the per-chunk fast path: identity tests, no enum hashing or class attribute lookups.
_HARMONY: Final = _Mode.HARMONY
_DELEGATED: Final = _Mode.DELEGATED
_STRIPPED: Final = _Mode.STRIPPED
_IN_CONTENT: Final = ParserState.MessageContent
_IN_TOOL_CALL: Final = ParserState.ToolCall


class HarmonyTextParser(_Emitter):
    """Parses gpt-oss output given as text (special tokens literal or stripped) into events.

    The module docstring describes the grammar, the stripped-form heuristics and the degradation
    rules. Until the first Harmony marker (or stripped-form start) is seen, at most
    `marker_window_chars` characters are held back; if none appears within them (or within
    `marker_window_seconds` of the first chunk, measured with `clock`), the parser falls back to
    `MarkerParser` behaviour when `marker` starts inside the window, else to pass-through, counting
    `marker_fallbacks` / `passthrough_fallbacks`. The character window makes the result independent of
    chunking; the time window, by nature, does not.

    Example: feeding `"<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final"`
    then `"<|message|>Hi<|return|>"` yields `ReasoningDelta("Hm.")`, then `ContentDelta("Hi")`,
    `Terminated("return")`.
    """

    def __init__(
        self,
        *,
        marker_window_chars: int = 256,
        marker_window_seconds: float | None = None,
        marker: str = "===FINAL===",
        clock: Callable[[], float] = time.monotonic,
        stats: ParserStats | None = None,
    ) -> None:
        if marker_window_chars < 0:
            raise ValueError("marker_window_chars must be >= 0")
        if not marker:
            raise ValueError("marker must not be empty")
        self.stats = stats if stats is not None else ParserStats()
        self.marker_window_chars = marker_window_chars
        self.marker_window_seconds = marker_window_seconds
        self.marker = marker
        self._clock = clock
        self._started_at: float | None = None
        self._mode = _Mode.UNDETERMINED
        self._state = ParserState.AwaitStart
        self._delegate: TextOutputParser | None = None
        self._stripped_possible = True
        self._buf = ""
        self._out = []
        self._finished = False
        # The open message.
        self._kind: _BodyKind = None
        self._tool_index = -1
        self._next_tool_index = 0
        self._seen_final = False
        #: A message was opened: text between messages from now on is stray, not a headerless message.
        self._had_message = False
        #: Inside a run of text between messages (counted as one parse error when it starts).
        self._skipping = False
        # The open header.
        self._role_text = ""
        self._channel_text = ""
        self._header_len = 0
        # Stripped mode: the channel of a boundary whose header is not parsed yet.
        self._pending_channel: str | None = None

    @property
    def state(self) -> ParserState:
        """The grammar state; `MessageContent` once the parser has fallen back to marker/pass-through."""
        if self._mode is _Mode.DELEGATED and not self._finished:
            return ParserState.MessageContent
        return self._state

    @property
    def mode(self) -> str:
        """One of "undetermined", "harmony", "stripped", "marker", "passthrough"."""
        if self._mode is _Mode.DELEGATED:
            return "marker" if isinstance(self._delegate, MarkerParser) else "passthrough"
        # mypy types `.value` of an enum narrowed by `is` as Any.
        value: str = self._mode.value
        return value

    def feed(self, chunk: str) -> list[TextEvent]:
        """Parse the next chunk; returns the events it completes (possibly none)."""
        if self._finished:
            self.stats.trailing_ignored_chars += len(chunk)
            return []
        if not chunk:
            return []
        mode = self._mode
        if mode is _DELEGATED:
            assert self._delegate is not None
            return self._delegate.feed(chunk)
        out: list[TextEvent]
        self._out = out = []
        if mode is _HARMONY:
            state = self._state
            if not self._buf and (state is _IN_CONTENT or state is _IN_TOOL_CALL) and "<" not in chunk:
                # The common case on a long stream: plain message text, nothing held back.
                kind = self._kind
                if kind is ContentDelta:
                    self.stats.content_chars += len(chunk)
                    out.append(ContentDelta(chunk))
                elif kind is ReasoningDelta:
                    self.stats.reasoning_chars += len(chunk)
                    out.append(ReasoningDelta(chunk))
                else:
                    self._emit_text(kind, chunk, self._tool_index)
                return out
            self._buf = self._buf + chunk if self._buf else chunk
            self._run_harmony(final=False)
        elif mode is _STRIPPED:
            self._buf = self._buf + chunk if self._buf else chunk
            self._run_stripped(final=False)
        else:
            self._buf += chunk
            if self._started_at is None:
                self._started_at = self._clock()
            force = (
                self.marker_window_seconds is not None
                and self._clock() - self._started_at >= self.marker_window_seconds
            )
            self._decide(force=force)
        return out

    def finish(self) -> list[TextEvent]:
        """Flush held-back text, close an open message or call, and end with `Terminated`."""
        if self._finished:
            return []
        self._out = out = []
        if self._mode is _Mode.UNDETERMINED:
            self._decide(force=True)
        self._finished = True
        if self._mode is _Mode.DELEGATED:
            assert self._delegate is not None
            out.extend(self._delegate.finish())
            return out
        if self._mode is _Mode.STRIPPED:
            self._run_stripped(final=True)
        else:
            self._run_harmony(final=True)
            if self._state in (ParserState.Header, ParserState.Channel):
                if self._role_text.strip() or self._channel_text.strip():
                    self._salvage_header()
                else:
                    self.stats.parse_errors += 1
        self._close_message()
        if self._state is not ParserState.Terminated:
            self._terminate("eos")
        return out

    # -- start of stream -------------------------------------------------------------------------

    def _decide(self, force: bool) -> None:
        """Pick the mode from the text held so far, or keep waiting. The decision only depends on the
        text (and `force`), and once taken it would be the same for any longer text."""
        buf = self._buf
        if self._stripped_possible:
            found = self._detect_stripped(force)
            if found is None:
                return
            if found:
                return
            self._stripped_possible = False
        window = self.marker_window_chars
        i = buf.find("<|")
        while 0 <= i < window:
            marker = _marker_at(buf, i, force)
            if marker == "":
                return
            if marker is not None:
                self._start_harmony(i, marker)
                return
            i = buf.find("<|", i + 2)
        if not force and (len(buf) < window or (buf.endswith("<") and len(buf) - 1 < window)):
            return  # a Harmony marker may still start inside the window
        sep = self.marker
        j = buf.find(sep)
        if 0 <= j < window:
            self.stats.marker_fallbacks += 1
            self._delegate_to(MarkerParser(marker=sep, stats=self.stats))
            return
        if not force:
            partial = _partial_suffix_len(buf, 0, sep)
            if partial and len(buf) - partial < window:
                return  # the separator may still start inside the window
        self.stats.passthrough_fallbacks += 1
        self._delegate_to(PassThroughParser(stats=self.stats))

    def _detect_stripped(self, force: bool) -> bool | None:
        """True (and switched to stripped mode) if the text starts in the stripped form, False if it
        cannot, None while undecided."""
        buf = self._buf
        for name in CHANNELS:
            if buf.startswith(name):
                break
        else:
            if not force and any(name.startswith(buf) for name in CHANNELS):
                return None
            return False
        k = len(name)
        if len(buf) == k:
            return None if not force else False
        parsed = _parse_stripped_header(buf, k, force)
        if parsed is None:
            return None
        recipient, end = parsed
        if recipient is None:
            c = buf[k]
            if c.isspace() or c == "<" or "a" <= c <= "z":
                return False
        else:
            # `commentary to=functions.f <|constrain|>json<|message|>` continues a prompt ending in
            # <|channel|>: real Harmony, not the stripped form.
            bound = k + _MAX_HEADER_CHARS
            cm = _CONTENT_TYPE_RE.match(buf, end, bound)
            assert cm is not None
            e = cm.end()
            if not force and len(buf) < bound and (e == len(buf) or (buf[e] == "<" and e + 1 == len(buf))):
                return None
            if buf.startswith("<|", e):
                return False
        self._mode = _Mode.STRIPPED
        self._state = ParserState.MessageContent
        self._pending_channel = name
        self._buf = buf[k:]
        self._run_stripped(final=False)
        return True

    def _start_harmony(self, i: int, marker: str) -> None:
        """Switch to Harmony mode; `marker` is the first marker, at `self._buf[i]`."""
        self._mode = _Mode.HARMONY
        prefix = self._buf[:i]
        if not prefix.strip():
            self._state = ParserState.AwaitStart
        elif (
            marker in (CHANNEL, MESSAGE, CONSTRAIN)
            and len(prefix) <= _MAX_HEADER_CHARS
            and _HEADERISH_RE.fullmatch(prefix)
        ):
            # The prompt ended inside a header (`<|start|>` or `<|channel|>`): this is its rest.
            first = prefix.split()[0]
            if marker == CHANNEL or first in _ROLES:
                self._state = ParserState.Header
                self._role_text = prefix
            else:
                self._state = ParserState.Channel
                self._channel_text = prefix
            self._header_len = len(prefix)
            self._buf = self._buf[i:]
        else:
            self._begin_message(None, None)
        self._run_harmony(final=False)

    def _delegate_to(self, parser: TextOutputParser) -> None:
        self._mode = _Mode.DELEGATED
        self._delegate = parser
        buf, self._buf = self._buf, ""
        self._out.extend(parser.feed(buf))

    # -- Harmony text ----------------------------------------------------------------------------

    def _run_harmony(self, final: bool) -> None:
        buf = self._buf
        n = len(buf)
        pos = 0
        while pos < n:
            state = self._state
            if state is ParserState.Terminated:
                self.stats.trailing_ignored_chars += n - pos
                pos = n
                break
            i = buf.find("<|", pos)
            if i < 0:
                # A trailing "<" may be the first half of "<|".
                limit = n - 1 if not final and buf[n - 1] == "<" else n
            else:
                limit = i
            if limit > pos:
                if state in _BODY_STATES:
                    self._emit_text(self._kind, buf[pos:limit], self._tool_index)
                    pos = limit
                elif state is ParserState.AwaitStart:
                    seg = buf[pos:limit]
                    pos += len(seg) - len(seg.lstrip())
                    if pos < limit and self._had_message:
                        # Text between messages (after <|end|>): no header says what it is, so it is
                        # skipped up to the next marker, as the token-level parser does. One run of it
                        # is one error, however it was chunked.
                        self._skip_between_messages()
                        pos = limit
                    elif pos < limit:
                        self._begin_message(None, None)
                        continue
                else:
                    pos += self._append_header(buf[pos:limit])
                    if pos < limit:
                        continue  # header overflowed and was salvaged; the rest is message text
            if i < 0:
                break
            marker = _marker_at(buf, i, final)
            if marker == "":
                break  # hold back a possible marker
            if marker is None:
                if state in _BODY_STATES:
                    self._emit_text(self._kind, "<|", self._tool_index)
                    pos = i + 2
                elif state is ParserState.AwaitStart and self._had_message:
                    self._skip_between_messages()
                    pos = i + 2
                elif state is ParserState.AwaitStart:
                    self._begin_message(None, None)
                else:
                    pos = i + self._append_header("<|")
                continue
            pos = i + len(marker)
            self._skipping = False
            if state in _BODY_STATES:
                self._on_body_marker(marker)
            elif state is ParserState.AwaitStart:
                self._on_await_marker(marker)
            else:
                self._on_header_marker(marker)
        self._buf = buf[pos:] if pos < n else ""

    def _skip_between_messages(self) -> None:
        if not self._skipping:
            self._skipping = True
            self.stats.parse_errors += 1
            logger.debug("skipping text between messages")

    def _on_body_marker(self, marker: str) -> None:
        if marker == END:
            self._close_message()
            self._state = ParserState.AwaitStart
        elif marker == RETURN or marker == CALL:
            self._close_message()
            self._terminate("return" if marker == RETURN else "call")
        elif marker == START or marker == CHANNEL:
            # A new header without <|end|>: close the message rather than leak the header as text.
            self.stats.parse_errors += 1
            logger.debug("%s inside a message; closing it", marker)
            self._close_message()
            self._reset_header(ParserState.Header if marker == START else ParserState.Channel)
        else:
            self.stats.parse_errors += 1
            logger.debug("dropping %s inside a message", marker)

    def _on_await_marker(self, marker: str) -> None:
        if marker == START:
            self._reset_header(ParserState.Header)
        elif marker == CHANNEL:
            self._reset_header(ParserState.Channel)
        elif marker == MESSAGE and not self._had_message:
            self._begin_message(None, None)
        elif marker == RETURN or marker == CALL:
            # e.g. <|end|><|return|> (vllm#50690): a normal ending, not an error.
            self._terminate("return" if marker == RETURN else "call")
        else:
            self.stats.parse_errors += 1
            logger.debug("dropping %s between messages", marker)

    def _on_header_marker(self, marker: str) -> None:
        if marker == MESSAGE:
            self._finish_header()
        elif marker == CHANNEL:
            if self._state is ParserState.Header:
                self._state = ParserState.Channel
            else:
                self.stats.parse_errors += 1
        elif marker == CONSTRAIN:
            # Kept literally so that salvaging and content-type parsing can see it.
            if self._state is ParserState.Header:
                self._role_text += CONSTRAIN
            else:
                self._channel_text += CONSTRAIN
            self._header_len += len(CONSTRAIN)
            if self._header_len > _MAX_HEADER_CHARS:
                self._salvage_header()
        elif marker == START:
            self.stats.parse_errors += 1
            logger.debug("header abandoned by a new %s", START)
            self._reset_header(ParserState.Header)
        else:
            self._salvage_header()
            self._on_body_marker(marker)

    def _reset_header(self, state: ParserState) -> None:
        self._state = state
        self._role_text = ""
        self._channel_text = ""
        self._header_len = 0

    def _append_header(self, text: str) -> int:
        """Add header text; returns how much was taken. Past `_MAX_HEADER_CHARS` the header is
        salvaged as a message, and the caller parses the rest of `text` as its content."""
        room = max(0, _MAX_HEADER_CHARS - self._header_len)
        taken = text if len(text) <= room else text[:room]
        if self._state is ParserState.Header:
            self._role_text += taken
        else:
            self._channel_text += taken
        self._header_len += len(taken)
        if len(taken) < len(text):
            self._salvage_header()
        return len(taken)

    def _finish_header(self) -> None:
        """<|message|> ends the header: classify the message (REFERENCE §3.1)."""
        role, role_recipient, _ = _split_role(self._role_text)
        tokens = self._channel_text.replace(CONSTRAIN, " ").split()
        channel = tokens[0] if tokens and not tokens[0].startswith("to=") else None
        recipient = next((t[3:] for t in tokens if t.startswith("to=")), role_recipient)
        self._begin_message(channel, recipient, role=role or "assistant")

    def _salvage_header(self) -> None:
        """Open a message from a header that did not reach <|message|> (trap 1): a leading channel
        name and recipient are the header, the rest is the message text."""
        self.stats.parse_errors += 1
        role, recipient, rest = _split_role(self._role_text)
        channel: str | None = None
        body = rest
        if self._channel_text:
            m = _SALVAGE_RE.match(self._channel_text)
            if m is not None:
                channel = m.group(1)
                recipient = m.group(2) or recipient
                body = self._channel_text[m.end() :]
            else:
                body = self._channel_text
        logger.debug("salvaging a header without %s", MESSAGE)
        self._begin_message(channel, recipient, role=role or "assistant")
        self._emit_text(self._kind, body.replace(CONSTRAIN, ""), self._tool_index)

    # -- messages --------------------------------------------------------------------------------

    def _begin_message(self, channel: str | None, recipient: str | None, role: str = "assistant") -> None:
        stats = self.stats
        self._had_message = True
        if role != "assistant":
            stats.parse_errors += 1
            logger.warning("dropping a message authored by %r in model output", role[:64])
            self._kind = None
            self._state = ParserState.MessageContent
            return
        if not channel:
            key = MISSING_CHANNEL
        elif channel in CHANNELS:
            key = channel
        else:
            key = UNKNOWN_CHANNEL
            stats.unknown_channels += 1
            stats.parse_errors += 1
            logger.warning("unknown Harmony channel %r; treating its text as reasoning", channel[:64])
        stats.channel_messages[key] += 1
        if channel == "final":
            self._seen_final = True
        elif self._seen_final and channel in CHANNELS:
            stats.unexpected_order += 1
        if recipient:
            self._tool_index = self._next_tool_index
            self._next_tool_index += 1
            self._out.append(ToolCallStart(self._tool_index, _tool_name(recipient)))
            self._kind = ToolCallArgumentsDelta
            self._state = ParserState.ToolCall
        else:
            # Junk in a header (`––commentary`) or an invented channel is never answer text.
            answer = channel is None or channel == "final" or channel == "commentary"
            self._kind = ContentDelta if answer else ReasoningDelta
            self._state = ParserState.MessageContent

    def _close_message(self) -> None:
        if self._kind is ToolCallArgumentsDelta:
            self._out.append(ToolCallEnd(self._tool_index))
        self._kind = None

    def _terminate(self, reason: TerminationReason) -> None:
        self._state = ParserState.Terminated
        self._out.append(Terminated(reason))

    # -- stripped special tokens -----------------------------------------------------------------

    def _run_stripped(self, final: bool) -> None:
        buf = self._buf
        n = len(buf)
        pos = 0
        while True:
            if self._pending_channel is not None:
                parsed = _parse_stripped_header(buf, pos, final)
                if parsed is None:
                    break
                recipient, pos = parsed
                self._begin_message(self._pending_channel, recipient)
                self._pending_channel = None
            if pos >= n:
                break
            i = buf.find("assistant", pos)
            if i < 0:
                hold = 0 if final else _partial_suffix_len(buf, pos, "assistant")
                self._emit_text(self._kind, buf[pos : n - hold], self._tool_index)
                pos = n - hold
                break
            self._emit_text(self._kind, buf[pos:i], self._tool_index)
            pos = i
            for boundary, channel in _STRIPPED_BOUNDARIES:
                if buf.startswith(boundary, i):
                    self._close_message()
                    self._pending_channel = channel
                    pos = i + len(boundary)
                    break
            else:
                tail = buf[i:]
                if not final and any(b.startswith(tail) for b, _ in _STRIPPED_BOUNDARIES):
                    break  # "assistantfin..." may still become a boundary
                self._emit_text(self._kind, "assistant", self._tool_index)
                pos = i + len("assistant")
        self._buf = buf[pos:] if pos < n else ""


#: Parser classes by the name used in settings (`create_text_parser(kind)`).
TEXT_PARSERS: Final[dict[str, type[TextOutputParser]]] = {
    "harmony": HarmonyTextParser,
    "think": ThinkTagParser,
    "marker": MarkerParser,
    "passthrough": PassThroughParser,
}


def create_text_parser(kind: str, **options: Any) -> TextOutputParser:
    """A new parser of the given kind ("harmony", "think", "marker", "passthrough") with its keyword
    options, e.g. `create_text_parser("think", think_implicit_start=True)`. Raises ValueError for an
    unknown kind and TypeError for an option the kind does not take."""
    try:
        cls = TEXT_PARSERS[kind]
    except KeyError:
        raise ValueError(
            f"unknown text parser kind {kind!r}; expected one of {sorted(TEXT_PARSERS)}"
        ) from None
    return cls(**options)
