"""What one call of each route costs traffic control; every route is controlled unless it is listed in
`UNCONTROLLED`, the one reviewed list of exceptions.

A route's `RouteCost` says how many units of the request budget a call takes (reads a tenth, writes
one, tokenizing routes one plus their body's size), whether it takes an admission slot while it runs,
and whether it reserves tokens from the token budget (the generating routes: their estimated prompt and
output tokens, settled to the real count when they end). A route added to the app is controlled as a
read, a removal or a write by its method until it is given its own row: nothing is left out by
forgetting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.routing import compile_path

from ..wire import OPENAI, Wire


@dataclass(frozen=True, slots=True)
class RouteCost:
    #: Units of the request budget one call takes.
    requests: float = 1.0
    #: More units per MiB of declared body (`content-length`): the work grows with the input.
    per_mib: float = 0.0
    #: Holds an admission slot while it runs.
    admission: bool = True
    #: Reserves its estimated tokens from the token budget at admission (settled when it ends).
    tokens: bool = False

    def weight(self, body_bytes: int) -> float:
        return self.requests + self.per_mib * body_bytes / (1024 * 1024)


#: Runs a generation: one request, a slot, and the tokens it may use.
GENERATION = RouteCost(tokens=True)
#: Tokenizes or parses its whole input on the gateway's CPU: weighed by the input's size.
TOKENIZING = RouteCost(per_mib=16.0)
#: Stores what it is sent (conversations, items, cancellations, workers).
WRITE = RouteCost(per_mib=4.0)
#: Reads stored state: cheap, never queued behind generations.
READ = RouteCost(requests=0.1, admission=False)
#: Deletes or cancels: frees what others wait for, so it never waits in the admission queue itself.
RELEASE = RouteCost(admission=False)

#: Routes with a cost of their own besides the generating ones (`RouteMap`; method, path template as
#: registered with the app); every other route is a READ (GET, HEAD), a RELEASE (DELETE) or a WRITE.
ROUTE_COSTS: dict[tuple[str, str], RouteCost] = {
    ("POST", "/v1/harmony/render"): TOKENIZING,
    ("POST", "/v1/harmony/parse"): TOKENIZING,
    ("POST", "/v1/messages/count_tokens"): TOKENIZING,
    ("POST", "/v1/responses/input_tokens"): TOKENIZING,
    ("POST", "/v1/responses/{response_id}/cancel"): RELEASE,
}

#: Outside traffic control, reviewed: probes that orchestrators and scrapers call on a schedule (they
#: must answer while a tenant is limited), and the playground's static page and files and the favicon,
#: which hold nothing per tenant. (method, path template as registered with the app.)
UNCONTROLLED: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/health"),
        ("GET", "/readiness"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/playground"),
        ("GET", "/playground/static/{name}"),
        ("GET", "/favicon.ico"),
    }
)

_ROWS: dict[tuple[str, str], RouteCost | None] = {**ROUTE_COSTS, **dict.fromkeys(UNCONTROLLED)}
#: Literal paths are looked up at once; templates are matched.
_LITERAL = {row: cost for row, cost in _ROWS.items() if "{" not in row[1]}
_TEMPLATES = tuple(
    (method, compile_path(template)[0], cost) for (method, template), cost in _ROWS.items() if "{" in template
)


def route_cost(method: str, path: str) -> RouteCost | None:
    """The cost of `method path` (a concrete path) for a route that does not generate (`RouteMap.cost`
    answers for every route); None for the routes in `UNCONTROLLED`."""
    method = "GET" if method == "HEAD" else method
    if (method, path) in _LITERAL:
        return _LITERAL[(method, path)]
    for row_method, pattern, cost in _TEMPLATES:
        if row_method == method and pattern.match(path):
            return cost
    return READ if method == "GET" else RELEASE if method == "DELETE" else WRITE


@dataclass(frozen=True, slots=True)
class RouteMap:
    """What traffic control knows of the app's routes that it cannot know from below them: which POST
    routes generate, and the wire each route answers on. The app builds it from the surface table
    (surfaces/table.py), so a new surface is controlled and answered on its wire without a line here."""

    #: POST path of each generating route → the wire it answers on.
    generating: Mapping[str, Wire] = field(default_factory=dict)
    #: Other routes (method, path) that answer on a wire other than OpenAI's (Messages' count_tokens).
    wires: Mapping[tuple[str, str], Wire] = field(default_factory=dict)

    def cost(self, method: str, path: str) -> RouteCost | None:
        """The cost of `method path` (a concrete path); None for the routes in `UNCONTROLLED`."""
        if method == "POST" and path in self.generating:
            return GENERATION
        return route_cost(method, path)

    def wire(self, method: str, path: str) -> Wire:
        """The wire `method path` answers on before (or without) its route saying so."""
        if method == "POST":
            found = self.generating.get(path)
            if found is not None:
                return found
        return self.wires.get((method, path), OPENAI)


# -- token reservations ---------------------------------------------------------------------------------
#: Prompt tokens estimated from the body's size: o200k averages about four bytes of text a token, and
#: JSON adds bytes, so this rarely reserves too little; the real count settles it.
BYTES_PER_TOKEN = 4
#: Output reserved for a request that sets no output limit (it may use more: the rest is charged at the
#: end, into debt if need be).
DEFAULT_OUTPUT_RESERVATION = 1024
_OUTPUT_LIMIT_FIELDS = ("max_completion_tokens", "max_output_tokens", "max_tokens", "max_new_tokens")


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def estimate_tokens(body: bytes, request: Any) -> int:
    """The tokens a generation request may use: its prompt (from the body's size) plus its output limit
    (`max_completion_tokens`, `max_output_tokens`, `max_tokens`, SGLang's `sampling_params.max_new_tokens`;
    `DEFAULT_OUTPUT_RESERVATION` without one) for each of its `n` choices. `request` is the decoded body,
    or None when it is not a JSON object (the route then answers 400 and the reservation is returned)."""
    return estimate_tokens_of_size(len(body), request)


def estimate_tokens_of_size(size: int, request: Any) -> int:
    """`estimate_tokens` of a body of `size` bytes (or characters: a message read as text)."""
    prompt = math.ceil(size / BYTES_PER_TOKEN)
    fields: dict[str, Any] = request if isinstance(request, dict) else {}
    sampling = fields.get("sampling_params")
    scopes = [fields, sampling] if isinstance(sampling, dict) else [fields]
    output = next(
        (
            limit
            for scope in scopes
            for name in _OUTPUT_LIMIT_FIELDS
            if (limit := _positive_int(scope.get(name))) is not None
        ),
        DEFAULT_OUTPUT_RESERVATION,
    )
    choices = next((n for scope in scopes if (n := _positive_int(scope.get("n"))) is not None), 1)
    return prompt + output * choices


__all__ = [
    "GENERATION",
    "READ",
    "RELEASE",
    "ROUTE_COSTS",
    "TOKENIZING",
    "UNCONTROLLED",
    "WRITE",
    "RouteCost",
    "RouteMap",
    "estimate_tokens",
    "estimate_tokens_of_size",
    "route_cost",
]
