"""Anthropic Messages: `POST /v1/messages` and `count_tokens`, mapped onto the same Harmony turn as chat."""
