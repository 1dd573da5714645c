"""OpenAI's API: the request bodies (`protocol`), the chat completion and text completion response bodies and
stream chunks (`response_bodies`), POST /v1/chat/completions (`chat`) and /v1/completions (`completions`),
and the Responses API (`responses/`).

What this package is not: the routes (`cairn.server.app`), the parsing off the event loop (`cairn.server.prepare`)
or the shaping of generated text into reasoning, content and tool calls (`cairn.server.chat`), which Anthropic's
API shares.
"""
