"""OpenAI-compatible gateway: sessions, chat-template rendering, token-faithful recording."""
