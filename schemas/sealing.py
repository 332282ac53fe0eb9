"""Sealing: a record's private fields encrypted with its owner's data key (AES-GCM).

On the log a sealed record is a msgpack map of the envelope the log and the audit need
(``v``, ``kind``, ``event_id``, ``owner``, ``session_id``, ``scope``, ``recorded_at``,
``occurred_at``, ``request_id``) plus ``kid`` (which of the owner's keys) and ``sealed``:
a 12-byte nonce followed by the AES-GCM ciphertext of the whole plain record (its usual
msgpack encoding), authenticated together with ``owner``, ``event_id`` and ``kind``.
Deleting the owner's key (crypto-shredding) leaves only the envelope readable.

A record without ``sealed`` (written before sealing existed, or an ``owner_erased``
marker, which is never sealed) decodes as a plain record. Nothing here knows where keys
are kept; callers hand in the keys (``keys_of``, ``open_record``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import datetime

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from .codec import decode_record
from .errors import RecordDecodeError
from .records import AnyRecord, kind_of

UNSEALED_KINDS = frozenset({"owner_erased"})
"""Kinds never sealed: the erasure marker must stay readable once the key is gone."""
KEY_BYTES = 32
"""AES-256."""
_NONCE_BYTES = 12


class DataKey(msgspec.Struct, frozen=True):
    """One data key of one owner: ``kid`` names it in the records it sealed."""

    kid: str
    key: bytes


def new_data_key() -> DataKey:
    """A fresh random AES-256 key with a random 64-bit id."""
    return DataKey(os.urandom(8).hex(), AESGCM.generate_key(bit_length=KEY_BYTES * 8))


class Envelope(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What stays readable of a record: the envelope, and for a sealed one the key id and
    the ciphertext (decoding a plain record into it reads only the envelope fields)."""

    v: int
    kind: str
    event_id: str
    owner: str
    session_id: str = "default"
    scope: str = "default"
    recorded_at: datetime
    occurred_at: datetime | None = None
    request_id: str | None = None
    kid: str | None = None
    sealed: bytes | None = None


class ErasedRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A sealed record whose key is gone: its envelope only (what ``prme audit`` shows)."""

    v: int
    kind: str
    event_id: str
    owner: str
    session_id: str
    scope: str
    recorded_at: datetime
    occurred_at: datetime | None = None
    request_id: str | None = None
    erased: bool = True


KeyRef = tuple[str, str]
"""``(owner, kid)``."""

_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_envelope_encoder = msgspec.msgpack.Encoder()


def envelope_of(data: bytes) -> Envelope:
    """The envelope of a record's log bytes, sealed or plain (RecordDecodeError if none)."""
    try:
        return _envelope_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as error:
        raise RecordDecodeError(f"invalid record envelope: {error}") from error


def record_envelope(record: AnyRecord) -> Envelope:
    """``envelope_of`` the record's encoding, read from the record itself (no decode)."""
    return Envelope(
        v=record.v,
        kind=kind_of(record),
        event_id=record.event_id,
        owner=record.owner,
        session_id=record.session_id,
        scope=record.scope,
        recorded_at=record.recorded_at,
        occurred_at=record.occurred_at,
        request_id=record.request_id,
    )


def key_ref(data: bytes) -> KeyRef | None:
    """The ``(owner, kid)`` a record's bytes need to be opened; ``None`` for a plain record
    (or bytes that are not a record: opening them reports why)."""
    try:
        envelope = _envelope_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if envelope.sealed is None or envelope.kid is None:
        return None
    return envelope.owner, envelope.kid


def _aad(owner: str, event_id: str, kind: str) -> bytes:
    return b"\x1f".join((owner.encode(), event_id.encode(), kind.encode()))


class Sealer:
    """Seals and opens record bytes; keeps one AES-GCM context per key id it has used
    (bounded: the oldest are dropped)."""

    def __init__(self, max_contexts: int = 4096) -> None:
        self._contexts: dict[str, tuple[bytes, AESGCM]] = {}
        self._max = max_contexts

    def _context(self, kid: str, key: bytes) -> AESGCM:
        held = self._contexts.get(kid)
        if held is not None and held[0] == key:
            return held[1]
        if len(self._contexts) >= self._max:
            self._contexts.pop(next(iter(self._contexts)))
        context = AESGCM(key)
        self._contexts[kid] = (key, context)
        return context

    def forget(self, kid: str) -> None:
        """Drop the context of ``kid`` (its key was erased)."""
        self._contexts.pop(kid, None)

    def seal(self, plain: bytes, key: DataKey, envelope: Envelope | None = None) -> bytes:
        """The sealed form of ``plain`` (a plain record's log bytes). Records of
        :data:`UNSEALED_KINDS` and already sealed bytes come back unchanged. ``envelope``:
        ``envelope_of(plain)``, when the caller has it already."""
        if envelope is None:
            envelope = envelope_of(plain)
        if envelope.sealed is not None or envelope.kind in UNSEALED_KINDS:
            return plain
        nonce = os.urandom(_NONCE_BYTES)
        box = self._context(key.kid, key.key).encrypt(
            nonce, plain, _aad(envelope.owner, envelope.event_id, envelope.kind)
        )
        return _envelope_encoder.encode(
            msgspec.structs.replace(envelope, kid=key.kid, sealed=nonce + box)
        )

    def open(self, data: bytes, key: bytes | None) -> tuple[AnyRecord | ErasedRecord, bytes]:
        """The record in ``data`` and its plain bytes: a plain record as it is; a sealed one
        opened with ``key``, or an :class:`ErasedRecord` (and ``data``) when ``key`` is
        ``None``. RecordDecodeError when the bytes are no record or do not open."""
        try:
            envelope = _envelope_decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            decode_record(data)  # raises the codec's own explanation (not msgpack, kind, ...)
            raise RecordDecodeError(f"invalid record envelope: {error}") from error
        if envelope.sealed is None:
            return decode_record(data), data
        if key is None or envelope.kid is None:
            return erased_view(envelope), data
        nonce, box = envelope.sealed[:_NONCE_BYTES], envelope.sealed[_NONCE_BYTES:]
        try:
            plain = self._context(envelope.kid, key).decrypt(
                nonce, box, _aad(envelope.owner, envelope.event_id, envelope.kind)
            )
        except InvalidTag as error:
            raise RecordDecodeError(
                f"sealed record {envelope.event_id} does not open with key {envelope.kid} "
                "of its owner (tampered or corrupt)"
            ) from error
        record = decode_record(plain)
        if (record.owner, record.event_id, kind_of(record)) != (
            envelope.owner,
            envelope.event_id,
            envelope.kind,
        ):
            raise RecordDecodeError(
                f"sealed record {envelope.event_id}: its envelope does not match its content"
            )
        return record, plain

    def seal_bytes(self, plain: bytes, key: DataKey, aad: bytes) -> bytes:
        """``plain`` sealed with ``key`` (nonce, then ciphertext), bound to ``aad``: for
        owner data kept beside the log, such as the vector changelog's vectors."""
        nonce = os.urandom(_NONCE_BYTES)
        return nonce + self._context(key.kid, key.key).encrypt(nonce, plain, aad)

    def open_bytes(self, sealed: bytes, key: DataKey, aad: bytes) -> bytes:
        """What :meth:`seal_bytes` sealed; RecordDecodeError if it does not open."""
        nonce, box = sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:]
        try:
            return self._context(key.kid, key.key).decrypt(nonce, box, aad)
        except InvalidTag as error:
            raise RecordDecodeError(
                f"sealed bytes do not open with key {key.kid} (tampered or corrupt)"
            ) from error

    def open_with(
        self, data: bytes, keys: Mapping[KeyRef, bytes] | Callable[[KeyRef], bytes | None]
    ) -> tuple[AnyRecord | ErasedRecord, bytes]:
        """:meth:`open` with the key looked up in ``keys`` by the record's ``(owner, kid)``."""
        ref = key_ref(data)
        if ref is None:
            return self.open(data, None)
        key = keys.get(ref) if isinstance(keys, Mapping) else keys(ref)
        return self.open(data, key)


_ERASED_FIELDS = tuple(f for f in ErasedRecord.__struct_fields__ if f != "erased")


def erased_view(envelope: Envelope) -> ErasedRecord:
    """The envelope of a record whose key is gone, as ``prme audit`` shows it."""
    return ErasedRecord(**{name: getattr(envelope, name) for name in _ERASED_FIELDS})


def is_sealed(data: bytes) -> bool:
    """Whether ``data`` is a sealed record."""
    return key_ref(data) is not None
