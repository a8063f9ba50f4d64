"""The OpenAI-compatible gateway: agents' LLM calls in, episode streams out."""
