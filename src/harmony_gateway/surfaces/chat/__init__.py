"""Chat Completions: `POST /v1/chat/completions`, and the chat-shaped request other models' chat
templates and HTTP upstreams take."""
