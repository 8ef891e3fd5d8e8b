"""Validation of what the gateway sends on the Responses and Conversations routes against the published
schemas, vendored in tests/data/schemas/: OpenAI's OpenAPI document (its Responses components) and the
Open Responses specification. Both are OpenAPI 3.1, whose schemas are JSON Schema 2020-12.

Every check runs both documents. Where they disagree, OpenAI's wins (the gateway serves OpenAI's
clients). The disagreements, each with what is done about it:
- event names: OpenAI streams `response.reasoning_text.delta`, Open Responses names it
  `response.reasoning.delta` (`RENAMED_EVENTS`); the gateway sends OpenAI's names, and the events are
  checked against Open Responses under its own names. Events Open Responses does not define (MCP, tool
  calls other than functions) are checked against OpenAI's only;
- the `error` event: OpenAI puts `code`, `message` and `param` on the event, Open Responses nests them
  in `error`; the gateway sends both shapes, so each schema finds its own;
- output items, tools and tool choices Open Responses does not define (MCP, web search, code
  interpreter, custom and local shell tools) are checked against OpenAI's schema only: its unions are
  closed, so they are opened here to the types it has no schema for;
- an echoed `json_schema` text format: Open Responses wants `schema` null and `description` present in a
  Response, OpenAI wants the schema object and no null description; the gateway echoes the format as
  the request sent it, checked against OpenAI's schema only;
- `usage` before a response ends: OpenAI's schema has no null for it, Open Responses requires the
  field; the gateway sends an object on every snapshot, which both accept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SCHEMAS = Path(__file__).resolve().parent.parent / "data" / "schemas"
PREFIX = "#/components/schemas/"


@dataclass
class Document:
    """One vendored OpenAPI document: its components resolve `$ref`s, each validator is built once."""

    uri: str
    contents: dict[str, Any]
    _validators: dict[str, Draft202012Validator] = field(default_factory=dict)

    @property
    def schemas(self) -> dict[str, Any]:
        return self.contents["components"]["schemas"]

    def validator(self, name: str) -> Draft202012Validator:
        found = self._validators.get(name)
        if found is None:
            resource = Resource(contents=self.contents, specification=DRAFT202012)
            registry: Registry[Any] = Registry().with_resource(self.uri, resource)
            schema = {"$ref": f"{self.uri}{PREFIX}{name}"}
            found = self._validators[name] = Draft202012Validator(schema, registry=registry)
        return found

    def problems(self, name: str, instance: Any) -> list[str]:
        """Every way `instance` breaks component `name`, each with where it is and why."""
        out = []
        for error in sorted(self.validator(name).iter_errors(instance), key=lambda e: list(e.path)):
            out.append(f"{name} at {_where(error.absolute_path)}: {_reason(error)}")
        return out

    def variants_by_type(self, union: list[dict[str, Any]]) -> dict[str, str]:
        """The component of each `type` value in a union of `$ref`s (events, items, tools)."""
        out = {}
        for variant in union:
            name = variant["$ref"][len(PREFIX) :]
            for value in _type_values(self.schemas, name):
                out.setdefault(value, name)
        return out


def _type_values(schemas: dict[str, Any], name: str) -> list[str]:
    schema = schemas[name]
    parts = [schema, *schema.get("allOf", ())]
    for part in parts:
        if "$ref" in part:
            return _type_values(schemas, part["$ref"][len(PREFIX) :])
        kind = part.get("properties", {}).get("type", {})
        if "enum" in kind:
            return list(kind["enum"])
        if "const" in kind:
            return [kind["const"]]
    return []


def _where(path: Any) -> str:
    return "/" + "/".join(str(p) for p in path)


def _reason(error: Any) -> str:
    """Why `error` failed; for a union (`anyOf`/`oneOf`), why the branches of the instance's own `type`
    failed, so a union of forty item types says what its item lacks."""
    if not error.context:
        return str(error.message)
    branches: dict[Any, list[Any]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    meant = [
        errors
        for errors in branches.values()
        if not any(list(e.relative_path) == ["type"] and e.validator in ("enum", "const") for e in errors)
    ] or list(branches.values())
    reasons = [f"{_where(e.absolute_path)}: {_reason(e)}" for errors in meant for e in errors]
    return "; ".join(reasons[:6])


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


#: Mistakes of OpenAI's document, corrected here (component, required field it does not define): the SDKs
#: generated from the same source have no such field.
OPENAI_ERRATA = (("MCPApprovalResponseResource", "request_id"),)
#: Unions OpenAI's document writes as `oneOf` with a `discriminator`, which picks the branch by `type`.
#: Plain JSON Schema has no discriminator, and a message item with an `id` (as a compaction returns it)
#: matches two branches (`EasyInputMessage` and the `Item` message), so these are read as `anyOf`.
OPENAI_DISCRIMINATED = ("InputItem",)


@cache
def openai() -> Document:
    doc = Document("urn:openai-openapi", _load(SCHEMAS / "openai" / "responses.json"))
    for name, required in OPENAI_ERRATA:
        schema = doc.schemas[name]
        assert required not in schema["properties"], f"{name}.{required} is defined now: drop the erratum"
        schema["required"] = [field for field in schema["required"] if field != required]
    for name in OPENAI_DISCRIMINATED:
        schema = doc.schemas[name]
        assert "discriminator" in schema, f"{name} has no discriminator now: drop it from the list"
        schema["anyOf"] = schema.pop("oneOf")
    return doc


@cache
def open_responses() -> Document:
    contents = _load(SCHEMAS / "openresponses" / "openapi.json")
    schemas = contents["components"]["schemas"]
    doc = Document("urn:open-responses", contents)
    # Open its closed unions to the item, tool and tool choice types it has no schema for, and leave the
    # echoed json_schema format to OpenAI's schema (module docstring).
    for union in ("ItemField", "Tool"):
        schemas[union] = _opened(doc, schemas[union])
    resource = schemas["ResponseResource"]["properties"]
    resource["tool_choice"] = _opened(doc, resource["tool_choice"])
    schemas["JsonSchemaResponseFormat"] = {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["json_schema"]}},
    }
    return doc


def _opened(doc: Document, union: dict[str, Any]) -> dict[str, Any]:
    """`union` (a `oneOf` of `$ref`s, strings among them) also accepting objects of any other `type`."""
    known = list(doc.variants_by_type([v for v in union["oneOf"] if "$ref" in v]))
    other = {"type": "object", "required": ["type"], "properties": {"type": {"not": {"enum": known}}}}
    return {"anyOf": [{"oneOf": union["oneOf"]}, other]}


@cache
def openai_events() -> dict[str, str]:
    doc = openai()
    return doc.variants_by_type(doc.schemas["ResponseStreamEvent"]["anyOf"])


@cache
def open_responses_events() -> dict[str, str]:
    doc = open_responses()
    stream = doc.contents["paths"]["/responses"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    return doc.variants_by_type(stream["schema"]["oneOf"])


#: Events OpenAI and Open Responses name differently: OpenAI's name -> Open Responses'.
RENAMED_EVENTS = {
    "response.reasoning_text.delta": "response.reasoning.delta",
    "response.reasoning_text.done": "response.reasoning.done",
}


def response_problems(body: Any) -> list[str]:
    """How a Response object breaks either published schema ([] when it is valid)."""
    return [
        *openai().problems("Response", body),
        *(f"Open Responses {p}" for p in open_responses().problems("ResponseResource", body)),
    ]


def event_problems(event: Any) -> list[str]:
    """How one streamed event breaks either published schema ([] when it is valid). An event type
    OpenAI does not define is a problem; one Open Responses does not define is checked by OpenAI's."""
    kind = event.get("type") if isinstance(event, dict) else None
    name = openai_events().get(kind) if isinstance(kind, str) else None
    if name is None:
        return [f"event type {kind!r} is not a ResponseStreamEvent of OpenAI's schema"]
    out = openai().problems(name, event)
    renamed = RENAMED_EVENTS.get(kind)
    theirs = open_responses_events().get(renamed or kind)
    if theirs is not None:
        as_theirs = {**event, "type": renamed} if renamed else event
        out.extend(f"Open Responses {p}" for p in open_responses().problems(theirs, as_theirs))
    return out


@cache
def openai_socket_events() -> dict[str, str]:
    """The `ResponsesServerEvent` variant of each WebSocket server event type, as a JSON pointer below
    the document's components (`ResponsesServerEvent/anyOf/N`): each variant is the SSE event plus its
    `stream_id`, or the socket's own `ResponseWsError`."""
    doc = openai()
    out: dict[str, str] = {}
    for n, variant in enumerate(doc.schemas["ResponsesServerEvent"]["anyOf"]):
        ref = variant["$ref"] if "$ref" in variant else variant["allOf"][0]["$ref"]
        for value in _type_values(doc.schemas, ref[len(PREFIX) :]):
            out.setdefault(value, f"ResponsesServerEvent/anyOf/{n}")
    return out


def socket_event_problems(event: Any) -> list[str]:
    """How one WebSocket server event breaks the published schemas ([] when it is valid): OpenAI's
    `ResponsesServerEvent`, and each event of a response also as the stream event it is (both schemas,
    `event_problems`) without its `stream_id`."""
    kind = event.get("type") if isinstance(event, dict) else None
    pointer = openai_socket_events().get(kind) if isinstance(kind, str) else None
    if pointer is None:
        return [f"event type {kind!r} is not a ResponsesServerEvent of OpenAI's schema"]
    out = openai().problems(pointer, event)
    if kind != "error":
        out.extend(event_problems({k: v for k, v in event.items() if k != "stream_id"}))
    return out


def assert_valid_socket_events(events: list[dict[str, Any]]) -> None:
    """Every event a WebSocket sent, each reported with its position."""
    problems = [f"#{n} {p}" for n, event in enumerate(events) for p in socket_event_problems(event)]
    assert not problems, "the socket's events break the published schemas:\n" + "\n".join(problems)


def assert_valid_response(body: Any) -> None:
    problems = response_problems(body)
    assert not problems, "the Response breaks the published schemas:\n" + "\n".join(problems)


def assert_valid_event(event: Any) -> None:
    problems = event_problems(event)
    assert not problems, f"event {event.get('type')!r} breaks the published schemas:\n" + "\n".join(problems)


def assert_valid_events(events: list[dict[str, Any]]) -> None:
    """Every event of a stream, each reported with its position."""
    problems = [f"#{n} {p}" for n, event in enumerate(events) for p in event_problems(event)]
    assert not problems, "the stream breaks the published schemas:\n" + "\n".join(problems)


def assert_valid(component: str, instance: Any) -> None:
    """`instance` against one component of OpenAI's schema (items, lists, conversations)."""
    problems = openai().problems(component, instance)
    assert not problems, f"the {component} breaks OpenAI's schema:\n" + "\n".join(problems)
