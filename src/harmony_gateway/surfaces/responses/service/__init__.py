"""The Responses service: running responses (stream, JSON, background), the tool loop between their
generations, storing them, their event logs and cancellation. The surface code it runs on (mapping a
request to Harmony, building output items, framing events) is one level up, in `surfaces/responses/`."""

from .background import cancel_response
from .service import plan_responses

__all__ = ["cancel_response", "plan_responses"]
