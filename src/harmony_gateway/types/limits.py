"""Integer ranges the engine wire protocols can carry (uint32 token ids and counts, int32 `top_k`) and the
64-bit seeds clients send. A request value outside them is a 400 naming the field, never a failure while
the engine request is built. Also the caps on one stored conversation, which the settings carry and the
stores enforce."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from pydantic import AfterValidator, BeforeValidator, Field

from .. import errors

INT32_MAX = 2**31 - 1

#: A token id as a request may name one (`stop_token_ids`); the engine checks it against its vocabulary.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
#: -1 (or 0) disables top-k.
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
#: Any 64-bit seed, as OpenAI accepts; an engine module folds it into the width its wire carries.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenCount = Annotated[int, Field(ge=0, le=INT32_MAX)]

# Bounds on what one request may ask for. A request above one is a 400 naming the field, refused while
# the body is validated: nothing later (rendering, tokenizing, storing, fan-out to the engines) ever
# works on an unbounded list. The body itself is capped first (`--max-body-bytes`).

#: Chat and Anthropic messages, Responses input items: long agent sessions stay far below this.
MAX_MESSAGES = 4096
#: Tools a request may declare (OpenAI documents 128 functions).
MAX_TOOLS = 512
#: Stop strings (OpenAI accepts 4; vLLM and SGLang more).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 256
#: OpenAI's metadata rules: at most 16 pairs, keys up to 64 characters, string values up to 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
#: Items one conversation call may add (OpenAI: 20 per call); --max-conversation-items bounds the total.
MAX_ITEMS_PER_CONVERSATION_CALL = 20

#: Items one conversation may hold by default (`serve --max-conversation-items`). OpenAI documents 20
#: items per create/add call and no total; a total keeps the per-conversation index walk bounded.
DEFAULT_MAX_CONVERSATION_ITEMS = 10_000
#: Stored bytes (items as JSON) one conversation may hold by default (`serve --max-conversation-bytes`):
#: the default request body cap, about fifteen times what a 131k-token context can show of it.
DEFAULT_MAX_CONVERSATION_BYTES = 8 * 1024 * 1024
#: The error code of an append refused by `ConversationLimits`.
CONVERSATION_TOO_LARGE = "conversation_too_large"


@dataclass(frozen=True, slots=True)
class ConversationLimits:
    """Caps on one conversation's items, checked by the store against what it holds on every append,
    under the same lock that orders the append: concurrent writers cannot together pass them."""

    max_items: int = DEFAULT_MAX_CONVERSATION_ITEMS
    max_bytes: int = DEFAULT_MAX_CONVERSATION_BYTES

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_bytes < 1:
            raise ValueError("conversation limits must be at least 1")

    def check(self, held: ConversationSize, adding: ConversationSize, *, param: str = "items") -> None:
        """Raise errors.InvalidRequest (code `conversation_too_large`, `param`) if `held + adding`
        passes a cap; an empty append always passes."""
        if not adding.items:
            return
        for unit, held_count, added, cap in (
            ("items", held.items, adding.items, self.max_items),
            ("bytes of items", held.bytes, adding.bytes, self.max_bytes),
        ):
            if held_count + added > cap:
                raise errors.InvalidRequest(
                    f"the conversation holds {held_count} {unit} and this adds {added}; a conversation "
                    f"holds at most {cap}: start a new one",
                    param=param,
                    code=CONVERSATION_TOO_LARGE,
                )


@dataclass(frozen=True, slots=True)
class ConversationSize:
    """How many items a conversation holds and their stored size (each item's JSON, UTF-8 bytes)."""

    items: int = 0
    bytes: int = 0

    def __add__(self, other: ConversationSize) -> ConversationSize:
        return ConversationSize(self.items + other.items, self.bytes + other.bytes)


# Text that openai-harmony's own encoder tokenizes (the developer message: instructions, tool descriptions
# and schemas, response formats). Its pre-tokenizer panics on a run of about a million characters it
# cannot split (fancy-regex's backtracking stack), so each is capped well under that; OpenAI documents
# no cap for these, and agent clients send tool descriptions far over its 1,024 for Chat functions.

#: Responses `instructions` (system messages are checked as they are rendered).
MAX_INSTRUCTIONS_CHARS = 256 * 1024
#: One tool's (or tool namespace's) description.
MAX_TOOL_DESCRIPTION_CHARS = 64 * 1024
#: One JSON schema (a tool's parameters, a response format), as compact JSON.
MAX_SCHEMA_CHARS = 256 * 1024


def at_most(limit: int, what: str) -> BeforeValidator:
    """A list field with more than `limit` entries is refused before any entry is validated, so a
    million-item list costs one `len()`, and the error names the field, not a union member."""

    def check(value: Any) -> Any:
        if isinstance(value, list) and len(value) > limit:
            raise ValueError(f"at most {limit} {what} are accepted, got {len(value)}")
        return value

    return BeforeValidator(check)


def within_history_bound(parts_of: Callable[[dict[str, Any]], int], parts: str) -> BeforeValidator:
    """A messages list holds at most MAX_MESSAGES messages and `parts` together, counted before any
    message is validated. `parts_of(message)` counts what a message holds that becomes a prompt message of
    its own (a tool call, a tool result block), as each Responses `function_call` item counts as an input
    item: a few messages listing tens of thousands of calls are no cheaper to validate, convert, restore
    and render than as many messages."""

    def check(messages: Any) -> Any:
        if isinstance(messages, list):
            held = sum(parts_of(message) for message in messages if isinstance(message, dict))
            if len(messages) + held > MAX_MESSAGES:
                raise ValueError(
                    f"at most {MAX_MESSAGES} messages and {parts} together are accepted, got "
                    f"{len(messages)} messages with {held} {parts}"
                )
        return messages

    return BeforeValidator(check)


def _check_stop(value: Any) -> Any:
    strings = [value] if isinstance(value, str) else value
    if isinstance(strings, list):
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, got {len(strings)}")
        if any(isinstance(s, str) and len(s) > MAX_STOP_STRING_CHARS for s in strings):
            raise ValueError(f"stop strings are at most {MAX_STOP_STRING_CHARS} characters")
    return value


#: `stop` (a string or a list of them) and Anthropic's `stop_sequences`.
StopParam = Annotated[str | list[str], BeforeValidator(_check_stop)]
StopStrings = Annotated[list[str], BeforeValidator(_check_stop)]


def _check_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"metadata holds at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"metadata keys are at most {MAX_METADATA_KEY_CHARS} characters")
        if not isinstance(item, str):
            raise ValueError(f"metadata values must be strings (key {key[:64]!r})")
        if len(item) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(f"metadata values are at most {MAX_METADATA_VALUE_CHARS} characters")
    return value


#: OpenAI's `metadata` object: checked as OpenAI checks it.
Metadata = Annotated[dict[str, Any] | None, AfterValidator(_check_metadata)]


def schema_too_large(schema: Any) -> bool:
    """True when `schema` is over MAX_SCHEMA_CHARS as compact JSON. One nested too deep to serialize is
    left to the renderer, which names the tool it cannot describe."""
    try:
        return len(orjson.dumps(schema)) > MAX_SCHEMA_CHARS
    except orjson.JSONEncodeError:
        return False


def _check_schema(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None and schema_too_large(value):
        raise ValueError(f"JSON schemas are at most {MAX_SCHEMA_CHARS} characters as JSON")
    return value


#: A tool's JSON schema (Chat `parameters`, Anthropic `input_schema`), capped at MAX_SCHEMA_CHARS.
Schema = Annotated[dict[str, Any] | None, AfterValidator(_check_schema)]
#: A tool's description, capped at MAX_TOOL_DESCRIPTION_CHARS.
ToolDescriptionText = Annotated[str | None, Field(max_length=MAX_TOOL_DESCRIPTION_CHARS)]

#: Bodies up to this size are decoded and validated on the event loop (well under a millisecond);
#: larger ones in a thread, so one big request never delays the others' streams.
LOOP_BODY_BYTES = 256 * 1024
