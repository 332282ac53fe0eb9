"""Log output of the ``prme`` commands: plain text lines, or one JSON object per line.

``configure("json")`` makes every record one JSON object with ``ts``, ``level``,
``logger``, ``message`` and the structured fields a record carries (the access log's
``route``, ``method``, ``status``, ``duration_ms``, ``owner_hash``).
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Literal

import msgspec

LogFormat = Literal["text", "json"]
FIELDS = ("route", "method", "status", "duration_ms", "owner_hash")
_encoder = msgspec.json.Encoder()


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return _encoder.encode(line).decode()


def configure(log_format: LogFormat = "text", level: int = logging.INFO, tag: str = "prme") -> None:
    """Send ``prme.*`` records (and warnings from libraries) to stderr in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {tag} %(levelname)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # uvicorn's own lines (startup, errors) reach the same handler (``prme serve`` runs it
    # with ``log_config=None`` and without its access log: ours replaces it).
    for name in ("prme", "uvicorn"):
        logging.getLogger(name).setLevel(level)
