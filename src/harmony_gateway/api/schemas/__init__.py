"""Wire schemas: OpenAI's names for OpenAI's shapes."""
