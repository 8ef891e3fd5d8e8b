"""The API surfaces: one folder each (chat, responses, messages, completions, generate), holding that
surface's request types, its mapper (request -> Harmony turn or engine request), its framers (JSON body,
SSE events) and its plan; `table.py` lists them, each with its route and wire, and `harmony_history.py`
builds the Harmony history the chat-shaped ones (chat, messages, responses) map their conversations to.
Each maps onto the shared stages in `pipeline/`; the edge (`api/`) builds its routes from the table."""
