"""The upstream pool: OpenAI-compatible servers behind balancing, retries, fallback and breakers."""
