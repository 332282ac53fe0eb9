"""One exception hierarchy for the whole package (re-exported as ``prme.errors``)."""

from __future__ import annotations

import sys
from collections.abc import Mapping


class PRMEError(Exception):
    """Base class of every error PRME raises on purpose."""

    written: list[object] = []
    """For an error after an append: what was appended (ids and consistency tokens)."""


class InvalidInput(PRMEError, ValueError):
    """Input was rejected before anything was written."""


TOO_DEEP = "JSON arrays or objects nested too deeply"
"""Why input nested past what the JSON and msgpack codecs recurse into is refused."""


class RequestIdConflict(InvalidInput):
    """A write reused a ``request_id`` of its owner for different content: a retry must
    repeat the write it retries. Nothing was written (HTTP 409)."""


def request_id_conflict(owner: str, request_id: str) -> RequestIdConflict:
    """The error for ``owner``'s ``request_id`` reused for another write."""
    return RequestIdConflict(
        f"{reused_request_id(owner, request_id)}; a retry must send the same content (use a "
        "new request_id for a new write). Nothing was written"
    )


def reused_request_id(owner: str, request_id: str) -> str:
    """What is wrong with a write that reuses a request id for other content."""
    return f"request_id {request_id!r} of owner {owner!r} was already used for a different write"


class RecordDecodeError(PRMEError, ValueError):
    """Bytes from the log could not be decoded into a known record."""


class UnknownRecordKind(RecordDecodeError):
    """The record's ``kind`` is not one this version of PRME knows (a newer writer?)."""


class UnsupportedRecordVersion(RecordDecodeError):
    """The record's schema version ``v`` is newer than this decoder supports."""


class ClientClosed(PRMEError, RuntimeError):
    """A ``MemoryClient`` or ``AsyncMemoryClient`` was used after ``close()`` (or after
    its ``with`` block): nothing was sent or written."""


class TransportError(PRMEError):
    """The log transport failed (broker unreachable, file locked, ...)."""


class TransportUnavailable(TransportError):
    """The log did not answer in time, or answered with an error that passes (a broker
    down or restarting, a partition's leader moving): the same call can succeed later."""


class AppendUnconfirmed(TransportError):
    """The log did not confirm an append in time, and it may still take it: the records
    stay queued in the producer and reach the log if a broker takes them later (or, for
    an atomic append of several records, its transaction's commit was sent and may still
    complete). Nothing tells which; a retry with the same ``request_id`` is written
    once."""


class NotFound(PRMEError, LookupError):
    """The requested event or node does not exist for this owner."""


class Forbidden(PRMEError, PermissionError):
    """The caller may not act on another owner's data."""


class Unauthenticated(Forbidden):
    """No API key, or an unknown one (HTTP 401)."""


class ConsistencyTimeout(PRMEError, TimeoutError):
    """A read waited for a consistency token longer than its deadline."""


class WriteUnconfirmed(ConsistencyTimeout):
    """Records were appended to the log, but waiting for them to be applied timed out.

    ``written`` holds what was appended (ids and consistency tokens): the write is on the
    log and will be applied; a retry with the same ``request_id`` is applied once."""

    def __init__(self, message: str, written: list[object] | None = None) -> None:
        super().__init__(message)
        self.written = list(written or [])


class ShardUnavailable(PRMEError):
    """The owner's partition is not projected by this process (or not yet served)."""

    retry_after_s: float = 1.0
    """How long a client should wait before asking again (HTTP ``Retry-After``)."""


class InsufficientSpace(PRMEError):
    """The data directory's file system has too little free space for an operation."""


class EmbeddingMismatch(PRMEError):
    """Stored vectors were built by a different embedding provider identity."""


class ConfigurationError(PRMEError, ValueError):
    """Settings or a saved pack configuration are inconsistent."""


class DataDirInUse(ConfigurationError):
    """Another process holds the data directory (one process opens a pack at a time)."""


class InvalidEmbedding(PRMEError, ValueError):
    """An embedding provider reported an invalid identity or returned malformed vectors."""


SHOWN_CHARACTERS = 64
"""The most characters of a caller's value an error message quotes."""


def shown(value: str, limit: int = SHOWN_CHARACTERS) -> str:
    """``value`` as an error message quotes what a caller sent: its ``repr``, the first
    ``limit`` characters of a longer one with an ellipsis and the length (a 10,000-character
    id is not sent back whole)."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def patterns_in_words(message: str, words: Mapping[str, str]) -> str:
    """``message`` (a msgspec validation error) with each ``Expected `str` matching regex
    '<pattern>'`` of a pattern in ``words`` replaced by what the pattern means."""
    for pattern, meaning in words.items():
        message = message.replace(f"Expected `str` matching regex {pattern!r}", meaning)
    for bound in (f">= {-sys.float_info.max!r}", f"<= {sys.float_info.max!r}"):
        message = message.replace(f"Expected `float` {bound}", NOT_FINITE)
    return message


NOT_FINITE = "Expected a finite number (not NaN or an infinity)"
"""What a float bounded by the largest floats (``FiniteFloat``) means, for error messages."""
