"""The simulated model: a deterministic function from prompt token ids to output token ids.

`HarmonyScript.reply(input_ids, choice)` reads a Harmony prompt (as openai-harmony renders it, ending in
`<|start|>assistant`) and answers with the tokens gpt-oss would plausibly sample, chosen by these rules:

1. The last user-or-tool message is a tool result: an analysis message, then a final answer quoting the
   tool output (up to 200 characters), closed with `<|return|>`.
2. Otherwise, if the last user message names a declared tool (its bare name, as a whole word): an analysis
   message, then `<|start|>assistant<|channel|>commentary to=NS.NAME <|constrain|>json<|message|>{args}<|call|>`.
   Tools come from every `namespace NS { ... }` block of the system and developer messages; built-in
   namespaces (declared in the system message, e.g. `browser`) are called on the `analysis` channel.
   Arguments fill every parameter: string → the word after "for"/"in" in the user message (else "sim"),
   number → 1, boolean → true, enum → its first value, array → [], object → {}. With several tools named,
   the one mentioned first wins.
3. Otherwise: an analysis message ("The user wrote N words. ...") and a final answer echoing the start of
   the user message (`You said: "...". This is a simulated answer.`), closed with `<|return|>`.
4. A prompt that ends inside an open assistant `final` message (`...<|start|>assistant<|channel|>final<|message|>`,
   as the gateway sends to continue after a reasoning budget) is continued: rule 3's answer text only, then
   `<|return|>`, with no analysis or header.
5. The last user message asks for a context checkpoint (it says "context checkpoint", as the gateway's
   compaction request and Codex's local compaction prompt do): an analysis message, then a final summary
   quoting the earlier user messages (up to 60 characters each) and the last tool output (up to 200), with
   the names of declared and called tools left out (so a client that hands the summary back as a user message does
   not set off rule 2 again); triggers are read from the user message before the request. Continued as
   in rule 4 when the prompt ends inside the summary's open `final` message.

Triggers in the last user message exercise edge cases (`TRIGGERS`):
`[[long]]` ~400-token analysis; `[[preamble]]` a recipient-less commentary message before the final;
`[[unicode]]` a final with CJK and emoji whose tokens split UTF-8 sequences; `[[trailing]]` the final
closed with `<|end|>` and then `<|return|>` (vllm#50690); `[[refusal]]` a `<|channel|>final` header with no
`<|message|>` (openai/harmony#80); `[[junk]]` output that is not Harmony at all; `[[two_calls]]` two call
messages, the first closed with `<|end|>` (calls the first two named tools, or the one named tool twice).
Malformed shapes real gpt-oss output takes (`MALFORMED_TRIGGERS`; the answer, when there is one, is rule 3's):
`[[bad_header]]` a message under `<|channel|>––commentary` (openai/harmony#38) before the final;
`[[unknown_channel]]` a message on an invented `thoughts` channel before the final; `[[doubled_start]]`
the final opened by `<|start|>assistant<|start|>assistant`; `[[stray_text]]` text between the analysis
and the final; `[[bare_refusal]]` a refusal with neither channel nor `<|message|>`
(`<|start|>assistant I'm sorry...`, openai/harmony#80); `[[return_after_analysis]]` the reply ends with
`<|return|>` right after the analysis (vllm#46464); `[[cut]]` the final without any end token.
Tool loops (variants of rule 1, after a tool result): `[[sequence]]` calls the next named tool not yet
called since the last user message (then answers); `[[repeat]]` calls the first named tool again unless the
last tool output mentions `max_tool_calls` (a model obeying the gateway's limit message); `[[stubborn]]`
calls it again regardless; `[[bad_json]]` writes a call's arguments as invalid JSON; `[[required]]` fills only
the required parameters (agent tools such as Codex's `exec_command` have optional ones a client acts on). A `## python` section
of the system message declares the built-in `python` tool, called as `analysis to=python code` with
`print("WORD")`.
Choice i > 0 of an n > 1 request carries ` (choice i)` in its text. `output_tokens` pads or trims the
analysis and final text so the whole reply has that many tokens when the fixed parts allow it.

`echo_reply` is the non-Harmony model: the prompt ids reversed (at most 32), then the EOS id. With a
tokenizer folder (`SimConfig.tokenizer_path`) it is `TextScript` instead: scripted reply texts chosen by
trigger strings in the prompt, encoded with that tokenizer.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from harmony_gateway.harmony.encoding import CALL, END, MESSAGE, RETURN, START, get_encoding

TRIGGERS: tuple[str, ...] = (
    "[[long]]",
    "[[preamble]]",
    "[[unicode]]",
    "[[trailing]]",
    "[[refusal]]",
    "[[junk]]",
    "[[two_calls]]",
    "[[sequence]]",
    "[[repeat]]",
    "[[stubborn]]",
    "[[bad_json]]",
    "[[required]]",
    "[[bad_header]]",
    "[[unknown_channel]]",
    "[[doubled_start]]",
    "[[stray_text]]",
    "[[bare_refusal]]",
    "[[return_after_analysis]]",
    "[[cut]]",
)
MALFORMED_TRIGGERS: tuple[str, ...] = TRIGGERS[-7:]
#: Text the malformed shapes put where it is not answer text (never expected in a client's answer field).
MISPLACED_TEXT = "Hidden notes"
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_TERMINATORS = frozenset({END, CALL, RETURN})
_TOOL_OUTPUT_QUOTE = 200
_ECHO_CHARS = 60
_ANALYSIS_FILLER = " Thinking"  # one token each: padding never changes the token count arithmetic
_FINAL_FILLER = " More"
_LONG_SENTENCE = " Let me think about this request step by step and check every detail once more."
_UNICODE_TEXT = "Unicode check: 你好，世界 🌍🚀 — naïve café ✓ 漢字テスト. "
_REFUSAL_TEXT = "I'm sorry, but I can't help with that."

_NAMESPACE_RE = re.compile(r"namespace ([^\s{}]+) \{\n(.*?)\n\} // namespace \1", re.DOTALL)
_TOOL_RE = re.compile(r"^type ([^\s=]+) = \((.*?)\) => any;", re.DOTALL | re.MULTILINE)
_PARAM_RE = re.compile(r"^([^\s:?/|]+)(\?)?:\s*(.*)$")
_WORD_AFTER_RE = re.compile(r"\b(?:for|in)\s+([^\s.,;:!?\"'()\[\]]+)(?:\s+([^\s.,;:!?\"'()\[\]]+))?", re.I)
_TRIGGER_RE = re.compile(r"\[\[[a-z_]+\]\]")
_ARTICLES = frozenset({"the", "a", "an"})
#: What a request for a conversation summary says (rule 5).
CHECKPOINT = "context checkpoint"


@dataclass(frozen=True, slots=True)
class ToolParam:
    """One top-level parameter of a declared tool; `type` is the TypeScript text harmony rendered."""

    name: str
    type: str
    required: bool


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool declared in a `namespace NS { ... }` block; `builtin` when the system message declared it."""

    namespace: str
    name: str
    params: tuple[ToolParam, ...] = ()
    builtin: bool = False

    @property
    def recipient(self) -> str:
        # A freeform built-in (`python`) is a namespace without tools: its recipient is the bare name.
        return self.namespace if self.freeform else f"{self.namespace}.{self.name}"

    @property
    def freeform(self) -> bool:
        return self.name == self.namespace


@dataclass(frozen=True, slots=True)
class PromptSummary:
    """What the script needs from a prompt: the last user/tool message and the declared tools.

    `last_role` is "user", "tool" or "" (no such message, or a prompt that is not Harmony).
    """

    last_role: str = ""
    user_text: str = ""
    tool_author: str = ""
    tool_output: str = ""
    tools: tuple[ToolSpec, ...] = ()
    #: Channel of an assistant message the prompt leaves open (rule 4), else "".
    open_channel: str = ""
    #: Recipients of the assistant's tool calls since the last user message, in order.
    called: tuple[str, ...] = ()
    #: Every user message's text, in order (the last is `user_text`).
    user_texts: tuple[str, ...] = ()
    #: Recipients of every tool call the assistant made in the prompt.
    ever_called: frozenset[str] = frozenset()

    @property
    def checkpoint(self) -> bool:
        """The last user message asks for a context checkpoint (rule 5)."""
        return self.last_role == "user" and CHECKPOINT in self.user_text.lower()

    @property
    def triggers(self) -> frozenset[str]:
        return frozenset(t for t in TRIGGERS if t in self.user_text)


def parse_tool_namespaces(text: str, *, builtin: bool = False) -> tuple[ToolSpec, ...]:
    """Tools of every `namespace NS { ... } // namespace NS` block in a rendered system/developer text,
    plus the freeform `python` built-in when a system text has a `## python` section."""
    tools = tuple(
        ToolSpec(ns_match.group(1), tool_match.group(1), _parse_params(tool_match.group(2)), builtin)
        for ns_match in _NAMESPACE_RE.finditer(text)
        for tool_match in _TOOL_RE.finditer(ns_match.group(2))
    )
    if builtin and "\n## python\n" in text:
        tools += (ToolSpec("python", "python", (), True),)
    return tools


def _parse_params(signature: str) -> tuple[ToolParam, ...]:
    signature = signature.strip()
    if not signature.startswith("_:"):
        return ()
    body = signature[2:].strip()
    if body.startswith("{"):
        body = body[1:]
    if body.endswith("}"):
        body = body[:-1]
    params: list[ToolParam] = []
    lines = body.split("\n")
    depth = 0
    for i, line in enumerate(lines):
        stripped = line.strip()
        if depth == 0 and stripped and not stripped.startswith(("//", "|", ",")):
            match = _PARAM_RE.match(stripped)
            if match:
                type_text = _strip_type(match.group(3))
                if not type_text:
                    # Unions of object-ish members render one alternative per line: `y?:\n | string\n | number\n,`
                    alternatives = []
                    for follow in lines[i + 1 :]:
                        follow = follow.strip()
                        if not follow.startswith("|"):
                            break
                        alternatives.append(follow[1:].strip())
                    type_text = " | ".join(alternatives)
                params.append(ToolParam(match.group(1), type_text, match.group(2) is None))
        depth += line.count("{") + line.count("[") - line.count("}") - line.count("]")
        depth = max(depth, 0)
    return tuple(params)


def _strip_type(text: str) -> str:
    if " // " in text:
        text = text.split(" // ", 1)[0]
    return text.strip().rstrip(",").strip()


def example_value(type_text: str, word: str) -> object:
    """A deterministic argument value for one TypeScript type (see rule 2 in the module docstring)."""
    alternatives = [a.strip() for a in type_text.split("|")]
    alternatives = [a for a in alternatives if a and a != "null"]
    first = alternatives[0] if alternatives else "any"
    if first.startswith('"'):
        try:
            return json.loads(first)
        except ValueError:
            return first.strip('"')
    if first.endswith("[]") or first.startswith("Array<"):
        return []
    if first.startswith("{"):
        return {}
    if first == "number":
        return 1
    if first == "boolean":
        return True
    if first in ("true", "false"):
        return first == "true"
    try:
        return int(first)
    except ValueError:
        pass
    return word


def argument_word(user_text: str) -> str:
    """The word after the first "for"/"in" (skipping an article), else "sim"."""
    match = _WORD_AFTER_RE.search(user_text)
    if not match:
        return "sim"
    word = match.group(1)
    if word.lower() in _ARTICLES and match.group(2):
        word = match.group(2)
    return word


def build_arguments(tool: ToolSpec, user_text: str, *, required_only: bool = False) -> dict[str, object]:
    word = argument_word(user_text)
    return {
        param.name: example_value(param.type, word)
        for param in tool.params
        if param.required or not required_only
    }


def mentioned_tools(tools: Sequence[ToolSpec], user_text: str) -> list[ToolSpec]:
    """Declared tools whose bare name occurs in the text as a whole word, in order of first mention."""
    found: list[tuple[int, int, ToolSpec]] = []
    for order, tool in enumerate(tools):
        match = re.search(rf"(?<![\w.]){re.escape(tool.name)}(?!\w)", user_text)
        if match:
            found.append((match.start(), order, tool))
    found.sort(key=lambda item: (item[0], item[1]))
    return [tool for _, _, tool in found]


def _recipient_of(header: str) -> str:
    """The `to=` recipient of a decoded message header, or ""."""
    at = header.find(" to=")
    if at < 0:
        return ""
    return header[at + 4 :].split("<|", 1)[0].split(" ", 1)[0].strip()


def echo_reply(input_ids: Sequence[int], eos_token_id: int, limit: int = 32) -> list[int]:
    """The non-Harmony model's answer: the prompt ids reversed (EOS ids dropped, at most `limit`), then EOS."""
    echoed = [t for t in reversed(input_ids) if t != eos_token_id][:limit]
    echoed.append(eos_token_id)
    return echoed


class TextScript:
    """A non-Harmony model with a real tokenizer: `reply(input_ids)` → the ids of a scripted text, then EOS.

    `replies` pairs (trigger, text): the pair whose trigger occurs last in the decoded prompt wins, so in a
    multi-turn prompt the latest turn decides (an empty trigger matches at the start). Without a match the
    answer is `You said: "<the prompt's last 60 characters>".`. Tags such as `<think>` or `<tool_call>` in a
    reply text become whatever ids the tokenizer gives them.
    """

    def __init__(self, tokenizer_path: str, replies: Sequence[tuple[str, str]], eos_token_id: int) -> None:
        from pathlib import Path

        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
        self._replies = tuple(replies)
        self._eos = eos_token_id

    def reply_text(self, input_ids: Sequence[int]) -> str:
        prompt = self._tokenizer.decode(list(input_ids), skip_special_tokens=False)
        best, best_at = None, -1
        for trigger, text in self._replies:
            at = prompt.rfind(trigger) if trigger else 0
            if at > best_at:
                best, best_at = text, at
        if best is None:
            return f'You said: "{prompt[-_ECHO_CHARS:]}".'
        return best

    def reply(self, input_ids: Sequence[int]) -> list[int]:
        ids: list[int] = self._tokenizer.encode(self.reply_text(input_ids), add_special_tokens=False).ids
        return [*ids, self._eos]


def _clean_user_text(text: str) -> str:
    return " ".join(_TRIGGER_RE.sub(" ", text).split())


@lru_cache(maxsize=1)
def _ordinary_encoder() -> Callable[[str], list[int]]:
    """Encoder for text without special tokens.

    quicktok's o200k_base gives the same ids as the Harmony encoding for ordinary text at a hundredth of
    the cost (REFERENCE.md 1.4), which matters because the sim shares a 2-core box with the gateway.
    """
    encoding = get_encoding()
    probe = "Hello world, 你好 🌍 — test"
    try:
        import quicktok

        fast = quicktok.get_encoding("o200k_base").encode_ordinary
        if list(fast(probe)) == list(encoding.encode(probe, allowed_special="all")):
            return lambda text: list(fast(text))
    except Exception:  # any failure only means the slower, exact encoder is used
        pass
    return lambda text: list(encoding.encode(text, allowed_special="all"))


@lru_cache(maxsize=4096)
def _special(text: str) -> tuple[int, ...]:
    """Tokens of a fixed string that contains special-token text (headers); cached per string."""
    return tuple(get_encoding().encode(text, allowed_special="all"))


@lru_cache(maxsize=256)
def _fixed_text(text: str) -> tuple[int, ...]:
    return tuple(_ordinary_encoder()(text))


class _Draft:
    """A reply under construction: fixed token runs and paddable text runs."""

    def __init__(self) -> None:
        self.pieces: list[tuple[list[int], int | None]] = []

    def fixed(self, ids: Sequence[int]) -> None:
        self.pieces.append((list(ids), None))

    def text(self, ids: Sequence[int], filler: str) -> None:
        self.pieces.append((list(ids), _fixed_text(filler)[0]))

    def finish(self, target: int | None) -> list[int]:
        slots = [i for i, (_, filler) in enumerate(self.pieces) if filler is not None]
        total = sum(len(ids) for ids, _ in self.pieces)
        if target is not None and slots and target != total:
            if target > total:
                extra = target - total
                first, last = slots[0], slots[-1]
                shares = {first: extra // 2, last: extra - extra // 2} if first != last else {first: extra}
                for slot, count in shares.items():
                    ids, filler = self.pieces[slot]
                    assert filler is not None
                    ids.extend([filler] * count)
            else:
                excess = total - target
                for slot in reversed(slots):
                    ids, _ = self.pieces[slot]
                    cut = min(excess, len(ids) - 1)
                    if cut > 0:
                        del ids[len(ids) - cut :]
                        excess -= cut
                    if excess == 0:
                        break
        out: list[int] = []
        for ids, _ in self.pieces:
            out.extend(ids)
        return out


class HarmonyScript:
    """Deterministic gpt-oss stand-in: `reply(input_ids, choice)` → output token ids (rules in the module doc).

    Never raises on junk input: a prompt that cannot be read is answered with a plain final message.
    Replies and the tools of repeated system/developer messages are cached (bounded LRU).
    """

    def __init__(self, output_tokens: int | None = None, cache_size: int = 512) -> None:
        self._encoding = get_encoding()
        self._encode = _ordinary_encoder()
        self._output_tokens = output_tokens
        self._cache_size = cache_size
        self._replies: OrderedDict[Hashable, list[int]] = OrderedDict()
        self._tools: OrderedDict[tuple[bool, tuple[int, ...]], tuple[ToolSpec, ...]] = OrderedDict()

    def reply(self, input_ids: Sequence[int], choice: int = 0, key: Hashable | None = None) -> list[int]:
        """Output ids for one choice; `key` (e.g. `tuple(input_ids)`) enables the reply cache."""
        if key is not None:
            cache_key = (key, choice)
            cached = self._replies.get(cache_key)
            if cached is not None:
                self._replies.move_to_end(cache_key)
                return cached
        summary = self.summarize(input_ids)
        ids = self.reply_for(summary, choice)
        if key is not None:
            self._replies[cache_key] = ids
            if len(self._replies) > self._cache_size:
                self._replies.popitem(last=False)
        return ids

    # -- reading the prompt -------------------------------------------------------------------------

    def summarize(self, input_ids: Sequence[int]) -> PromptSummary:
        try:
            return self._summarize(list(input_ids))
        except Exception:
            return PromptSummary()

    def _summarize(self, ids: list[int]) -> PromptSummary:
        starts: list[int] = []
        pos = 0
        try:
            while True:
                pos = ids.index(START, pos)
                starts.append(pos)
                pos += 1
        except ValueError:
            pass
        decode = self._encoding.decode
        tools: list[ToolSpec] = []
        last_user = ""
        last_role = ""
        tool_author = ""
        tool_output = ""
        open_channel = ""
        called: list[str] = []
        user_texts: list[str] = []
        ever_called: set[str] = set()
        for n, start in enumerate(starts):
            end = starts[n + 1] if n + 1 < len(starts) else len(ids)
            segment = ids[start + 1 : end]
            try:
                split = segment.index(MESSAGE)
            except ValueError:
                continue  # a bare header, such as the trailing `<|start|>assistant`
            header = decode(segment[:split])
            content = segment[split + 1 :]
            terminated = bool(content) and content[-1] in _TERMINATORS
            if terminated:
                content = content[:-1]
            author = header.split("<|", 1)[0].split(" ", 1)[0].strip()
            if author == "assistant" and n == len(starts) - 1 and not terminated and "<|channel|>" in header:
                open_channel = header.split("<|channel|>", 1)[1].split("<|", 1)[0].split(" ", 1)[0].strip()
            if author in ("system", "developer"):
                tools.extend(self._declared_tools(author == "system", content))
            elif author == "user":
                last_user = decode(content)
                user_texts.append(last_user)
                last_role = "user"
                called.clear()
            elif author == "assistant":
                recipient = _recipient_of(header)
                if recipient:
                    called.append(recipient)
                    ever_called.add(recipient)
            elif author not in _ROLES and author:
                last_role = "tool"
                tool_author = author
                tool_output = decode(content)
        return PromptSummary(
            last_role,
            last_user,
            tool_author,
            tool_output,
            tuple(tools),
            open_channel,
            tuple(called),
            tuple(user_texts),
            frozenset(ever_called),
        )

    def _declared_tools(self, builtin: bool, content: list[int]) -> tuple[ToolSpec, ...]:
        key = (builtin, tuple(content))
        cached = self._tools.get(key)
        if cached is None:
            text = self._encoding.decode(content)
            declares = "namespace " in text or (builtin and "## python" in text)
            cached = parse_tool_namespaces(text, builtin=builtin) if declares else ()
            self._tools[key] = cached
            if len(self._tools) > self._cache_size:
                self._tools.popitem(last=False)
        return cached

    # -- writing the reply --------------------------------------------------------------------------

    def reply_for(self, summary: PromptSummary, choice: int = 0) -> list[int]:
        if summary.checkpoint:
            return self._checkpoint(summary, choice)
        triggers = summary.triggers
        suffix = f" (choice {choice})" if choice else ""
        user = _clean_user_text(summary.user_text)
        draft = _Draft()
        if summary.open_channel == "final":
            answer = f'You said: "{user[:_ECHO_CHARS]}". This is a simulated answer.{suffix}'
            draft.text(self._encode(answer), _FINAL_FILLER)
            draft.fixed([RETURN])
            return draft.finish(self._output_tokens)
        if summary.last_role == "tool":
            follow_up = self._follow_up_tool(summary, user, triggers)
            if follow_up is not None:
                self._analysis(
                    draft,
                    f"The tool {summary.tool_author} returned. I will call {follow_up.recipient}.{suffix}",
                    triggers,
                )
                self._call(draft, follow_up, user, CALL, bad_json="[[bad_json]]" in triggers)
                return draft.finish(self._output_tokens)
            output = " ".join(summary.tool_output.split())[:_TOOL_OUTPUT_QUOTE]
            self._analysis(
                draft, f"The tool {summary.tool_author} returned a result. I will relay it.", triggers
            )
            self._final(draft, f'The tool {summary.tool_author} returned: "{output}".{suffix}', triggers)
            return draft.finish(self._output_tokens)
        if "[[junk]]" in triggers:
            draft.fixed(_special("<|message|><|message|>this is not harmony<|start|><|start|><|end|><|end|>"))
            draft.fixed([RETURN])
            return draft.finish(None)
        if "[[refusal]]" in triggers:
            self._analysis(draft, f"The request is not allowed. I must refuse.{suffix}", triggers)
            draft.fixed(_special("<|start|>assistant<|channel|>final " + _REFUSAL_TEXT))
            draft.fixed([RETURN])
            return draft.finish(self._output_tokens)
        if "[[bare_refusal]]" in triggers:
            self._analysis(draft, f"The request is not allowed. I must refuse.{suffix}", triggers)
            draft.fixed(_special("<|start|>assistant " + _REFUSAL_TEXT))
            draft.fixed([RETURN])
            return draft.finish(self._output_tokens)
        if "[[return_after_analysis]]" in triggers:
            draft.fixed(_special("<|channel|>analysis<|message|>"))
            draft.text(self._encode(f"I will stop here.{suffix}"), _ANALYSIS_FILLER)
            draft.fixed([RETURN])
            return draft.finish(self._output_tokens)
        called = mentioned_tools(summary.tools, user)
        if called:
            if "[[two_calls]]" in triggers:
                pair = called[:2] if len(called) > 1 else [called[0], called[0]]
                names = " and ".join(t.recipient for t in pair)
                self._analysis(draft, f"The user mentioned two tools. I will call {names}.{suffix}", triggers)
                self._call(draft, pair[0], user, END)
                self._call(draft, pair[1], user, CALL)
            else:
                tool = called[0]
                self._analysis(
                    draft, f"The user mentioned {tool.name}. I will call {tool.recipient}.{suffix}", triggers
                )
                self._call(
                    draft,
                    tool,
                    user,
                    CALL,
                    bad_json="[[bad_json]]" in triggers,
                    required_only="[[required]]" in triggers,
                )
            return draft.finish(self._output_tokens)
        words = len(user.split())
        noun = "word" if words == 1 else "words"
        self._analysis(draft, f"The user wrote {words} {noun}. I will answer briefly.", triggers)
        if "[[preamble]]" in triggers:
            draft.fixed(_special("<|start|>assistant<|channel|>commentary<|message|>"))
            draft.fixed(_fixed_text("Let me put the answer together."))
            draft.fixed([END])
        if "[[bad_header]]" in triggers:
            draft.fixed(_special("<|start|>assistant<|channel|>––commentary<|message|>"))
            draft.fixed(_fixed_text(MISPLACED_TEXT + " under a broken header."))
            draft.fixed([END])
        if "[[unknown_channel]]" in triggers:
            draft.fixed(_special("<|start|>assistant<|channel|>thoughts<|message|>"))
            draft.fixed(_fixed_text(MISPLACED_TEXT + " on an unknown channel."))
            draft.fixed([END])
        if "[[stray_text]]" in triggers:
            draft.fixed(_fixed_text(MISPLACED_TEXT + " between messages."))
        answer = f'You said: "{user[:_ECHO_CHARS]}". This is a simulated answer.{suffix}'
        if "[[unicode]]" in triggers:
            answer = _UNICODE_TEXT + answer
        self._final(draft, answer, triggers)
        return draft.finish(self._output_tokens)

    def _checkpoint(self, summary: PromptSummary, choice: int) -> list[int]:
        """Rule 5: a summary of the conversation before the request for it."""
        earlier = summary.user_texts[:-1]
        triggers = PromptSummary(user_text=earlier[-1]).triggers if earlier else frozenset()
        if "[[junk]]" in triggers:
            draft = _Draft()
            draft.fixed(_special("<|message|><|message|>this is not harmony<|start|><|start|><|end|><|end|>"))
            draft.fixed([RETURN])
            return draft.finish(None)
        declared = {tool.name for tool in summary.tools}
        called = {recipient.rsplit(".", 1)[-1] for recipient in summary.ever_called}
        names = sorted(declared | called, key=len, reverse=True)

        def quoted(text: str, limit: int) -> str:
            text = _clean_user_text(text)
            for name in names:
                text = re.sub(rf"(?<![\w.]){re.escape(name)}(?!\w)", "a tool", text)
            return f'"{text[:limit]}"'

        said = "; ".join(quoted(text, _ECHO_CHARS) for text in earlier) or "nothing"
        text = f"Summary of the conversation: the user wrote {said}."
        if summary.tool_output:
            text += f" The last tool result was {quoted(summary.tool_output, _TOOL_OUTPUT_QUOTE)}."
        if choice:
            text += f" (choice {choice})"
        draft = _Draft()
        if summary.open_channel == "final":  # rule 4: the summary continued after a reasoning budget
            draft.text(self._encode(text), _FINAL_FILLER)
            draft.fixed([RETURN])
            return draft.finish(self._output_tokens)
        self._analysis(draft, "I am asked for a context checkpoint. I will summarize.", triggers)
        self._final(draft, text, triggers)
        return draft.finish(self._output_tokens)

    def _analysis(self, draft: _Draft, text: str, triggers: frozenset[str]) -> None:
        draft.fixed(_special("<|channel|>analysis<|message|>"))
        ids = self._encode(text)
        if "[[long]]" in triggers:
            ids.extend(_fixed_text(_LONG_SENTENCE * 26))
        draft.text(ids, _ANALYSIS_FILLER)
        draft.fixed([END])

    def _final(self, draft: _Draft, text: str, triggers: frozenset[str]) -> None:
        if "[[doubled_start]]" in triggers:
            draft.fixed(_special("<|start|>assistant"))
        draft.fixed(_special("<|start|>assistant<|channel|>final<|message|>"))
        draft.text(self._encode(text), _FINAL_FILLER)
        if "[[cut]]" not in triggers:
            draft.fixed([END, RETURN] if "[[trailing]]" in triggers else [RETURN])

    def _follow_up_tool(self, summary: PromptSummary, user: str, triggers: frozenset[str]) -> ToolSpec | None:
        """The tool to call after a tool result under the tool-loop triggers, or None to answer."""
        named = mentioned_tools(summary.tools, user)
        if not named:
            return None
        if "[[sequence]]" in triggers:
            return next((t for t in named if t.recipient not in summary.called), None)
        if "[[stubborn]]" in triggers:
            return named[0]
        if "[[repeat]]" in triggers and "max_tool_calls" not in summary.tool_output:
            return named[0]
        return None

    def _call(
        self,
        draft: _Draft,
        tool: ToolSpec,
        user: str,
        terminator: int,
        *,
        bad_json: bool = False,
        required_only: bool = False,
    ) -> None:
        if tool.freeform:
            draft.fixed(
                _special(f"<|start|>assistant<|channel|>analysis to={tool.recipient} code<|message|>")
            )
            draft.fixed(self._encode(f"print({json.dumps(argument_word(user))})"))
            draft.fixed([terminator])
            return
        channel = "analysis" if tool.builtin else "commentary"
        draft.fixed(
            _special(
                f"<|start|>assistant<|channel|>{channel} to={tool.recipient} <|constrain|>json<|message|>"
            )
        )
        arguments = json.dumps(
            build_arguments(tool, user, required_only=required_only),
            separators=(",", ":"),
            ensure_ascii=False,
        )
        if bad_json:
            arguments = arguments[:-1] if len(arguments) > 2 else "{not json"
        draft.fixed(self._encode(arguments))
        draft.fixed([terminator])


__all__ = [
    "CHECKPOINT",
    "MALFORMED_TRIGGERS",
    "MISPLACED_TEXT",
    "TRIGGERS",
    "HarmonyScript",
    "PromptSummary",
    "TextScript",
    "ToolParam",
    "ToolSpec",
    "argument_word",
    "build_arguments",
    "echo_reply",
    "example_value",
    "mentioned_tools",
    "parse_tool_namespaces",
]
