"""Output parsers for models whose output is text: reasoning parsers, tool-call parsers, and the
registry that picks them per model (see `registry.py`)."""

from .base import ParserChain
from .json_tool_call import JsonToolCallParser
from .registry import (
    REASONING_PARSERS,
    TEXT_PARSER_KINDS,
    TOOL_CALL_PARSERS,
    build_parser_chain,
    validate_parser_names,
)

__all__ = [
    "REASONING_PARSERS",
    "TEXT_PARSER_KINDS",
    "TOOL_CALL_PARSERS",
    "JsonToolCallParser",
    "ParserChain",
    "build_parser_chain",
    "validate_parser_names",
]
