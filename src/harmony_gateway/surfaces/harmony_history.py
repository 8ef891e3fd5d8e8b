"""The Harmony history of a chat-shaped conversation, built the same way for Chat Completions, Anthropic
Messages and Responses input (REFERENCE §2.3): the leading system/developer messages become the developer
message's instructions and later ones a developer message in place; an assistant turn renders in the
order the model generates it: analysis, then its text, then its calls."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..harmony.messages import Msg, assistant, assistant_call, developer_text, drop_old_analysis


class HarmonyHistory:
    """One conversation's instructions and Harmony messages, collected in order."""

    __slots__ = ("_leading", "instructions", "messages")

    def __init__(self, instructions: list[str] | None) -> None:
        """`instructions` collects the leading system messages (and holds any given before them); None
        when there are no instructions to collect: every system message is a developer message."""
        self.instructions = instructions
        self.messages: list[Msg] = []
        self._leading = instructions is not None

    def system(self, text: str) -> None:
        """A system or developer message; empty text is dropped."""
        if not text:
            return
        if self._leading and self.instructions is not None:
            self.instructions.append(text)
        else:
            self.messages.append(developer_text(text))

    def add(self, *messages: Msg) -> None:
        """The messages of any other turn or item, which ends the leading system messages even when it
        renders as none."""
        self._leading = False
        self.messages.extend(messages)

    def assistant_turn(self, analyses: Iterable[str], text: str, calls: Sequence[tuple[str, str]]) -> None:
        """An assistant turn: its analyses, its text (a preamble when it calls tools, else the final
        answer) and its function calls as (name, arguments)."""
        self.add(*(assistant(analysis, "analysis") for analysis in analyses))
        if text:
            self.add(assistant(text, "commentary" if calls else "final"))
        self.add(*(assistant_call("functions." + name, arguments) for name, arguments in calls))

    def result(self) -> tuple[str | None, list[Msg]]:
        """(instructions, history) after the analysis drop rule (REFERENCE §2.5)."""
        return ("\n\n".join(self.instructions or ()) or None), drop_old_analysis(self.messages)
