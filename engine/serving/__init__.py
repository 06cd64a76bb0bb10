"""The HTTP side: OpenAI-compatible routes, /health, /metrics, and the app that also mounts the UI."""
