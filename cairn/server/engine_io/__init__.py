"""The server's side of the engine: the engine's own thread and the queues to and from it (`bridge`), and the
work that runs off the event loop before a request reaches that thread: tokenizing in worker threads and
parsing large bodies in request worker processes (`offload`, `workers`).

What this package is not: the HTTP routes or any API's request and response shapes; it hands the engine
Submissions and gives back its outputs, whatever API they came from.
"""
