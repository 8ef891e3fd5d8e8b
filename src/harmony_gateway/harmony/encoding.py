"""The process-wide Harmony encoding, its special-token ids and prompt rendering.

The encoding is loaded once per process (`get_encoding`), after the offline vocabulary is provisioned.
Rendering must equal openai-harmony's `render_conversation_for_completion`; the prompt is rendered as
the concatenation of per-message renders plus `<|start|>assistant`, with the system+developer prefix
cached per key, which tests prove identical to the library's one-shot rendering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import orjson
import quicktok
from openai_harmony import (
    Conversation,
    HarmonyEncoding,
    HarmonyEncodingName,
    Message,
    Role,
    load_harmony_encoding,
)

from ..errors import InvalidRequest, is_panic
from .messages import Msg, PromptPrefix, developer_message
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
#: o200k_harmony ids are 0..201087 (the reserved specials end there); anything else is not a token.
VOCAB_SIZE = 201088

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
def assistant_header() -> tuple[int, ...]:
    """The tokens every completion prompt ends with: the start of the assistant's turn."""
    return (START, *get_encoding().encode("assistant", allowed_special="all"))


@dataclasses.dataclass(frozen=True, slots=True)
class _SpecialTokens:
    pattern: re.Pattern[str]
    ids: dict[str, int]


class PromptRenderer:
    """Renders Harmony prompts for completion, identical to openai-harmony's own rendering, much faster.

    - The system+developer prefix is rendered by openai-harmony as one conversation (the system text
      depends on the developer message's tools) and cached per caller-supplied key: agents resend the
      same prefix every turn.
    - Every other message is its header frame + the text encoded as ordinary BPE + its terminator.
      openai-harmony encodes message text as ordinary text (special-token strings in user text stay
      text), so the frame is cached per header and the text goes through quicktok, which costs ~1 µs
      instead of ~200 µs per message. Property tests (tests/harmony/test_render.py) prove the
      result equal to `render_conversation_for_completion` over generated conversations.
    """

    _SENTINEL = "\u00a7"  # a single-token text whose encoding never merges with the frame around it

    def __init__(self, encoding: HarmonyEncoding | None = None, cache_size: int = 512) -> None:
        self._encoding = encoding or get_encoding()
        self._quicktok: Callable[[str], list[int]] = quicktok.get_encoding("o200k_base").encode_ordinary
        self._prefix_cache: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._frames: dict[tuple[Any, ...], tuple[list[int], list[int]]] = {}
        self._cache_size = cache_size
        self._sentinel_ids = self._encode_text(self._SENTINEL)
        self._special_tokens: _SpecialTokens | None = None

    def _frame(self, msg: Msg) -> tuple[list[int], list[int]]:
        key = (msg.role, msg.channel, msg.recipient, msg.content_type, msg.name)
        frame = self._frames.get(key)
        if frame is None:
            check_header_fields(msg)
            probe = msg._replace(text=self._SENTINEL)
            with client_text(None):  # a recipient or author name from the request
                tokens = self._encoding.render(probe.to_harmony())
            n = len(self._sentinel_ids)
            at = _find_sublist(tokens, self._sentinel_ids)
            frame = (tokens[:at], tokens[at + n :])
            if len(self._frames) < 4096:  # recipients are model-chosen; bound the table
                self._frames[key] = frame
        return frame

    def render_message(self, msg: Msg) -> list[int]:
        head, tail = self._frame(msg)
        return [*head, *self._encode_text(msg.text), *tail]

    def _key(self, prefix: PromptPrefix) -> Hashable:
        try:
            return prefix.key
        except RecursionError as exc:  # a schema nested deeper than Python recurses: unrenderable too
            raise self._unrenderable(prefix, exc) from None

    def has_prefix(self, prefix: PromptPrefix) -> bool:
        """Raises InvalidRequest (param `tools[i]`) for a tool openai-harmony cannot render."""
        return self._key(prefix) in self._prefix_cache

    def render_prefix(self, prefix: PromptPrefix) -> list[int]:
        """The system+developer tokens; raises InvalidRequest (param `tools[i]`) for a tool
        openai-harmony cannot render."""
        key = self._key(prefix)
        cached = self._prefix_cache.get(key)
        if cached is not None:
            with contextlib.suppress(KeyError):  # a render thread may have evicted it since `get`
                self._prefix_cache.move_to_end(key)
            return cached
        check_prefix_runs(prefix)
        try:
            tokens = self._render_prefix_tokens(prefix)
        except (ValueError, RuntimeError) as exc:  # HarmonyError and RecursionError are RuntimeErrors
            raise self._unrenderable(prefix, exc) from None
        except BaseException as exc:
            # openai-harmony panics on text its pre-tokenizer cannot split (a run of about a million
            # characters): the request's instructions or tools, so the request's fault, a 400.
            if not is_panic(exc):
                raise
            raise self._unrenderable(prefix, exc) from None
        self._prefix_cache[key] = tokens
        if len(self._prefix_cache) > self._cache_size:
            self._prefix_cache.popitem(last=False)
        return tokens

    def _render_prefix_tokens(self, prefix: PromptPrefix) -> list[int]:
        instructions = prefix.instructions
        if instructions and len(instructions) > SPLICE_INSTRUCTIONS_CHARS and prefix.response_format is None:
            spliced = self._render_with_spliced_instructions(prefix, instructions)
            if spliced is not None:
                return spliced
        return self._encoding.render_conversation(Conversation.from_messages(prefix.messages()))

    def _render_with_spliced_instructions(self, prefix: PromptPrefix, instructions: str) -> list[int] | None:
        """The prefix rendered by openai-harmony with a placeholder for the instructions, whose developer
        message text then gets the instructions back and is encoded by the fast encoder: openai-harmony
        writes the instructions verbatim into that message's one text, which its BPE encodes in time
        quadratic in a piece's length, and long instructions are where long pieces come from.
        tests/harmony/test_render.py proves the result equal to openai-harmony's own. None when the
        placeholder is not found once in the developer message's text (the caller renders the slow way)."""
        probe = dataclasses.replace(prefix, instructions=_INSTRUCTIONS_PLACEHOLDER)
        tokens = self._encoding.render_conversation(Conversation.from_messages(probe.messages()))
        body_start = len(tokens) - 1 - tokens[::-1].index(MESSAGE)
        if tokens[-1] != END:
            return None
        text = self._encoding.decode_utf8(tokens[body_start + 1 : -1])
        if text.count(_INSTRUCTIONS_PLACEHOLDER) != 1:
            return None
        body = self._encode_text(text.replace(_INSTRUCTIONS_PLACEHOLDER, instructions))
        return [*tokens[: body_start + 1], *body, END]

    def _unrenderable(self, prefix: PromptPrefix, exc: BaseException) -> InvalidRequest:
        """openai-harmony refused the system/developer messages: name the tool whose schema it cannot
        render (e.g. one nested past its recursion limit), found by rendering each tool on its own;
        else the instructions are at fault."""
        for tool in prefix.all_tools():
            message = developer_message(None, [tool])
            assert message is not None
            try:
                self._encoding.render(message)
            except BaseException as tool_exc:
                if not (isinstance(tool_exc, (ValueError, RuntimeError)) or is_panic(tool_exc)):
                    raise
                name = tool.name if len(tool.name) <= 64 else tool.name[:64] + "…"  # names are unchecked here
                return InvalidRequest(
                    f"tool {name!r} cannot be described to the model: {_short(tool_exc)}",
                    param=tool.param or "tools",
                )
        return InvalidRequest(f"the request's instructions and tools cannot be rendered: {_short(exc)}")

    def render_for_completion(self, prefix: PromptPrefix, history: Sequence[Msg]) -> list[int]:
        tokens = list(self.render_prefix(prefix))
        for msg in history:
            head, tail = self._frame(msg)
            tokens += head
            tokens += self._encode_text(msg.text)
            tokens += tail
        tokens += assistant_header()
        return tokens

    def _encode_text(self, text: str) -> list[int]:
        if text.isascii() or _NEWER_UNICODE.search(text) is None:
            encode = self._quicktok
        else:
            # quicktok's tables know characters added in Unicode 17 that openai-harmony's pre-tokenizer
            # does not, and split text around them differently: such text takes openai-harmony's encoder.
            encode = self._encode_with_harmony
        if len(text) <= ENCODE_PIECE_CHARS:
            return encode(text)
        tokens: list[int] = []
        for piece in text_pieces(text, ENCODE_PIECE_CHARS):
            tokens += encode(piece)
        return tokens

    def _encode_with_harmony(self, text: str) -> list[int]:
        check_runs(text, None)
        with client_text(None):
            return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def encode_text(self, text: str) -> list[int]:
        return self._encode_text(text)

    def encode_with_special_tokens(self, text: str) -> list[int]:
        """`encoding.encode(text, allowed_special="all")` (a raw prompt whose special-token text is meant
        as those tokens), through the fast encoder: ordinary text between special tokens is encoded on
        its own, as tiktoken's encoder does it, so long prompts never take openai-harmony's slow BPE."""
        specials = self._specials()
        tokens: list[int] = []
        start = 0
        for match in specials.pattern.finditer(text):
            tokens += self._encode_text(text[start : match.start()])
            tokens.append(specials.ids[match.group()])
            start = match.end()
        tokens += self._encode_text(text[start:])
        return tokens

    def _specials(self) -> _SpecialTokens:
        if self._special_tokens is None:
            names = sorted(self._encoding.special_tokens_set, key=len, reverse=True)
            ids = {name: self._encoding.encode(name, allowed_special="all")[0] for name in names}
            self._special_tokens = _SpecialTokens(re.compile("|".join(map(re.escape, names))), ids)
        return self._special_tokens


#: Code points where quicktok's and openai-harmony's encodings of ordinary text disagree (characters
#: assigned in Unicode 17), found by encoding every code point unassigned in Python's own tables in
#: several contexts with both: tests/harmony/test_render.py keeps the two renderings equal around them.
_NEWER_UNICODE = re.compile(
    "["
    + "".join(
        chr(a) if a == b else f"{chr(a)}-{chr(b)}"
        for a, b in (
            (0x88F, 0x88F),
            (0xC5C, 0xC5C),
            (0xCDC, 0xCDC),
            (0x1ACF, 0x1ADD),
            (0x1AE0, 0x1AEB),
            (0xA7CE, 0xA7CF),
            (0xA7D2, 0xA7D2),
            (0xA7D4, 0xA7D4),
            (0xA7F1, 0xA7F1),
            (0x10940, 0x10959),
            (0x10EC5, 0x10EC7),
            (0x10EFA, 0x10EFB),
            (0x11B60, 0x11B67),
            (0x11DB0, 0x11DDB),
            (0x11DE0, 0x11DE9),
            (0x16EA0, 0x16EB8),
            (0x16EBB, 0x16ED3),
            (0x16FF2, 0x16FF6),
            (0x187F8, 0x187FF),
            (0x18D09, 0x18D1E),
            (0x18D80, 0x18DF2),
            (0x1E6C0, 0x1E6DE),
            (0x1E6E0, 0x1E6F5),
            (0x1E6FE, 0x1E6FF),
            (0x2B73A, 0x2B73F),
            (0x2CEA2, 0x2CEAD),
            (0x323B0, 0x33479),
        )
    )
    + "]"
)


#: Longer instructions are written into the developer message's text by placeholder and encoded by the
#: fast encoder (`PromptRenderer._render_with_spliced_instructions`).
SPLICE_INSTRUCTIONS_CHARS = 1024
_INSTRUCTIONS_PLACEHOLDER = "\u00a7\u00a7instructions\u00a7\u00a7"
#: openai-harmony's BPE takes time quadratic in the length of one pre-tokenizer piece (40,000 CJK
#: characters take 6.6 s, 100,000 letters 10 s). Client text it still encodes itself (tool descriptions
#: and schemas, a response format, instructions beside one, text with characters newer than the fast
#: encoder's tables) may hold no run of non-space, or of space, characters longer than this: every piece
#: is then at most this long and costs well under a millisecond.
MAX_HARMONY_RUN = 256
_LONG_RUN = re.compile(rf"\S{{{MAX_HARMONY_RUN + 1},}}|\s{{{MAX_HARMONY_RUN + 1},}}")


def check_runs(text: str, param: str | None) -> None:
    """Raises InvalidRequest naming `param` when `text` holds a run longer than MAX_HARMONY_RUN."""
    match = _LONG_RUN.search(text)
    if match is not None:
        raise InvalidRequest(
            f"the text holds a run of {match.end() - match.start()}+ characters without a break (a space, or "
            f"a non-space); at most {MAX_HARMONY_RUN} are accepted here",
            param=param,
        )


#: A header field (channel, recipient, content type, author name) may be this long: the output parsers
#: drop a model's header with a longer one (harmony/token_parser.py), and a history message holding one,
#: which only a client can make up, is refused: openai-harmony encodes header fields itself, in time
#: quadratic in their length.
MAX_HEADER_FIELD_CHARS = 256


def check_header_fields(msg: Msg) -> None:
    """Raises InvalidRequest when a header field of `msg` (a tool call's name, say) is over-long."""
    fields = (
        ("recipient", msg.recipient),
        ("name", msg.name),
        ("channel", msg.channel),
        ("content_type", msg.content_type),
    )
    for field, value in fields:
        if value is not None and len(value) > MAX_HEADER_FIELD_CHARS:
            raise InvalidRequest(
                f"a {msg.role} message's {field.replace('_', ' ')} (a tool call's name, say) holds "
                f"{len(value)} characters; at most {MAX_HEADER_FIELD_CHARS} are accepted"
            )


def _check_schema_runs(value: Any, param: str | None) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_runs(item, param)
        elif isinstance(item, dict):
            for key, inner in item.items():
                check_runs(str(key), param)
                stack.append(inner)
        elif isinstance(item, list | tuple):
            stack.extend(item)


def check_prefix_runs(prefix: PromptPrefix) -> None:
    """Every client text of `prefix` that openai-harmony encodes itself passes `check_runs`."""
    for tool in prefix.all_tools():
        check_runs(tool.description, tool.param or "tools")
        _check_schema_runs(tool.parameters, tool.param or "tools")
    for namespace in prefix.namespaces:
        check_runs(namespace.description, "tools")
    response_format = prefix.response_format
    if response_format is not None:
        check_runs(response_format.name, "response_format")
        check_runs(response_format.description, "response_format")
        _check_schema_runs(orjson.loads(response_format.schema_json), "response_format")
        # Instructions beside a response format are not spliced (the format is a second text); short
        # ones cost little whatever their runs.
        if prefix.instructions and len(prefix.instructions) > SPLICE_INSTRUCTIONS_CHARS:
            check_runs(prefix.instructions, "instructions")


#: Longer texts are encoded piece by piece (`text_pieces`): the BPE holds the GIL for a whole call, and a
#: piece this long takes about a millisecond, so a thread rendering an 8 MiB prompt leaves the event loop
#: the GIL between pieces instead of for a third of a second.
ENCODE_PIECE_CHARS = 16_384
#: A space right after a non-space: the o200k pre-tokenizer always ends a piece there (no pattern runs
#: from a non-space across a space, and none looks behind), so encoding the text on either side of it
#: apart gives exactly the whole text's tokens (tests/harmony/test_render.py proves it by property).
_PIECE_BOUNDARY = re.compile(r"(?<=\S) ")


def text_pieces(text: str, size: int) -> list[str]:
    """`text` cut at pre-tokenizer boundaries into pieces of about `size` characters (longer where no
    boundary is near: a run without one is never cut)."""
    pieces = []
    start = 0
    while len(text) - start > size:
        boundary = _PIECE_BOUNDARY.search(text, start + max(size, 1))
        if boundary is None:
            break
        pieces.append(text[start : boundary.start()])
        start = boundary.start()
    pieces.append(text[start:])
    return pieces


@contextlib.contextmanager
def client_text(param: str | None) -> Iterator[None]:
    """Around openai-harmony encoding text a client sent: its pre-tokenizer panics on a run of about a
    million characters it cannot split (fancy-regex's backtracking stack overflows), which is the
    request's text at fault, so a 400 naming `param`, not a panic through the gateway."""
    try:
        yield
    except BaseException as exc:
        if not is_panic(exc):
            raise
        raise InvalidRequest(f"the text cannot be tokenized: {_short(exc)}", param=param) from None


def _short(exc: BaseException, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "…"


def _find_sublist(haystack: list[int], needle: list[int]) -> int:
    n = len(needle)
    for i in range(len(haystack) - n, -1, -1):
        if haystack[i : i + n] == needle:
            return i
    raise ValueError("sentinel not found in rendered frame")


def render_reference(messages: Sequence[Any]) -> list[int]:
    """openai-harmony's own one-shot rendering: the oracle every fast path is tested against."""
    harmony_messages = [m if isinstance(m, Message) else m.to_harmony() for m in messages]
    return get_encoding().render_conversation_for_completion(
        Conversation.from_messages(harmony_messages), Role.ASSISTANT
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
    "client_text",
    "get_encoding",
    "is_special",
    "render_reference",
]
