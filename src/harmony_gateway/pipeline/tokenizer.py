"""Tokenizers of non-Harmony models, read from their files (`pipeline/tokenizer_cache.py` loads them once
per model and keeps them in `GatewayState.tokenizers`).

Sources, first that applies: the folder given with `--tokenizer MODEL=DIR`; the engine's reported
`tokenizer_path` when it is a folder on this host; the engine's `GetTokenizer` RPC (SGLang gRPC: a zip
of the tokenizer files streamed in chunks, the SHA-256 on the last one). A folder (or zip) holds
`tokenizer.json` (HF `tokenizers`) and `tokenizer_config.json` (`chat_template`, `bos_token`,
`eos_token`); a `chat_template.jinja` or `chat_template.json` file beside them wins, as in transformers.

Loading parses a multi-megabyte JSON file, so it runs in a worker thread; concurrent first requests for
a model share one load. A failure is not cached: the next request tries again. Raises `UpstreamError`
when no source is available or the files are unusable (a deployment problem, not the client's).

Only a chat template's own markup becomes control tokens (`ControlTokens`: the special ones, and
added tokens matched verbatim such as `<tool_call>` or DeepSeek's `<｜User｜>`). Text a request supplies
is passed through `ModelTokenizer.disarm` before the template sees it: each control token's text in it
is broken with `TOKEN_BREAK`, and `encode_rendered` encodes whatever is not an intact control token as
plain text, so `hello<|im_end|><|im_start|>system` in a message is the text it spells, never a forged
turn (as the Harmony renderer encodes message text between its own special tokens).
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UpstreamError

if TYPE_CHECKING:
    from tokenizers import AddedToken, Tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")

#: Put inside each control token's text found in request text, so the rendered prompt holds it broken
#: and it encodes as text. U+FDD0 is a Unicode noncharacter: reserved for a process's internal use, it
#: means nothing in text, and one arriving in a request is replaced by U+FFFD.
TOKEN_BREAK = "\ufdd0"
#: What `tokenizers` strips beside an `lstrip`/`rstrip` added token: Rust's `char::is_whitespace`
#: (Python's `str.isspace` also counts U+001C..U+001F).
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
    "\u200a\u2028\u2029\u202f\u205f\u3000"
)


def _token_content(value: Any) -> str | None:
    """`bos_token` / `eos_token` are strings or serialised AddedTokens (`{"content": ...}`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _longest_match_pattern(texts: Iterable[str]) -> re.Pattern[str]:
    """A regex matching any of `texts`, the longest where several start at one place, built as a trie:
    a flat alternation of thousands of tokens (Gemma's `<unusedN>`) takes seconds per megabyte."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a token ends here

    def source(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + source(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer token wins

    return re.compile(source(trie))


def is_control(token: AddedToken) -> bool:
    """Whether request text must not produce `token`: a special token, or an added token matched
    verbatim (`normalized: false`: `<tool_call>`, `<think>`, DeepSeek's `<｜User｜>`, which are not
    flagged special). Whitespace runs and single characters added that way are text (Gemma's `\n\n`)."""
    if token.special:
        return True
    text = token.content
    return not token.normalized and len(text) > 1 and not text.isspace()


@dataclass(frozen=True, slots=True)
class ControlTokens:
    """The added tokens only a template may write (`is_control`), as the encoder splits text on them."""

    ids: dict[str, int]
    #: Any control token's text, the longest at a place; None when the tokenizer has none.
    pattern: re.Pattern[str] | None
    lstrip: frozenset[str]
    rstrip: frozenset[str]
    #: Proper prefixes and suffixes of the tokens: request text ending (starting) with one could form
    #: a control token with whatever the template writes after (before) it.
    heads: frozenset[str]
    tails: frozenset[str]
    #: The characters the tokens start and end with: text holds a head (tail) only near one of them.
    firsts: frozenset[str]
    lasts: frozenset[str]
    longest: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ControlTokens:
        added = [
            t for _, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.content and is_control(t)
        ]
        ids = {}
        for token in added:
            token_id = tokenizer.token_to_id(token.content)
            if token_id is not None:
                ids[token.content] = token_id
        return cls(
            ids=ids,
            pattern=_longest_match_pattern(ids) if ids else None,
            lstrip=frozenset(t.content for t in added if t.lstrip),
            rstrip=frozenset(t.content for t in added if t.rstrip),
            heads=frozenset(t[:k] for t in ids for k in range(1, len(t))),
            tails=frozenset(t[k:] for t in ids for k in range(1, len(t))),
            firsts=frozenset(t[0] for t in ids),
            lasts=frozenset(t[-1] for t in ids),
            longest=max(map(len, ids), default=0),
        )

    def may_complete(self, text: str) -> tuple[bool, bool]:
        """Whether `text` ends with a head and whether it starts with a tail."""
        reach = min(self.longest - 1, len(text))
        end, start = text[len(text) - reach :], text[:reach]
        ends = any(c in end for c in self.firsts) and any(
            text[-k:] in self.heads for k in range(1, reach + 1)
        )
        starts = any(c in start for c in self.lasts) and any(
            text[:k] in self.tails for k in range(1, reach + 1)
        )
        return ends, starts


def _break_token(match: re.Match[str]) -> str:
    """A break after every character, the last included: a token overlapping this one ("<|a|>" and
    "|>x" in "<|a|>x") is broken too, in the same pass."""
    token = match.group()
    if len(token) == 1:
        return "\ufffd"  # a one-character special token cannot be broken, only dropped
    return TOKEN_BREAK.join(token) + TOKEN_BREAK


@dataclass(eq=False)
class ModelTokenizer:
    """A model's tokenizer and chat template. `chat_template` is one template, or named templates
    (`{"default": ..., "tool_use": ...}`) as transformers allows."""

    tokenizer: Tokenizer
    chat_template: str | dict[str, str] | None
    bos_token: str | None = None
    eos_token: str | None = None
    source: str = ""
    _token_texts: dict[int, str] = field(default_factory=dict)
    #: Compiled templates, by name (filled by `pipeline.chat_template`).
    compiled: dict[str, Any] = field(default_factory=dict)
    controls: ControlTokens = field(init=False)
    #: A copy of `tokenizer` that encodes control tokens' text as text: they are flagged special in it
    #: and `encode_special_tokens` is set, a flag per tokenizer, not per call (the shared one is used
    #: by several threads at once).
    _plain: Tokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.controls = ControlTokens.of(self.tokenizer)
        data = json.loads(self.tokenizer.to_str())
        for entry in data.get("added_tokens") or ():
            if entry.get("content") in self.controls.ids:
                entry["special"] = True
        self._plain = type(self.tokenizer).from_str(json.dumps(data))
        self._plain.encode_special_tokens = True

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str) -> list[int]:
        """Ids of text whose control tokens' text is meant as those tokens (no request text in it)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids

    def disarm(self, text: str) -> str:
        """Request text as a template may place it: every control token's text in it broken with
        `TOKEN_BREAK`, and a break at an end that could complete one with the template's text."""
        if TOKEN_BREAK in text:
            text = text.replace(TOKEN_BREAK, "\ufffd")
        controls = self.controls
        if controls.pattern is None:
            return text
        text = controls.pattern.sub(_break_token, text)
        ends_with_head, starts_with_tail = controls.may_complete(text)
        return f"{TOKEN_BREAK if starts_with_tail else ''}{text}{TOKEN_BREAK if ends_with_head else ''}"

    def encode_rendered(self, rendered: str) -> list[int]:
        """Ids of a template's output whose request text went through `disarm`: intact control tokens'
        text (the template's markup) becomes their ids, everything between them plain text."""
        if TOKEN_BREAK not in rendered:
            return self.encode(rendered)  # no request text held a control token's text
        controls = self.controls
        if controls.pattern is None:
            return self._encode_plain(rendered)
        ids: list[int] = []
        start, strip_head = 0, False
        for match in controls.pattern.finditer(rendered):
            token = match.group()
            text = rendered[start : match.start()]
            if strip_head:
                text = text.lstrip(_WHITESPACE)
            if token in controls.lstrip:
                text = text.rstrip(_WHITESPACE)
            ids += self._encode_plain(text)
            ids.append(controls.ids[token])
            start, strip_head = match.end(), token in controls.rstrip
        tail = rendered[start:]
        ids += self._encode_plain(tail.lstrip(_WHITESPACE) if strip_head else tail)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = self._plain.encode(text.replace(TOKEN_BREAK, ""), add_special_tokens=False).ids
        return ids

    def token_text(self, token_id: int) -> str:
        """One token's text (for logprobs), special tokens included; cached per id."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_texts) < 65536:
                self._token_texts[token_id] = text
        return text


def tokenizer_from_files(files: Mapping[str, bytes], source: str) -> ModelTokenizer:
    """Build a `ModelTokenizer` from file contents by base name (`TOKENIZER_FILES`)."""
    if "tokenizer.json" not in files:
        raise UpstreamError(f"no tokenizer.json in {source}")
    try:
        from tokenizers import Tokenizer  # lazy: only models served with a chat template need it (~5 MB)

        tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
    except Exception as exc:
        raise UpstreamError(f"tokenizer.json in {source} cannot be loaded: {exc}") from exc
    config: dict[str, Any] = {}
    if "tokenizer_config.json" in files:
        try:
            config = json.loads(files["tokenizer_config.json"])
        except ValueError as exc:
            raise UpstreamError(f"tokenizer_config.json in {source} is not JSON: {exc}") from exc
    template: Any = config.get("chat_template")
    if "chat_template.jinja" in files:
        template = files["chat_template.jinja"].decode()
    elif "chat_template.json" in files:
        try:
            template = json.loads(files["chat_template.json"]).get("chat_template", template)
        except ValueError as exc:
            raise UpstreamError(f"chat_template.json in {source} is not JSON: {exc}") from exc
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    return ModelTokenizer(
        tokenizer=tokenizer,
        chat_template=template,
        bos_token=_token_content(config.get("bos_token")),
        eos_token=_token_content(config.get("eos_token")),
        source=source,
    )


def load_folder(folder: str | os.PathLike[str]) -> ModelTokenizer:
    path = Path(folder)
    if not path.is_dir():
        raise UpstreamError(f"tokenizer folder {str(path)!r} does not exist")
    files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES if (path / name).is_file()}
    return tokenizer_from_files(files, str(path))


def load_zip(data: bytes, source: str) -> ModelTokenizer:
    """Tokenizer files from a zip (any folder depth; the shallowest copy of each file wins)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as exc:
        raise UpstreamError(f"the tokenizer sent by {source} is not a zip archive") from exc
    files: dict[str, bytes] = {}
    depth: dict[str, int] = {}
    with archive:
        for info in archive.infolist():
            name = info.filename.rsplit("/", 1)[-1]
            level = info.filename.count("/")
            if name in TOKENIZER_FILES and level < depth.get(name, 1 << 30):
                files[name] = archive.read(info)
                depth[name] = level
    return tokenizer_from_files(files, source)
