"""Batch ingest of JSON lines (one message per line) with bounded in-flight batches."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, Literal

import msgspec

from prme.schemas.errors import InvalidInput

from .producer import MessageDraft, Producer


class IngestLine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One line of an ingest file."""

    owner: str
    content: str | list[dict[str, Any]]
    session: str = "default"
    role: str = "user"
    scope: str = "default"
    name: str | None = None
    time: datetime | None = None
    metadata: dict[str, Any] = {}
    request_id: str | None = None


class LineError(msgspec.Struct, frozen=True):
    line: int
    error: str


class IngestSummary(msgspec.Struct, frozen=True):
    lines: int
    written: int
    """Records appended (lines whose request_id was already on the log excluded)."""
    skipped: int
    seconds: float
    records_per_s: float
    errors: list[LineError]
    duplicates: int = 0
    """Lines whose (owner, request_id) was already on the log: not written again."""


_line_decoder = msgspec.json.Decoder(IngestLine)


def draft_from_line(line: bytes | str, producer: Producer) -> Any:
    """Parse and validate one JSONL line into a message record (raises InvalidInput)."""
    try:
        parsed = _line_decoder.decode(line)
    except msgspec.DecodeError as error:
        raise InvalidInput(str(error)) from error
    return producer.build_message(
        MessageDraft(
            owner=parsed.owner,
            content=parsed.content,
            role=parsed.role,
            session_id=parsed.session,
            scope=parsed.scope,
            name=parsed.name,
            occurred_at=parsed.time,
            metadata=parsed.metadata,
            request_id=parsed.request_id,
        )
    )


async def ingest_lines(
    lines: Iterable[bytes],
    producer: Producer,
    *,
    on_error: Literal["skip", "stop"] = "stop",
    batch_size: int = 500,
    max_in_flight: int = 4,
    progress: Callable[[int], None] | None = None,
) -> IngestSummary:
    """Validate each line, append in batches with at most ``max_in_flight`` batches pending.

    With ``on_error="stop"`` the first bad line stops the ingest: earlier batches stay
    written, the batch holding the bad line is not appended.
    """
    started = time.perf_counter()
    hits_before = getattr(producer.transport, "dedupe_hits", 0)
    errors: list[LineError] = []
    in_flight: set[asyncio.Task[Any]] = set()
    written = count = 0
    batch: list[Any] = []

    async def flush() -> None:
        nonlocal written, batch
        if not batch:
            return
        records, batch = batch, []
        while len(in_flight) >= max_in_flight:
            done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                in_flight.discard(task)
                task.result()
        # Lines are independent records: no transaction per batch (on Kafka that would
        # serialise the batches in flight).
        task = asyncio.ensure_future(producer.append_records(records, atomic=False))
        in_flight.add(task)
        written += len(records)
        if progress is not None:
            task.add_done_callback(functools.partial(_report, progress, len(records)))

    stopped = False
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        count += 1
        try:
            batch.append(draft_from_line(raw, producer))
        except InvalidInput as error:
            errors.append(LineError(number, str(error)))
            if on_error == "stop":
                stopped = True
                break
            continue
        if len(batch) >= batch_size:
            await flush()
    if stopped:
        batch = []
    await flush()
    if in_flight:
        for task in await asyncio.gather(*in_flight, return_exceptions=True):
            if isinstance(task, BaseException):
                raise task
    seconds = time.perf_counter() - started
    duplicates = getattr(producer.transport, "dedupe_hits", 0) - hits_before
    written -= duplicates
    return IngestSummary(
        lines=count,
        written=written,
        skipped=len(errors),
        seconds=seconds,
        records_per_s=written / seconds if seconds > 0 else 0.0,
        errors=errors,
        duplicates=duplicates,
    )


def _report(progress: Callable[[int], None], count: int, _task: asyncio.Task[Any]) -> None:
    progress(count)
