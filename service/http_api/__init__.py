"""The OpenAI-compatible HTTP door: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
