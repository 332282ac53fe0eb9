"""Building ingest lines into log items in a worker process, so that building the next
lines overlaps sending the previous ones (on one interpreter the two share one core: the
GIL keeps a builder thread from running beside the event loop's sends).

The worker runs the same code as the in-process path (``message_from_line``), so what
it writes is byte for byte what ``prme ingest`` writes without it, apart from the event
ids, timestamps and nonces every build draws.

Sealing: the parent hands each chunk the writing keys it holds fresh for the owners it
has seen lately (``KeyStore.held_writing_keys``: read from the store within
``write_ttl_s``, none created); the worker seals those owners' records with them. A
record of an owner not among them comes back plain and is sealed in the parent before
its batch is sent. The worker never reads or creates keys itself and holds a key no
longer than the chunk it came with, so an erasure elsewhere reaches this ingest within
the parent's ``write_ttl_s`` plus the time the chunks built ahead take to send.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import msgspec

from prme.schemas.config import LimitsSettings
from prme.schemas.errors import InvalidInput
from prme.schemas.sealing import DataKey, Sealer, record_envelope

from .local_log import LocalLogTransport
from .producer import Producer
from .transport import LogItem

BUILD_CHUNK = 5_000
"""Lines a worker builds per call: large enough that the hand-over (the keys of the recent
owners, the chunk's bytes each way) is small per line. Sealed lines/s on Kafka, medians
of 5 interleaved runs, two rounds: 2,000 lines 58.2k and 53.9k, 5,000 lines 63.8k and
57.5k (1,000: 59.1k; 10,000: 63.6k)."""
BUILD_AHEAD = 4
"""Chunks built or building ahead of the one being sent (20,000 lines): the keys of their
new owners are created meanwhile, so a creation's round trip seldom holds up the sends."""
WORKER_QUEUE = 2
"""Chunks handed to the worker at once (one building, the next waiting), so it does not
idle while the parent takes a chunk back and creates its owners' keys. Sealed lines/s on
Kafka, medians of 5 interleaved runs: 1 chunk 48.4k, 2 chunks 60.0k, 3 chunks 59.8k; the
first WORKER_QUEUE chunks go before any key is known and are sealed in the parent."""
LOCAL_EVERY = 3
"""Every third chunk is built by the sending process itself, when its turn to be sent comes:
the worker builds a line in ~10 us and the sender spends ~2.6 us sending it and ~2.5 us
taking back a line the worker built, so with every chunk at the worker the worker is the
long pole and the hand-over is paid for every line. Measured: see benchmarks/README.md."""
LOCAL_SLICE = 500
"""Lines the sending process builds between two turns of its event loop."""
SEALING_OWNERS = 4_096
"""The most owners whose keys go with a chunk (the most recently seen ones)."""


class BuiltLine(msgspec.Struct, frozen=True, array_like=True):
    """One line's outcome: its log item, or why it was refused."""

    number: int
    item: LogItem | None = None
    event_id: str | None = None
    error: str | None = None
    owner: str | None = None
    sealed: bool = False
    """Sealed when it was built (with a key the sending process held)."""


def build_lines(
    first_number: int,
    lines: list[bytes],
    limits: LimitsSettings,
    keys: dict[str, DataKey] | None = None,
) -> bytes:
    """``build_chunk`` in the worker, msgpack-encoded for the trip back to the parent."""
    # Only the builders are used: this producer never appends (its log is never started).
    producer = Producer(LocalLogTransport(Path(os.devnull), 1), limits)
    return msgspec.msgpack.encode(build_chunk(first_number, lines, producer, Sealer(), keys))


def build_chunk(
    first_number: int,
    lines: list[bytes],
    producer: Producer,
    sealer: Sealer,
    keys: dict[str, DataKey] | None = None,
) -> list[BuiltLine]:
    """Build ``lines`` (numbered from ``first_number``; blank lines skipped) into log items
    with ``producer``'s builders; the records of owners in ``keys`` are sealed with their
    key."""
    from .ingest import message_from_line

    built: list[BuiltLine] = []
    for number, raw in enumerate(lines, start=first_number):
        if not raw.strip():
            continue
        try:
            record, item = message_from_line(raw, producer)
        except InvalidInput as error:
            built.append(BuiltLine(number, error=str(error)))
            continue
        key = keys.get(record.owner) if keys else None
        if key is not None:
            sealed = sealer.seal(item.value, key, record_envelope(record))
            item = msgspec.structs.replace(item, value=sealed)
        built.append(BuiltLine(number, item, record.event_id, None, record.owner, key is not None))
    return built


_built_decoder = msgspec.msgpack.Decoder(list[BuiltLine])


def decode_built(data: bytes) -> list[BuiltLine]:
    return _built_decoder.decode(data)


PARENT_CHECK_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """In the worker: exit once ``parent`` is gone. After a kill -9 of ``prme ingest`` its
    worker waited for tasks forever, reparented to init (an operations trial found one
    still there 17 minutes later)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="prme-builder-parent", daemon=True).start()


def builder_process() -> Executor:
    """One worker process for ``ingest_lines(builder=...)``, forked now (it needs no imports
    and starts at once): create it before the transport starts threads, so the fork copies
    no thread that could hold a lock. (A process pool forks lazily, at its first task; the
    no-op task here makes that happen at creation.)"""
    pool = ProcessPoolExecutor(
        max_workers=1,
        mp_context=multiprocessing.get_context("fork"),
        initializer=_exit_with_parent,
        initargs=(os.getpid(),),
    )
    # The child's collector leaves what it inherits alone, so it does not touch (copy) every
    # page of the parent's objects: 100k sealed lines, median of 4 interleaved runs each,
    # 72.6k -> 76.4k lines/s, the worker's CPU 1.05 -> 0.98 s (Python's gc.freeze docs).
    # (A caller's own frozen objects are left as they are.)
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.freeze()
    try:
        pool.submit(int).result()
    finally:
        if freezing:
            gc.unfreeze()
    return pool
