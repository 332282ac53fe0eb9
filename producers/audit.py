"""Read every raw record of one owner back from the log (the audit trail)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from prme.schemas.codec import decode_record
from prme.schemas.errors import RecordDecodeError

from .transport import LogTransport


class AuditRow(msgspec.Struct, frozen=True, omit_defaults=True):
    partition: int
    offset: int
    timestamp_ms: int
    record: Any = None
    error: str | None = None


async def audit_owner(
    transport: LogTransport, owner: str, page: int = 1000
) -> AsyncIterator[AuditRow]:
    """Every record keyed by ``owner``, in log order; undecodable ones carry ``error``."""
    key = owner.encode()
    partition = transport.partition_for(key)
    end = (await transport.end_offsets())[partition]
    offset = 0
    while offset < end:
        entries = await transport.read(partition, offset, page)
        if not entries:
            return
        for entry in entries:
            if entry.key != key:
                continue
            try:
                yield AuditRow(
                    entry.partition, entry.offset, entry.timestamp_ms, decode_record(entry.value)
                )
            except RecordDecodeError as error:
                yield AuditRow(entry.partition, entry.offset, entry.timestamp_ms, error=str(error))
        offset = entries[-1].offset + 1
