"""The OpenAI-compatible HTTP server (`cairn serve`): API models, the engine bridge, metrics, the app.

This package file imports nothing, so `cairn.cli` can read `ServerOptions` without loading FastAPI.
Start with `cairn.server.main.serve`; the app factory is `cairn.server.app.create_app`.
"""
