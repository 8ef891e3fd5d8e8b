"""Traffic control for the turns of a long-lived connection: each `response.create` of a Responses
WebSocket is one generating request, controlled as `TrafficMiddleware` controls a `POST /v1/responses`.

The socket authenticates once, at its handshake (`TrafficControl.identify`, the same keys and tenant
rules as a request); its `TurnGate` then takes each turn through the rest, in order: refused while the
gateway drains; the key's (or address's) request budget charged one generation and its token budget the
turn's estimate (from the message's size and output limit), a refusal being `RateLimited` with the
budget headers in `headers`; an admission slot, at once or after waiting in the queue (a full queue or a
timed-out wait is `RateLimited` too); then the turn runs, counted in flight, so a drain waits for it and
cuts it at its timeout. Its `Ticket` charges what it used beyond the reservation when its first event goes
out (`Ticket.charge_started`) and settles to the real count when it ends, as a request's does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ..settings import KeyPolicy
from .admission import Slot
from .middleware import Ticket, TrafficControl
from .routes import GENERATION, estimate_tokens_of_size


class TurnGate:
    """The traffic control of one connection's turns, for the budget owner found at its handshake
    (`identity`: None on a gateway whose key was not found, which never gets this far)."""

    __slots__ = ("control", "headers", "identity", "policy")

    def __init__(self, control: TrafficControl, identity: str | None, policy: KeyPolicy | None) -> None:
        self.control = control
        self.identity = identity
        self.policy = policy
        #: The budget headers of the last turn's check (`x-ratelimit-*`), by name.
        self.headers: dict[str, str] = {}

    async def run(
        self,
        scope_state: dict[str, Any],
        size: int,
        request: Any,
        work: Callable[[Ticket], Awaitable[None]],
    ) -> bool:
        """Run `work` as an admitted generation of a `size`-byte message (`request`: its decoded JSON,
        for the output limit). `scope_state` is where the turn's `RequestContext` is found
        (`REQUEST_CONTEXT`), for the tokens it used. Raises `Overloaded` while draining and `RateLimited`
        when a budget or admission refuses it, before `work` starts. Returns False when the drain's
        timeout cut `work` (it was cancelled), True when it ended by itself."""
        control = self.control
        if control.draining:
            raise control.refuse_draining()
        reserved = 0
        self.headers = {}
        if control.limits_on and self.identity is not None:
            tokens = estimate_tokens_of_size(size, request) if control.token_limit(self.policy) else None
            headers, refusal, reserved = await control.check_budgets(
                self.identity, self.policy, GENERATION.weight(size), tokens
            )
            self.headers = {name.decode(): value.decode() for name, value in headers}
            if refusal is not None:
                raise refusal
        ticket = Ticket(control, None, self.identity, self.policy, scope_state, reserved)
        try:
            ticket.slot = await self._slot()
            scope = anyio.CancelScope()
            control._enter(scope)
            try:
                with scope:
                    await work(ticket)
            finally:
                control._leave(scope)
            return not scope.cancelled_caught
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(5):
                await ticket.settle()

    async def charge(self, size: int) -> None:
        """Charge a message that starts no turn (it was refused: not JSON, an unknown event, a turn
        already in flight) the request budget of one generation, as a `POST /v1/responses` with a body
        the route refuses is charged; raises `RateLimited` once the budget is spent."""
        control = self.control
        if not control.limits_on or self.identity is None:
            return
        headers, refusal, _ = await control.check_budgets(
            self.identity, self.policy, GENERATION.weight(size), None
        )
        self.headers = {name.decode(): value.decode() for name, value in headers}
        if refusal is not None:
            raise refusal

    async def _slot(self) -> Slot | None:
        admission = self.control.admission
        if admission is None or self.identity is None:
            return None
        return await admission.acquire(self.control.priority(self.policy))


__all__ = ["TurnGate"]
