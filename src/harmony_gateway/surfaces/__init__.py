"""The API surfaces: one folder each (chat, responses, messages, generate, completions), holding that
surface's request types, its mapper (request -> Harmony turn or engine request), its framers (JSON,
SSE) and its wire. Each maps onto the shared stages in `pipeline/`; the edge (`api/`) routes to them.
`table.py` lists the surfaces; `harmony_history.py` builds the Harmony history the chat-shaped ones
(chat, messages, responses) map their conversations to."""
