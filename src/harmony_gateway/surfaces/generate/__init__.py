"""SGLang's native `POST /generate`: raw prompts and token ids over the raw-prompt stage."""
