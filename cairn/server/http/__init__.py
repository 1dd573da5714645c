"""HTTP below the routes: uvicorn's protocol with a head deadline, a connection cap and large bodies read past h11
(`connections`), the pure ASGI middlewares (request id, API key, body limits and pacing, request counter:
`middleware`) and the access log line (`access_log`).

What this package is not: the routes (`cairn.server.app`) or anything that reads a request body as JSON; it knows
requests as bytes, headers and status codes.
"""
