"""Codecs: msgpack for the log, JSON for the edge. Built once, reused."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .errors import RecordDecodeError, UnknownRecordKind, UnsupportedRecordVersion
from .records import KINDS, SCHEMA_VERSION, AnyRecord, Record

T = TypeVar("T")

_msgpack_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(AnyRecord)
_json_encoder = msgspec.json.Encoder()
_json_record_decoder = msgspec.json.Decoder(AnyRecord)


def encode_record(record: Record) -> bytes:
    """The record as msgpack bytes, as written to the log."""
    return _msgpack_encoder.encode(record)


def _check_version(record: Record) -> Record:
    if record.v > SCHEMA_VERSION:
        raise UnsupportedRecordVersion(
            f"record {record.event_id} has schema version {record.v}; this PRME reads up to "
            f"{SCHEMA_VERSION} (upgrade PRME to read it)"
        )
    return record


def _explain(header: Any, error: msgspec.ValidationError) -> RecordDecodeError:
    if isinstance(header, dict):
        kind, version = header.get("kind"), header.get("v")
        if isinstance(version, int) and version > SCHEMA_VERSION:
            return UnsupportedRecordVersion(
                f"record schema version {version} is newer than {SCHEMA_VERSION}, the newest "
                "this PRME reads"
            )
        if kind not in KINDS:
            return UnknownRecordKind(f"unknown record kind {kind!r} (known: {sorted(KINDS)})")
    return RecordDecodeError(f"invalid record: {error}")


def _decode(
    data: bytes | str,
    typed: Callable[[Any], Any],
    untyped: Callable[[Any], Any],
    form: str,
) -> AnyRecord:
    """``data`` through ``typed`` (a record decoder); a :class:`RecordDecodeError` subclass
    if it is not ``form`` or not a record this PRME reads (``untyped`` reads the header that
    says which)."""
    try:
        return _check_version(typed(data))  # type: ignore[return-value]
    except msgspec.ValidationError as error:
        try:
            header = untyped(data)
        except msgspec.DecodeError as inner:
            raise RecordDecodeError(f"not {form}: {inner}") from error
        raise _explain(header, error) from error
    except msgspec.DecodeError as error:
        raise RecordDecodeError(f"not {form}: {error}") from error


def decode_record(data: bytes) -> AnyRecord:
    """Decode log bytes into a record; raises a :class:`RecordDecodeError` subclass."""
    return _decode(data, _record_decoder.decode, msgspec.msgpack.decode, "msgpack")


def record_to_json(record: Record) -> bytes:
    """The record as JSON (for the edge and for audit output)."""
    return _json_encoder.encode(record)


def record_from_json(data: bytes | str) -> AnyRecord:
    """Decode a JSON record (same checks as :func:`decode_record`)."""
    return _decode(data, _json_record_decoder.decode, msgspec.json.decode, "JSON")


_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)


def explain_json_error(error: msgspec.DecodeError, text: bytes) -> msgspec.DecodeError:
    """``error`` from decoding JSON ``text``, or, where ``text`` holds a lone surrogate
    escape, an error that says so: msgspec reports one as "Input data was truncated",
    which sends people looking for a cut-off body."""
    if isinstance(error, msgspec.ValidationError):
        return error
    lone = _lone_surrogate(text)
    if lone is None:
        return error
    escape, at = lone
    return msgspec.DecodeError(
        f"invalid unicode escape {escape} at byte {at}: a lone surrogate is not a "
        "character (escape a surrogate pair, or send the text as UTF-8)"
    )


def _lone_surrogate(text: bytes) -> tuple[str, int] | None:
    """The first ``\\uD800``-``\\uDFFF`` escape of ``text`` that is not half of a pair, and
    where it is."""
    pending: re.Match[bytes] | None = None  # a high surrogate waiting for its low half
    for match in _ESCAPE.finditer(text):
        code = int(match.group(1), 16) if match.group(1) else None
        if pending is not None:
            if code is not None and 0xDC00 <= code <= 0xDFFF and match.start() == pending.end():
                pending = None
                continue
            break
        if code is not None and 0xD800 <= code <= 0xDBFF:
            pending = match
        elif code is not None and 0xDC00 <= code <= 0xDFFF:
            return match.group().decode(), match.start()
    if pending is not None:
        return pending.group().decode(), pending.start()
    return None
