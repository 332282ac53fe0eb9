"""The one exception hierarchy (defined in ``prme.schemas.errors``)."""

from prme.schemas.errors import (
    ConfigurationError,
    ConsistencyTimeout,
    DataDirInUse,
    EmbeddingMismatch,
    Forbidden,
    InvalidInput,
    NotFound,
    PRMEError,
    RecordDecodeError,
    RequestIdConflict,
    ShardUnavailable,
    TransportError,
    Unauthenticated,
    UnknownRecordKind,
    UnsupportedRecordVersion,
    WriteUnconfirmed,
)

__all__ = [
    "ConfigurationError",
    "ConsistencyTimeout",
    "DataDirInUse",
    "EmbeddingMismatch",
    "Forbidden",
    "InvalidInput",
    "NotFound",
    "PRMEError",
    "RecordDecodeError",
    "RequestIdConflict",
    "ShardUnavailable",
    "TransportError",
    "Unauthenticated",
    "UnknownRecordKind",
    "UnsupportedRecordVersion",
    "WriteUnconfirmed",
]
