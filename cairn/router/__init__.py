"""`cairn router`: one OpenAI-compatible endpoint in front of several cairn replicas, routing each request
to the replica that resumes it fastest (replicas.py: state and choice; app.py: the ASGI app; cli.py)."""
