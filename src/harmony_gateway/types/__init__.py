"""Request types of every API surface (Chat Completions, Responses, Anthropic Messages, completions and
SGLang's `/generate`): pydantic models under the wire's own names. Routes validate bodies into them and
the pipeline stages read them; neither owns them, as openai-python keeps its wire types in `types/`."""
