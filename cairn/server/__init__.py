"""The HTTP server (`cairn serve`): the routes (app.py), serving a request (prepare.py, serving.py), metrics, probe
and tokenize; engine_io/ (the engine thread and the workers), http/ (below the routes), chat/ (what every API's
chat shares: schema, parsers, forced calls), openai/ (chat and text completions, Responses) and anthropic/ (Messages).

This package file imports nothing, so `cairn.cli` can read `ServerOptions` without loading FastAPI.
Start with `cairn.server.main.serve`; the app factory is `cairn.server.app.create_app`.
"""
