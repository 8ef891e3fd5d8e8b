"""harmony-gateway: an OpenAI-compatible gateway for gpt-oss (Harmony) and other LLMs."""

__version__ = "0.1.0"

__all__ = ["__version__"]
