"""The one table between PRME errors and HTTP: the service maps an error to a status and
an error kind, ``HttpMemoryBackend`` maps them back to the same exception."""

from __future__ import annotations

from prme.schemas.errors import (
    AppendUnconfirmed,
    ConfigurationError,
    ConsistencyTimeout,
    EmbeddingMismatch,
    Forbidden,
    InvalidInput,
    NotFound,
    PRMEError,
    RequestIdConflict,
    ShardUnavailable,
    TransportError,
    Unauthenticated,
    WriteUnconfirmed,
)

ERROR_STATUS: list[tuple[type[PRMEError], int, str]] = [
    (Unauthenticated, 401, "unauthenticated"),
    (Forbidden, 403, "forbidden"),
    (NotFound, 404, "not_found"),
    (EmbeddingMismatch, 409, "embedding_mismatch"),
    (RequestIdConflict, 409, "request_id_conflict"),
    (InvalidInput, 400, "invalid_input"),
    (WriteUnconfirmed, 504, "write_unconfirmed"),
    (ConsistencyTimeout, 504, "consistency_timeout"),
    (ShardUnavailable, 503, "shard_unavailable"),
    (AppendUnconfirmed, 504, "append_unconfirmed"),
    (TransportError, 503, "transport_unavailable"),
    (ConfigurationError, 500, "configuration_error"),
]
"""Most specific first: the first class an error is an instance of gives its status and
kind."""

HTTP_KINDS: dict[int, str] = {
    400: "invalid_input",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}
"""The kind of an error the HTTP layer raises itself (no PRME exception behind it)."""

_KIND_ERRORS: dict[str, type[PRMEError]] = {
    **{kind: error for error, _, kind in ERROR_STATUS},
    "payload_too_large": InvalidInput,
    "unsupported_media_type": InvalidInput,
}
_STATUS_ERRORS: dict[int, type[PRMEError]] = {
    **{status: error for error, status, _ in reversed(ERROR_STATUS) if status < 500},
    413: InvalidInput,
    503: ShardUnavailable,
    504: ConsistencyTimeout,
}


def status_of(error: PRMEError) -> tuple[int, str] | None:
    """The HTTP status and error kind of ``error`` (None for an error outside the table)."""
    for error_type, status, kind in ERROR_STATUS:
        if isinstance(error, error_type):
            return status, kind
    return None


def error_of(kind: str, status: int, detail: str) -> PRMEError:
    """The exception an error response stands for: by its kind, else by its status."""
    error_type = _KIND_ERRORS.get(kind) or _STATUS_ERRORS.get(status, PRMEError)
    return error_type(f"{detail} (HTTP {status})")
