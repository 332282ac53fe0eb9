"""Batch ingest of JSON lines (one message per line) with bounded in-flight batches."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from datetime import datetime
from typing import Any, Literal

import msgspec

from prme.schemas.codec import explain_json_error
from prme.schemas.errors import TOO_DEEP, InvalidInput, reused_request_id
from prme.schemas.records import Message

from .producer import Producer
from .transport import LogItem, LogTransport, split_dedupe_key


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


def message_from_line(line: bytes | str, producer: Producer) -> tuple[Message, LogItem]:
    """Parse and validate one JSONL line into a message record and its log item (raises
    InvalidInput)."""
    try:
        parsed = _line_decoder.decode(line)
    except msgspec.DecodeError as error:
        text = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
        raise InvalidInput(str(explain_json_error(error, text))) from error
    except RecursionError as error:
        raise InvalidInput(f"the line has {TOO_DEEP}") from error
    try:
        return producer.build_message_item(msgspec.structs.asdict(parsed))
    except InvalidInput as error:  # name the fields as the line spells them
        message = str(error)
        for field, spelled in _LINE_NAMES.items():
            message = message.replace(f"$.{field}", f"$.{spelled}")
        raise InvalidInput(message) from error


_LINE_NAMES = {"session_id": "session", "occurred_at": "time"}
"""The draft fields a line spells otherwise (``IngestLine``)."""


INGEST_BATCH = 5_000
"""Lines per append. On Kafka each append goes as one record batch per partition (more
where a partition's share passes 256 KiB), and the producer, the broker and the acks pay
per batch: 100k sealed lines over 12 partitions,
5 interleaved runs in one hour, lines/s 0.84x a bare producer with 500-line appends,
0.92x with 2,000 and 0.94x with 5,000."""
MAX_INGEST_BATCH = 20_000
IN_FLIGHT_LINES = 20_000
"""Lines appended and not yet acknowledged, by default (memory: ~700 bytes a sealed line of
~300 bytes; at most 2 x MAX_INGEST_BATCH lines with the largest batches)."""
MAX_IN_FLIGHT = 16
"""Batches in flight at most, however small: each one sent waits on those pending (with
20,000 one-line batches in flight, `--batch-size 1` spent its time there). 64 in flight
measured 0.72 of 16's lines/s on Kafka (benchmarks/README.md)."""


def check_batch_size(batch_size: int) -> None:
    """InvalidInput unless ``batch_size`` is 1 to :data:`MAX_INGEST_BATCH` lines."""
    if not 1 <= batch_size <= MAX_INGEST_BATCH:
        raise InvalidInput(f"an ingest batch is 1 to {MAX_INGEST_BATCH} lines, not {batch_size}")


async def ingest_lines(
    lines: Iterable[bytes],
    producer: Producer,
    *,
    on_error: Literal["skip", "stop"] = "stop",
    batch_size: int = INGEST_BATCH,
    max_in_flight: int | None = None,
    progress: Callable[[int], None] | None = None,
    builder: Executor | None = None,
) -> IngestSummary:
    """Validate each line, append in batches of ``batch_size`` lines (1 to
    :data:`MAX_INGEST_BATCH`) with at most ``max_in_flight`` batches pending (default:
    :data:`IN_FLIGHT_LINES` lines' worth, 2 to :data:`MAX_IN_FLIGHT` batches).

    With ``on_error="stop"`` the first bad line stops the ingest: every line before it
    is written, none from it on (the summary's ``stopped_at``). Lines are built in chunks of
    ``BUILD_CHUNK``; with ``builder`` (see ``ingest_build.builder_process``) most chunks are
    built there, a few ahead, while this process sends: the same records and batches,
    built on another core.
    """
    check_batch_size(batch_size)
    if max_in_flight is None:
        max_in_flight = max(2, min(MAX_IN_FLIGHT, IN_FLIGHT_LINES // batch_size))
    return await _ingest(lines, producer, builder, on_error, batch_size, max_in_flight, progress)


def _report(progress: Callable[[int], None], count: int, task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is None:  # a failed append landed nothing
        progress(count)


class _InFlight:
    """Appends sent without waiting for them, at most ``limit`` pending at a time; counts
    the records they carry and reports each append's count to ``progress`` when it lands."""

    def __init__(self, limit: int, progress: Callable[[int], None] | None) -> None:
        self._tasks: dict[asyncio.Task[Any], None] = {}  # in the order they were sent
        self._limit = limit
        self._progress = progress
        self.written = 0

    async def send(self, append: Callable[[], Awaitable[Any]], count: int) -> None:
        """Start ``append()`` once fewer than ``limit`` are pending (a failed one raises)."""
        while len(self._tasks) >= self._limit:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            if any(task.cancelled() or task.exception() is not None for task in done):
                await self.drain()  # the others end first: none is left unretrieved
            for task in done:
                del self._tasks[task]
        task = asyncio.ensure_future(append())
        self._tasks[task] = None
        self.written += count
        if self._progress is not None:
            task.add_done_callback(functools.partial(_report, self._progress, count))

    async def drain(self) -> None:
        """Wait for every append still pending; raise the failure of the first one sent
        that failed."""
        tasks, self._tasks = list(self._tasks), {}
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    @contextlib.asynccontextmanager
    async def settled(self) -> AsyncIterator[None]:
        """Drains on the way out. When the block fails or is cancelled, the appends in
        flight end first (they are not cancelled: each was sent after the one before it, so
        what is on the log is the file's first lines, not a prefix with holes) and the
        block's error is raised, so no append goes on, or fails unseen, after the ingest
        returned."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(BaseException):
                await self.drain()
            raise
        await self.drain()


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


class _RequestIdClaims:
    """The request ids of this run's lines that are not on the log yet, with their writes'
    fingerprints: a line that reuses one of them, or one already on the log, for another
    write is a bad line, refused before its batch is sent (so ``stop`` keeps the file's
    first lines and ``skip`` passes over it, as for any bad line)."""

    def __init__(self, transport: LogTransport) -> None:
        self._transport = transport
        self._pending: dict[str, bytes | None] = {}

    async def conflicts(self, built: list[Any]) -> dict[int, str]:
        """Line number -> error, for the lines of ``built`` (``BuiltLine``) that conflict."""
        keyed = [
            (line.number, line.item.dedupe_key, line.item.fingerprint)
            for line in built
            if line.error is None and line.item is not None and line.item.dedupe_key is not None
        ]
        if not keyed:
            return {}
        fresh = [key for _, key, _ in keyed if key not in self._pending]
        written = await self._transport.written_fingerprints(fresh) if fresh else {}
        found: dict[int, str] = {}
        for number, key, fingerprint in keyed:
            if key in self._pending:
                first = self._pending[key]
            elif key in written:
                first = written[key]
            else:
                self._pending[key] = fingerprint
                continue
            if first is not None and fingerprint is not None and first != fingerprint:
                found[number] = (
                    f"{reused_request_id(*split_dedupe_key(key))}: a line must repeat the "
                    "write its request_id was first used for"
                )
        return found

    def landed(self, keys: Iterable[str]) -> None:
        """``keys`` are on the log now: the transport answers for them from here on."""
        for key in keys:
            self._pending.pop(key, None)


async def _ingest(
    lines: Iterable[bytes],
    producer: Producer,
    builder: Executor | None,
    on_error: Literal["skip", "stop"],
    batch_size: int,
    max_in_flight: int,
    progress: Callable[[int], None] | None,
) -> IngestSummary:
    """``ingest_lines``: chunks built by ``builder`` (all but every ``LOCAL_EVERY``-th) or
    here (every chunk, without a builder), taken back in file order, batched and sent."""
    from prme.schemas.sealing import Sealer

    from .ingest_build import (
        BUILD_AHEAD,
        BUILD_CHUNK,
        LOCAL_EVERY,
        LOCAL_SLICE,
        SEALING_OWNERS,
        WORKER_QUEUE,
        BuiltLine,
        build_chunk,
        build_lines,
        decode_built,
    )

    started = time.perf_counter()
    hits_before = getattr(producer.transport, "dedupe_hits", 0)
    loop = asyncio.get_running_loop()
    errors: list[LineError] = []
    sender = _InFlight(max_in_flight, progress)
    claims = _RequestIdClaims(producer.transport)
    # Chunks in file order: a worker's (its future) or one this process builds when its turn
    # comes (its first line number and lines).
    pending: collections.deque[asyncio.Future[list[BuiltLine]] | tuple[int, list[bytes]]] = (
        collections.deque()
    )
    count = 0
    batch: list[LogItem] = []
    event_ids: list[str] = []
    unsealed: list[int] = []  # the batch's items not sealed when they were built

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
        keys = [item.dedupe_key for item in items if item.dedupe_key is not None]

        async def append() -> None:
            await producer.append_items(items, ids, atomic=False, sealed=True)
            claims.landed(keys)

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
        conflicts = await claims.conflicts(built)
        for line in built:
            count += 1
            error = line.error or conflicts.get(line.number)
            if error is not None:
                errors.append(LineError(line.number, error))
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
            assert builder is not None
            data = await loop.run_in_executor(
                builder, build_lines, first, chunk, producer.limits, keys
            )
            lines = decode_built(data)
            await remember(lines)
            return lines
        finally:
            if not done.done():
                done.set_result(None)

    sealer = Sealer()

    async def here(first: int, chunk: list[bytes]) -> list[BuiltLine]:
        """Chunk ``first`` built in this process, ``LOCAL_SLICE`` lines between two turns of
        the event loop (so sends and acknowledgements go on meanwhile)."""
        keys = producer.held_sealing_keys(recent) if recent else None
        lines: list[BuiltLine] = []
        for start in range(0, len(chunk), LOCAL_SLICE):
            part = chunk[start : start + LOCAL_SLICE]
            lines.extend(build_chunk(first + start, part, producer, sealer, keys))
            await asyncio.sleep(0)
        await remember(lines)
        return lines

    async def next_built() -> list[BuiltLine]:
        chunk = pending.popleft()
        return await (here(*chunk) if isinstance(chunk, tuple) else chunk)

    # Set as each of the chunks last handed over is back (and its keys ready): a chunk goes
    # to the worker once the one WORKER_QUEUE before it is, so the worker has the next
    # chunks queued while the parent takes one back and creates its owners' keys.
    handed: collections.deque[asyncio.Future[None]] = collections.deque(maxlen=WORKER_QUEUE)
    submitted = 0

    def submit(first: int, chunk: list[bytes]) -> None:
        nonlocal submitted
        submitted += 1
        if builder is None or submitted % LOCAL_EVERY == 0:
            pending.append((first, chunk))
            return
        done = loop.create_future()
        before = handed[0] if len(handed) == WORKER_QUEUE else None
        pending.append(asyncio.ensure_future(built(first, chunk, before, done)))
        handed.append(done)

    ahead = BUILD_AHEAD if builder is not None else 0  # chunks built or building ahead
    going = True
    number, chunk = 1, []
    async with sender.settled():
        try:
            for raw in lines:
                chunk.append(raw)
                if len(chunk) < BUILD_CHUNK:
                    continue
                submit(number, chunk)
                number, chunk = number + len(chunk), []
                while going and len(pending) > ahead:
                    going = await take(await next_built())
                if not going:
                    break
            if going and chunk:
                submit(number, chunk)
            while going and pending:
                going = await take(await next_built())
        finally:
            futures = [future for future in pending if isinstance(future, asyncio.Future)]
            for future in futures:
                future.cancel()
            await asyncio.gather(*futures, return_exceptions=True)
        await flush()
    duplicates = getattr(producer.transport, "dedupe_hits", 0) - hits_before
    return _summary(started, count, sender.written - duplicates, errors, on_error, duplicates)
