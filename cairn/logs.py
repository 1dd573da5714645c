"""Process-wide logging set-up for the command line: plain text or one JSON object per line.

    setup_logging("INFO", "text")   2026-12-01 10:00:00,123 INFO cairn.engine: finished req-3: ...
    setup_logging("INFO", "json")   {"ts": "2026-12-01T10:00:00.123Z", "level": "INFO", "logger": "cairn.engine",
                                     "msg": "finished req-3: ...", "request_id": "req-3", "prompt_tokens": 120, ...}

A log call may pass structured fields as `extra={"fields": {...}}`: the JSON format merges them into
the object (so a log shipper needs no parsing), the text format ignores them (the message already
says the same). Called once, by `cairn.cli.main`; nothing else in cairn configures logging.
"""

from __future__ import annotations

import json
import logging
import time

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ms), level, logger, msg, the record's `fields`, exc (if any)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        obj = {"ts": ts, "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            obj.update({k: v for k, v in fields.items() if k not in obj})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once for the process (replacing any handler set before). `fmt` is one of
    LOG_FORMATS (the command line's choices for --log-format): "json", else text."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # httpx logs every request it sends at INFO: `cairn router`'s health polls (each replica every 2 s, for
    # ever), probes and forwarded requests. They are shown at DEBUG only, as the servers' /health access lines.
    logging.getLogger("httpx").setLevel(logging.NOTSET if level.upper() == "DEBUG" else logging.WARNING)
