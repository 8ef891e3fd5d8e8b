"""The Responses API: its request types, the mapper from input items to a Harmony turn, the output
builder and framers, and the stateful service (`service/`) that stores, runs and replays responses."""
