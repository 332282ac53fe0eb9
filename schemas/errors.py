"""One exception hierarchy for the whole package (re-exported as ``prme.errors``)."""

from __future__ import annotations


class PRMEError(Exception):
    """Base class of every error PRME raises on purpose."""


class InvalidInput(PRMEError, ValueError):
    """Input was rejected before anything was written."""


class RecordDecodeError(PRMEError, ValueError):
    """Bytes from the log could not be decoded into a known record."""


class UnknownRecordKind(RecordDecodeError):
    """The record's ``kind`` is not one this version of PRME knows (a newer writer?)."""


class UnsupportedRecordVersion(RecordDecodeError):
    """The record's schema version ``v`` is newer than this decoder supports."""


class TransportError(PRMEError):
    """The log transport failed (broker unreachable, file locked, ...)."""


class NotFound(PRMEError, LookupError):
    """The requested event or node does not exist for this owner."""


class Forbidden(PRMEError, PermissionError):
    """The caller may not act on another owner's data."""


class Unauthenticated(Forbidden):
    """No API key, or an unknown one (HTTP 401)."""


class ConsistencyTimeout(PRMEError, TimeoutError):
    """A read waited for a consistency token longer than its deadline."""


class ShardUnavailable(PRMEError):
    """The owner's partition is not projected by this process."""


class EmbeddingMismatch(PRMEError):
    """Stored vectors were built by a different embedding provider identity."""


class ConfigurationError(PRMEError, ValueError):
    """Settings or a saved pack configuration are inconsistent."""


class InvalidEmbedding(PRMEError, ValueError):
    """An embedding provider reported an invalid identity or returned malformed vectors."""
