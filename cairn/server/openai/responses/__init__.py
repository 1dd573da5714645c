"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}): the request and its
conversion to the equivalent chat (`request`), its input items as chat messages (`items`), and the answer, whole
or as the API's SSE events, with the store of responses that previous_response_id reads (`output`).

What this package is not: the chat path it runs on (`openai.chat`, `chat/`) or the parsing off the event loop
(`cairn.server.prepare`).
"""
