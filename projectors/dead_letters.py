"""The dead-letter log: records that could not be decoded or applied, with the error.

It is a log transport of its own (topic ``prme.events.dlq`` on Kafka, ``dlq.sqlite3`` next
to the embedded log), one partition, so the same tools read it.
"""

from __future__ import annotations

import msgspec

from prme.producers.factory import open_dead_letters
from prme.producers.transport import LogItem, LogTransport
from prme.schemas.config import Settings


class DeadLetter(msgspec.Struct, frozen=True):
    partition: int
    offset: int
    error: str
    value: bytes
    model: str | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(DeadLetter)

__all__ = [
    "DeadLetter",
    "dead_letters_of",
    "open_dead_letters",
    "read_dead_letters",
    "send_dead_letter",
]


async def send_dead_letter(transport: LogTransport, letter: DeadLetter) -> None:
    await transport.append(LogItem(b"dlq", _encoder.encode(letter)))


async def read_dead_letters(transport: LogTransport) -> list[DeadLetter]:
    letters: list[DeadLetter] = []
    offset = 0
    while entries := await transport.read(0, offset, 500):
        letters.extend(_decoder.decode(e.value) for e in entries)
        offset = entries[-1].offset + 1
    return letters


async def dead_letters_of(settings: Settings) -> list[DeadLetter]:
    """Every dead letter of the log ``settings`` name (opens and closes its own transport)."""
    transport = open_dead_letters(settings)
    await transport.start()
    try:
        return await read_dead_letters(transport)
    finally:
        await transport.close()
