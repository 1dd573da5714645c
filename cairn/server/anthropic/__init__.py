"""Anthropic's Messages API, so Anthropic-API coding agents can point at cairn: POST /v1/messages and
/v1/messages/count_tokens: the request's models and the equivalent chat request (`request`), the answer as
content blocks or Anthropic's SSE events (`messages`), and the request's `context_management` edits (`context`).

What this package is not: the chat path it runs on (`openai.chat.prepare_chat`, `chat/`) or the error bodies'
shape, which `cairn.server.errors` decides for every API.
"""
