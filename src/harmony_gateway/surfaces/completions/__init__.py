"""OpenAI's legacy `POST /v1/completions`: text completions over the raw-prompt stage."""
