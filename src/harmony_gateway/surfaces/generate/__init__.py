"""Raw-prompt surfaces: SGLang's native `POST /generate` and OpenAI's legacy `POST /v1/completions`."""
