"""Batch ingest of JSON lines (one message per line) with bounded in-flight batches."""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from datetime import datetime
from typing import Any, Literal

import msgspec

from prme.schemas.errors import InvalidInput

from .producer import MessageDraft, Producer
from .transport import LogItem


class IngestLine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One line of an ingest file: the fields of a ``MessageDraft`` (``session`` and ``time``
    in the file are its ``session_id`` and ``occurred_at``)."""

    owner: str
    content: str | list[dict[str, Any]]
    session_id: str = msgspec.field(default="default", name="session")
    role: str = "user"
    scope: str = "default"
    name: str | None = None
    occurred_at: datetime | None = msgspec.field(default=None, name="time")
    metadata: dict[str, Any] = {}
    request_id: str | None = None


class LineError(msgspec.Struct, frozen=True):
    line: int
    error: str


class IngestSummary(msgspec.Struct, frozen=True, kw_only=True):
    lines: int
    written: int
    """Records appended (lines whose request_id was already on the log excluded)."""
    skipped: int
    """Bad lines passed over (``on_error="skip"``)."""
    seconds: float
    records_per_s: float
    errors: list[LineError]
    duplicates: int = 0
    """Lines whose (owner, request_id) was already on the log: not written again."""
    stopped_at: int | None = None
    """The bad line that stopped the ingest (``on_error="stop"``): every line before it
    is written, none from it on."""


_line_decoder = msgspec.json.Decoder(IngestLine)


def draft_from_line(line: bytes | str, producer: Producer) -> Any:
    """Parse and validate one JSONL line into a message record (raises InvalidInput)."""
    try:
        parsed = _line_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise InvalidInput(str(error)) from error
    try:
        return producer.build_message(MessageDraft(**msgspec.structs.asdict(parsed)))
    except InvalidInput as error:  # name the fields as the line spells them
        message = str(error)
        for field, spelled in _LINE_NAMES.items():
            message = message.replace(f"$.{field}", f"$.{spelled}")
        raise InvalidInput(message) from error


_LINE_NAMES = {"session_id": "session", "occurred_at": "time"}
"""The draft fields a line spells otherwise (``IngestLine``)."""


async def ingest_lines(
    lines: Iterable[bytes],
    producer: Producer,
    *,
    on_error: Literal["skip", "stop"] = "stop",
    batch_size: int = 500,
    max_in_flight: int = 16,
    progress: Callable[[int], None] | None = None,
    builder: Executor | None = None,
) -> IngestSummary:
    """Validate each line, append in batches with at most ``max_in_flight`` batches pending.

    With ``on_error="stop"`` the first bad line stops the ingest: every line before it
    is written, none from it on (the summary's ``stopped_at``). With ``builder`` (see
    ``ingest_build.builder_process``) lines are built there, a few chunks ahead, while
    this process sends: the same records and batches, built on another core.
    """
    if builder is not None:
        return await _ingest_built(
            lines, producer, builder, on_error, batch_size, max_in_flight, progress
        )
    started = time.perf_counter()
    hits_before = getattr(producer.transport, "dedupe_hits", 0)
    errors: list[LineError] = []
    sender = _InFlight(max_in_flight, progress)
    count = 0
    batch: list[Any] = []

    async def flush() -> None:
        nonlocal batch
        if not batch:
            return
        records, batch = batch, []
        # Lines are independent records: no transaction per batch (on Kafka that would
        # serialise the batches in flight).
        await sender.send(
            functools.partial(producer.append_records, records, atomic=False), len(records)
        )

    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        count += 1
        try:
            batch.append(draft_from_line(raw, producer))
        except InvalidInput as error:
            errors.append(LineError(number, str(error)))
            if on_error == "stop":
                break
            continue
        if len(batch) >= batch_size:
            await flush()
    await flush()
    await sender.drain()
    duplicates = getattr(producer.transport, "dedupe_hits", 0) - hits_before
    return _summary(started, count, sender.written - duplicates, errors, on_error, duplicates)


def _report(progress: Callable[[int], None], count: int, _task: asyncio.Task[Any]) -> None:
    progress(count)


class _InFlight:
    """Appends sent without waiting for them, at most ``limit`` pending at a time; counts
    the records they carry and reports each append's count to ``progress`` when it lands."""

    def __init__(self, limit: int, progress: Callable[[int], None] | None) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()
        self._limit = limit
        self._progress = progress
        self.written = 0

    async def send(self, append: Callable[[], Awaitable[Any]], count: int) -> None:
        """Start ``append()`` once fewer than ``limit`` are pending (a failed one raises)."""
        while len(self._tasks) >= self._limit:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                self._tasks.discard(task)
                task.result()
        task = asyncio.ensure_future(append())
        self._tasks.add(task)
        self.written += count
        if self._progress is not None:
            task.add_done_callback(functools.partial(_report, self._progress, count))

    async def drain(self) -> None:
        """Wait for every append still pending; raise the first failure."""
        if self._tasks:
            for task in await asyncio.gather(*self._tasks, return_exceptions=True):
                if isinstance(task, BaseException):
                    raise task


def _summary(
    started: float,
    count: int,
    written: int,
    errors: list[LineError],
    on_error: Literal["skip", "stop"],
    duplicates: int = 0,
) -> IngestSummary:
    seconds = time.perf_counter() - started
    stopped = on_error == "stop" and bool(errors)
    return IngestSummary(
        lines=count,
        written=written,
        skipped=0 if stopped else len(errors),
        stopped_at=errors[0].line if stopped else None,
        seconds=seconds,
        records_per_s=written / seconds if seconds > 0 else 0.0,
        errors=errors,
        duplicates=duplicates,
    )


async def _ingest_built(
    lines: Iterable[bytes],
    producer: Producer,
    builder: Executor,
    on_error: Literal["skip", "stop"],
    batch_size: int,
    max_in_flight: int,
    progress: Callable[[int], None] | None,
) -> IngestSummary:
    """``ingest_lines`` with the building done by ``builder``: the same batching, limits,
    error handling and summary."""
    from .ingest_build import (
        BUILD_AHEAD,
        BUILD_CHUNK,
        SEALING_OWNERS,
        WORKER_QUEUE,
        BuiltLine,
        build_lines,
        decode_built,
    )

    started = time.perf_counter()
    hits_before = getattr(producer.transport, "dedupe_hits", 0)
    loop = asyncio.get_running_loop()
    errors: list[LineError] = []
    sender = _InFlight(max_in_flight, progress)
    pending: collections.deque[asyncio.Future[list[BuiltLine]]] = collections.deque()
    count = 0
    batch: list[LogItem] = []
    event_ids: list[str] = []
    unsealed: list[int] = []  # the batch's items the worker did not seal

    async def flush() -> None:
        nonlocal batch, event_ids, unsealed
        if not batch:
            return
        items, ids, plain = batch, event_ids, unsealed
        batch, event_ids, unsealed = [], [], []
        # Sealed here, batch after batch, so the batches reach the log in the file's order.
        if plain:
            sealed = await producer.seal_items([items[i] for i in plain])
            for index, item in zip(plain, sealed, strict=True):
                items[index] = item
        append = functools.partial(producer.append_items, items, ids, atomic=False, sealed=True)
        await sender.send(append, len(items))

    # The owners of the latest lines, whose keys go with the next chunk (see ingest_build).
    recent: collections.OrderedDict[str, None] = collections.OrderedDict()

    async def remember(built: list[BuiltLine]) -> None:
        """Note the owners of ``built`` (up to a line that stops the ingest) as recent, and
        have their keys ready: created in one key-store call, while the chunks before are
        still being sent (so an ingest stopped by a bad line may leave a key for an owner of
        a later chunk, which seals nothing)."""
        owners: dict[str, None] = {}
        for line in built:
            if line.error is not None and on_error == "stop":
                break
            if line.owner is not None:
                owners[line.owner] = None
        if await producer.sealing_keys(owners) is None:
            return
        for owner in owners:
            recent[owner] = None
            recent.move_to_end(owner)
        while len(recent) > SEALING_OWNERS:
            recent.popitem(last=False)

    async def take(built: list[BuiltLine]) -> bool:
        """Batch the built lines; ``False`` once a bad line stops the ingest."""
        nonlocal count
        for line in built:
            count += 1
            if line.error is not None:
                errors.append(LineError(line.number, line.error))
                if on_error == "stop":
                    return False
                continue
            assert line.item is not None and line.event_id is not None
            if not line.sealed:
                unsealed.append(len(batch))
            batch.append(line.item)
            event_ids.append(line.event_id)
            if len(batch) >= batch_size:
                await flush()
        return True

    async def built(
        first: int,
        chunk: list[bytes],
        before: asyncio.Future[None] | None,
        done: asyncio.Future[None],
    ) -> list[BuiltLine]:
        """Chunk ``first`` built by the worker once ``before`` (an earlier chunk) is back
        and its owners' keys are ready, so it goes with them; ``done`` is set when this
        chunk is back and its keys are ready."""
        try:
            if before is not None:
                await asyncio.wait([before])
            keys = producer.held_sealing_keys(recent) if recent else None
            data = await loop.run_in_executor(
                builder, build_lines, first, chunk, producer.limits, keys
            )
            lines = decode_built(data)
            await remember(lines)
            return lines
        finally:
            if not done.done():
                done.set_result(None)

    # Set as each of the chunks last handed over is back (and its keys ready): a chunk goes
    # to the worker once the one WORKER_QUEUE before it is, so the worker has the next
    # chunks queued while the parent takes one back and creates its owners' keys.
    handed: collections.deque[asyncio.Future[None]] = collections.deque(maxlen=WORKER_QUEUE)

    def submit(first: int, chunk: list[bytes]) -> None:
        done = loop.create_future()
        before = handed[0] if len(handed) == WORKER_QUEUE else None
        pending.append(asyncio.ensure_future(built(first, chunk, before, done)))
        handed.append(done)

    going = True
    number, chunk = 1, []
    try:
        for raw in lines:
            chunk.append(raw)
            if len(chunk) < BUILD_CHUNK:
                continue
            submit(number, chunk)
            number, chunk = number + len(chunk), []
            while going and len(pending) > BUILD_AHEAD:  # chunks building while one is sent
                going = await take(await pending.popleft())
            if not going:
                break
        if going and chunk:
            submit(number, chunk)
        while going and pending:
            going = await take(await pending.popleft())
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await flush()
    await sender.drain()
    duplicates = getattr(producer.transport, "dedupe_hits", 0) - hits_before
    return _summary(started, count, sender.written - duplicates, errors, on_error, duplicates)
