"""The one exception hierarchy (defined in ``prme.schemas.errors``)."""

from prme.schemas.errors import (
    ConfigurationError,
    ConsistencyTimeout,
    EmbeddingMismatch,
    Forbidden,
    InvalidInput,
    NotFound,
    PRMEError,
    RecordDecodeError,
    ShardUnavailable,
    TransportError,
    Unauthenticated,
    UnknownRecordKind,
    UnsupportedRecordVersion,
)

__all__ = [
    "ConfigurationError",
    "ConsistencyTimeout",
    "EmbeddingMismatch",
    "Forbidden",
    "InvalidInput",
    "NotFound",
    "PRMEError",
    "RecordDecodeError",
    "ShardUnavailable",
    "TransportError",
    "Unauthenticated",
    "UnknownRecordKind",
    "UnsupportedRecordVersion",
]
