"""The dead-letter log: records that could not be decoded or applied, with the error.

It is a log transport of its own (topic ``prme.events.dlq`` on Kafka, ``dlq.sqlite3`` next
to the embedded log), one partition, so the same tools read it.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

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


def open_dead_letters(settings: Settings) -> LogTransport:
    """A not-yet-started single-partition transport for dead letters."""
    if settings.log.transport == "kafka":
        from prme.producers.kafka_log import KafkaLogTransport

        return KafkaLogTransport(
            settings.log.bootstrap,
            settings.log.dlq_topic,
            1,
            request_timeout_s=settings.log.request_timeout_s,
        )
    from prme.producers.local_log import LocalLogTransport

    return LocalLogTransport(Path(settings.data_dir) / "dlq.sqlite3", 1)


async def send_dead_letter(transport: LogTransport, letter: DeadLetter) -> None:
    await transport.append(LogItem(b"dlq", _encoder.encode(letter)))


async def read_dead_letters(transport: LogTransport) -> list[DeadLetter]:
    letters: list[DeadLetter] = []
    offset = 0
    while entries := await transport.read(0, offset, 500):
        letters.extend(_decoder.decode(e.value) for e in entries)
        offset = entries[-1].offset + 1
    return letters
