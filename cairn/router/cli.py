"""`cairn router --replica URL --replica URL ... [--port N]`: run the router (see app.py) under uvicorn."""

from __future__ import annotations

import argparse
import logging

from cairn.flags import add_dataclass_args, build_group
from cairn.preflight import UserError, check_port
from cairn.router.options import RouterOptions

log = logging.getLogger("cairn.router")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="base URL of a cairn replica, e.g. http://10.0.0.2:8000 (repeat for each replica)")
    add_dataclass_args(p, RouterOptions, "router options")


def run(ns: argparse.Namespace) -> int:
    if not ns.replica:
        raise UserError("give at least one --replica URL")
    if not all(u.startswith(("http://", "https://")) for u in ns.replica):
        raise UserError("--replica must be an http:// or https:// URL")
    options = build_group(RouterOptions, ns)
    check_port(options.host, options.port)
    import uvicorn

    from cairn.router.app import create_app
    from cairn.server.http.connections import guarded_protocol
    from cairn.server.http.middleware import HostCheck
    from cairn.server.options import loopback_host_names

    class RouterServer(uvicorn.Server):
        """Ends `cairn router` with status 0 after SIGTERM / SIGINT, as `cairn serve` does: uvicorn's own
        handler records the signal and raises it again once shut down, so the process died by it (143)."""

        def handle_exit(self, sig: int, frame) -> None:
            self.force_exit = self.should_exit  # a second signal: stop waiting for the answers in flight
            self.should_exit = True

    app, names = create_app(ns.replica, options), loopback_host_names(options.host, options.allowed_hosts)
    server = RouterServer(uvicorn.Config(app if names is None else HostCheck(app, names), host=options.host,
                                         port=options.port,
                                         log_level="warning",  # (the request-head deadline and connection cap
                                         http=guarded_protocol(options.header_timeout_s, options.max_connections)))
    log.info("routing to %d replica(s) (%s) on http://%s:%d", len(ns.replica), ", ".join(ns.replica), options.host,
             options.port)
    server.run()
    return 0 if server.started else 1
