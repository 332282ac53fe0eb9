"""Log output of the ``prme`` commands: plain text lines, or one JSON object per line.

``configure("json")`` makes every record one JSON object with ``ts``, ``level``,
``logger``, ``message`` and the structured fields a record carries (the access log's
``route``, ``method``, ``status``, ``duration_ms``, ``owner_hash``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

import msgspec

LogFormat = Literal["text", "json"]
FIELDS = ("route", "method", "status", "duration_ms", "owner_hash")
_encoder = msgspec.json.Encoder()
ROUTINE_KAFKA_MESSAGES = ("Heartbeat failed for group %s because it is rebalancing",)
"""aiokafka's warnings of what a consumer group does in its normal course (the node's own
``prme.projector`` lines say when its partitions change)."""
REPEAT_WINDOW_S = 60.0
"""A Kafka client message repeated (one template, any arguments) is written once per this
many seconds, with a count of those left out."""


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


class KafkaClientNoise(logging.Filter):
    """aiokafka logs each retry while a broker is down (``Unable connect to node with id
    2``, ``Unable to update metadata``, ``NodeNotReadyError``: hundreds of ERROR lines a
    minute) and a warning at every rebalance. This keeps the first line of each template
    per ``REPEAT_WINDOW_S``, notes how many it left out on the next one, and drops the
    routine rebalance warnings. Other loggers' records pass untouched."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._shown: dict[tuple[str, str], tuple[float, int]] = {}
        """(logger, template) -> when it was last written, and how many left out since."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("aiokafka"):
            return True
        template = str(record.msg)
        if template in ROUTINE_KAFKA_MESSAGES or _coordinator_not_yet_available(record):
            return False
        key = (record.name, template)
        now = self._clock()
        shown, left_out = self._shown.get(key, (-REPEAT_WINDOW_S, 0))
        if now - shown < REPEAT_WINDOW_S:
            self._shown[key] = (shown, left_out + 1)
            return False
        self._shown[key] = (now, 0)
        if left_out:
            record.msg = f"{template} ({left_out} more like this in the last {now - shown:.0f}s)"
        return True


def _coordinator_not_yet_available(record: logging.LogRecord) -> bool:
    """aiokafka's ERROR while a group's coordinator is being set up (a new group, a broker
    that just started or moved it): every node logged it at a normal start, and it retries.
    (A coordinator that stays away shows in ``/v1/ready`` and ``prme status``.)"""
    return record.msg == "Group Coordinator Request failed: %s" and any(
        "GroupCoordinatorNotAvailable" in str(arg) for arg in record.args or ()
    )


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
    handler.addFilter(KafkaClientNoise())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    # uvicorn's own lines (startup, errors) reach the same handler (``prme serve`` runs it
    # with ``log_config=None`` and without its access log: ours replaces it).
    for name in ("prme", "uvicorn"):
        logging.getLogger(name).setLevel(level)
