"""Extract the Responses and Conversations schemas from OpenAI's OpenAPI document into `openai/responses.json`.

The published document (github.com/openai/openai-openapi, `openapi.json`) is about 10 MB; the tests need
only the components reachable from the roots below. Each component is copied as it is (descriptions
included), one per line, so a refresh shows as a readable diff. Run from the repository root:

    python tests/data/schemas/extract_openai.py PATH/TO/openapi.json COMMIT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

#: The objects the gateway sends on the Responses and Conversations routes, the WebSocket events, and the
#: request bodies of the token-count and compaction routes.
ROOTS = (
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "ConversationResource",
    "ConversationItemList",
    "ConversationItem",
    "DeletedConversationResource",
    "ErrorResponse",
    "TokenCountsBody",
    "TokenCountsResource",
    "CompactResponseMethodPublicBody",
    "CompactResource",
    "ResponsesClientEvent",
    "ResponsesServerEvent",
)
PREFIX = "#/components/schemas/"
OUT = Path(__file__).parent / "openai" / "responses.json"


def reachable(schemas: dict[str, Any], roots: tuple[str, ...]) -> list[str]:
    """The names of `roots` and every component their `$ref`s reach, sorted."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        stack: list[Any] = [schemas[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str):
                    if not ref.startswith(PREFIX):
                        raise ValueError(f"unexpected $ref {ref!r} in {name}")
                    todo.append(ref[len(PREFIX) :])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return sorted(seen)


def main(source: str, commit: str) -> None:
    document = json.loads(Path(source).read_text(encoding="utf-8"))
    schemas = document["components"]["schemas"]
    names = reachable(schemas, ROOTS)
    header = {
        "openapi": document["openapi"],
        "info": document["info"],
        "x-extracted-from": {
            "repository": "https://github.com/openai/openai-openapi",
            "commit": commit,
            "file": "openapi.json",
            "roots": list(ROOTS),
            "license": "MIT (see LICENSE beside this file)",
        },
    }
    lines = [json.dumps(header, ensure_ascii=False)[:-1] + ',\n"components": {"schemas": {']
    body = [f"{json.dumps(name)}: {json.dumps(schemas[name], ensure_ascii=False)}" for name in names]
    lines.append(",\n".join(body))
    lines.append("}}}\n")
    OUT.write_text("\n".join(lines), encoding="utf-8")
    json.loads(OUT.read_text(encoding="utf-8"))  # it must stay one valid document
    print(f"{len(names)} components written to {OUT}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
