"""Ingest with the lines built in a worker process writes what the in-process path writes:
the same records in the same order, the same batches, the same errors and stop rule."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prme.producers.ingest import ingest_lines, message_from_line
from prme.producers.ingest_build import (
    BUILD_CHUNK,
    LOCAL_EVERY,
    WORKER_QUEUE,
    build_lines,
    builder_process,
    decode_built,
)
from prme.producers.keys import LocalKeyStore
from prme.producers.local_log import LocalLogTransport
from prme.producers.producer import Producer
from prme.producers.sealing import keys_for
from prme.schemas.codec import decode_record
from prme.schemas.config import LimitsSettings
from prme.schemas.errors import InvalidInput
from prme.schemas.sealing import Sealer, is_sealed, new_data_key


def _lines(count: int, bad: dict[int, str]) -> list[bytes]:
    lines = []
    for number in range(1, count + 1):
        if number in bad:
            lines.append(bad[number].encode() + b"\n")
        elif number % 997 == 0:
            lines.append(b"   \n")  # blank lines are not counted
        else:
            row = {
                "owner": f"u{number % 7}",
                "session": f"s{number % 3}",
                "content": f"line {number}",
            }
            lines.append(json.dumps(row).encode() + b"\n")
    return lines


async def _run(tmp_path: Path, name: str, lines: list[bytes], on_error: str, built: bool):
    transport = LocalLogTransport(tmp_path / name / "log.sqlite3", 4)
    builder = builder_process() if built else None
    await transport.start()
    try:
        summary = await ingest_lines(
            lines,
            Producer(transport),
            on_error=on_error,
            batch_size=500,
            builder=builder,  # type: ignore[arg-type]
        )
        contents = []
        for partition in range(4):
            for entry in await transport.read(partition, 0, 100_000):
                record = decode_record(entry.value)
                contents.append((partition, entry.offset, record.owner, record.content))  # type: ignore[union-attr]
    finally:
        await transport.close()
        if builder is not None:
            builder.shutdown()
    return summary, contents


@pytest.mark.parametrize("on_error", ["skip", "stop"])
@pytest.mark.parametrize(
    "bad",
    [
        {1234: "not json", 4100: '{"owner": "", "content": "x"}'},
        # in the third chunk, which the sending process builds itself (LOCAL_EVERY)
        {3 * BUILD_CHUNK - 7: '{"owner": "u1", "content": "x", "role": "robot"}'},
    ],
)
async def test_built_lines_give_the_same_log_and_summary(
    tmp_path: Path, on_error: str, bad: dict[int, str]
) -> None:
    assert LOCAL_EVERY == 3
    count = 4 * BUILD_CHUNK + 321
    lines = _lines(count, bad)
    plain, plain_log = await _run(tmp_path, "plain", lines, on_error, built=False)
    built, built_log = await _run(tmp_path, "built", lines, on_error, built=True)
    assert built_log == plain_log
    assert (built.lines, built.written, built.skipped) == (
        plain.lines,
        plain.written,
        plain.skipped,
    )
    assert built.errors == plain.errors
    first = min(bad)
    assert [e.line for e in built.errors] == (sorted(bad) if on_error == "skip" else [first])
    assert built.stopped_at == plain.stopped_at == (first if on_error == "stop" else None)
    if on_error == "stop":  # every line before the bad one (blank ones not counted), none after
        assert built.written == first - 1 - (first - 1) // 997


def test_the_worker_seals_the_records_of_the_owners_whose_keys_it_is_given() -> None:
    lines = _lines(40, {})
    key = new_data_key()
    built = decode_built(build_lines(1, lines, LimitsSettings(), {"u3": key}))
    sealer = Sealer()
    for line in built:
        assert line.item is not None
        if line.owner == "u3":
            assert is_sealed(line.item.value)
            record, _ = sealer.open(line.item.value, key.key)
            assert record.content == f"line {line.number}"  # type: ignore[union-attr]
        else:
            assert not is_sealed(line.item.value)
    assert sum(line.owner == "u3" for line in built) == 6


async def test_a_sealed_ingest_built_in_the_worker_writes_only_sealed_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker seals with the keys the parent's store hands it; the parent seals only the
    lines built before it knew their owners' keys (the first chunks in flight) and the
    chunks it builds itself (every ``LOCAL_EVERY``-th)."""
    count = 8 * BUILD_CHUNK
    lines = _lines(count, {})
    transport = LocalLogTransport(tmp_path / "log.sqlite3", 4)
    keys = LocalKeyStore(tmp_path / "keys.sqlite3")
    builder = builder_process()  # forked before the parent's seal is counted below
    sealed_here = 0
    seal = Sealer.seal

    def counting_seal(self: Sealer, plain: bytes, *args: object) -> bytes:
        nonlocal sealed_here
        sealed = seal(self, plain, *args)  # type: ignore[arg-type]
        sealed_here += sealed != plain
        return sealed

    monkeypatch.setattr(Sealer, "seal", counting_seal)
    await transport.start()
    await keys.start()
    try:
        summary = await ingest_lines(lines, Producer(transport, keys=keys), builder=builder)
        values = [
            entry.value
            for partition in range(4)
            for entry in await transport.read(partition, 0, 100_000)
        ]
        opened = await keys_for(keys, values)
    finally:
        await keys.close()
        await transport.close()
        builder.shutdown()
    assert summary.written == len(values) == count - count // 997
    assert all(is_sealed(value) for value in values)
    sealer = Sealer()
    contents = sorted(sealer.open_with(value, opened)[0].content for value in values)  # type: ignore[union-attr]
    assert contents == sorted(f"line {n}" for n in range(1, count + 1) if n % 997)
    # Only the chunks handed over before the first was back and its keys made, and the
    # chunks built here; the rest was sealed in the worker.
    built_here = (count // BUILD_CHUNK) // LOCAL_EVERY
    assert 0 < sealed_here <= (WORKER_QUEUE + built_here) * BUILD_CHUNK < count


def test_the_partitioner_memo_gives_kafkas_partition_for_every_key() -> None:
    from prme.producers.partitioner import Partitioner, partition_for_key

    partitioner = Partitioner(12, max_keys=50)  # small: the memo is cleared many times
    keys = [f"user-{i % 170}".encode() for i in range(2000)] + ["é漢字".encode(), b""]
    assert [partitioner(key) for key in keys] == [partition_for_key(key, 12) for key in keys]


def test_prme_ingest_builds_a_large_file_in_a_worker_and_writes_every_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    count = 2 * BUILD_CHUNK + 500  # over the CLI's threshold for the worker
    source = tmp_path / "in.jsonl"
    source.write_bytes(b"".join(_lines(count, {4321: "not json"})))
    data = tmp_path / "pack"
    result = subprocess.run(
        [sys.executable, "-m", "prme.cli", "ingest", str(source), "--on-error", "skip"]
        + ["--quiet", "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    blank = count // 997
    assert summary["lines"] == count - blank
    assert summary["written"] == count - blank - 1 and summary["skipped"] == 1
    assert f"{source}:4321:" in result.stderr


def test_a_bad_line_names_its_fields_as_the_file_spells_them() -> None:
    producer = Producer(LocalLogTransport(Path(os.devnull), 1))
    with pytest.raises(InvalidInput, match=r"at `\$\.session`"):
        message_from_line(b'{"owner": "a", "content": "x", "session": ""}', producer)


async def test_a_file_ingested_again_counts_its_lines_as_duplicates_either_way(
    tmp_path: Path,
) -> None:
    lines = [
        json.dumps({"owner": f"u{i % 3}", "content": f"line {i}", "request_id": f"r{i}"}).encode()
        for i in range(50)
    ]
    transport = LocalLogTransport(tmp_path / "log.sqlite3", 4)
    await transport.start()
    outcomes = []
    try:
        for built in (False, True, False, True):
            builder = builder_process() if built else None
            try:
                summary = await ingest_lines(lines, Producer(transport), builder=builder)
            finally:
                if builder is not None:
                    builder.shutdown()
            outcomes.append((summary.written, summary.duplicates))
    finally:
        await transport.close()
    assert outcomes == [(50, 0), (0, 50), (0, 50), (0, 50)]


def test_an_owner_with_surrounding_space_is_refused_in_words() -> None:
    """Found by a new-user trial: the error quoted the owner pattern's regex."""
    producer = Producer(LocalLogTransport(Path("/nonexistent/log.sqlite3"), 4))
    for owner in (" alice", "alice "):
        line = json.dumps({"owner": owner, "content": "x"})
        with pytest.raises(InvalidInput) as refused:
            message_from_line(line, producer)
        assert str(refused.value) == (
            "Expected an owner id without whitespace at either end - at `$.owner`"
        )


class _FailingLog(LocalLogTransport):
    """A local log whose appends after the first ``good`` fail, each after a short wait
    (so several are in flight when the first fails)."""

    def __init__(self, path: Path, good: int) -> None:
        super().__init__(path, 4)
        self._good = good

    async def append_many(self, items, *, atomic=True):  # type: ignore[no-untyped-def]
        import asyncio

        from prme.schemas.errors import TransportError

        self._good -= 1
        if self._good < 0:
            await asyncio.sleep(0.01)
            raise TransportError("the broker went away")
        return await super().append_many(items, atomic=atomic)


@pytest.mark.parametrize("built", [False, True])
async def test_a_failed_append_stops_the_ingest_and_leaves_no_failure_unretrieved(
    tmp_path: Path, built: bool
) -> None:
    """Found in this round's review: when one append failed, the other appends in flight
    failed too and asyncio logged each as "Task exception was never retrieved"."""
    import asyncio
    import gc

    from prme.schemas.errors import TransportError

    unretrieved: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
    transport = _FailingLog(tmp_path / "log.sqlite3", good=2)
    builder = builder_process() if built else None
    await transport.start()
    try:
        with pytest.raises(TransportError, match="went away"):
            await ingest_lines(
                _lines(3 * BUILD_CHUNK, {}),
                Producer(transport),
                batch_size=100,
                max_in_flight=8,
                builder=builder,
            )
    finally:
        await transport.close()
        if builder is not None:
            builder.shutdown()
    await asyncio.sleep(0.05)
    gc.collect()
    assert unretrieved == []


def test_the_build_worker_leaves_the_objects_it_inherits_to_the_parent() -> None:
    """The worker's collector skips what it inherited at the fork (so it copies none of the
    parent's pages); the parent's own collector is back to normal at once."""
    import gc

    keep = [{"n": i} for i in range(1000)]  # the parent's objects, tracked by the collector
    pool = builder_process()
    try:
        assert gc.get_freeze_count() == 0
        assert pool.submit(gc.get_freeze_count).result() >= len(keep)
    finally:
        pool.shutdown()


class _SlowLog(LocalLogTransport):
    """A local log whose appends take ``delay_s`` each; counts those still running."""

    def __init__(self, path: Path, delay_s: float) -> None:
        super().__init__(path, 4)
        self._delay_s = delay_s
        self.running = 0
        self.most_running = 0

    async def append_many(self, items, *, atomic=True):  # type: ignore[no-untyped-def]
        import asyncio

        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self._delay_s)
            return await super().append_many(items, atomic=atomic)
        finally:
            self.running -= 1


class _FailingKeys(LocalKeyStore):
    """A key store whose ``fail_at``-th request for keys (and every later one) fails."""

    def __init__(self, path: Path, fail_at: int) -> None:
        super().__init__(path)
        self._left = fail_at

    async def writing_keys(self, owners):  # type: ignore[no-untyped-def]
        self._left -= 1
        if self._left <= 0:
            raise OSError("the key store's disk went away")
        return await super().writing_keys(owners)


@pytest.mark.parametrize("built", [False, True])
@pytest.mark.parametrize("ending", ["cancelled", "keys_failed"])
async def test_an_ingest_that_ends_early_leaves_no_append_running(
    tmp_path: Path, built: bool, ending: str
) -> None:
    """Found in this round's review: a cancelled ingest, or one whose key store failed,
    returned while its appends were still in flight; they went on writing, and their
    failures were logged as never retrieved."""
    import asyncio
    import gc

    unretrieved: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: unretrieved.append(context))
    transport = _SlowLog(tmp_path / "log.sqlite3", delay_s=0.2)
    keys = (
        # in the second chunk (built), at the 40th batch (in-process): appends are in flight
        _FailingKeys(tmp_path / "keys.sqlite3", fail_at=2 if built else 40)
        if ending == "keys_failed"
        else LocalKeyStore(tmp_path / "keys.sqlite3")
    )
    builder = builder_process() if built else None
    await transport.start()
    await keys.start()
    lines = [
        json.dumps({"owner": f"u{i // 50}", "content": f"line {i}"}).encode()
        for i in range(3 * BUILD_CHUNK)
    ]
    try:
        ingest = asyncio.ensure_future(
            ingest_lines(
                lines,
                Producer(transport, keys=keys),
                batch_size=100,
                max_in_flight=8,
                builder=builder,
            )
        )
        if ending == "cancelled":
            while transport.running < 4:
                await asyncio.sleep(0.01)
            ingest.cancel()
            with pytest.raises(asyncio.CancelledError):
                await ingest
        else:
            with pytest.raises(OSError, match="went away"):
                await ingest
        assert transport.running == 0
        written = sum((await transport.end_offsets()).values())
        await asyncio.sleep(0.3)
        assert sum((await transport.end_offsets()).values()) == written
        # What is on the log is the file's first lines, without holes (a rerun of the file
        # with request ids would otherwise put the missing lines after later ones).
        values = [e.value for p in range(4) for e in await transport.read(p, 0, 100_000)]
        opened = await keys_for(keys, values)
        sealer = Sealer()
        numbers = sorted(
            int(sealer.open_with(v, opened)[0].content.split()[1])  # type: ignore[union-attr]
            for v in values
        )
        assert numbers == list(range(len(numbers)))
        assert written > 0 or ending == "keys_failed"
    finally:
        await keys.close()
        await transport.close()
        if builder is not None:
            builder.shutdown()
    gc.collect()
    assert unretrieved == []


async def test_an_ingest_keeps_each_owners_records_in_file_order_when_a_key_is_made(
    tmp_path: Path,
) -> None:
    """Found in this round's review: without a build worker, each append sealed its own
    batch, so a later batch whose owners' keys were held overtook an earlier one waiting
    for a new owner's key, and an owner's records reached the log out of order."""
    transport = LocalLogTransport(tmp_path / "log.sqlite3", 1)
    keys = LocalKeyStore(tmp_path / "keys.sqlite3")
    await transport.start()
    await keys.start()
    try:
        producer = Producer(transport, keys=keys)
        await keys.writing_keys(["alice"])  # alice wrote before
        for round_ in range(5):  # a batch with a new owner, then one without
            rows = [("alice", "first"), (f"new-{round_}", "x"), ("alice", "second")]
            rows.append(("alice", "third"))
            lines = [json.dumps({"owner": o, "content": c}).encode() for o, c in rows]
            await ingest_lines(lines, producer, batch_size=2)
        values = [entry.value for entry in await transport.read(0, 0, 100)]
        opened = await keys_for(keys, values)
    finally:
        await keys.close()
        await transport.close()
    sealer = Sealer()
    records = [sealer.open_with(value, opened)[0] for value in values]
    alice = [r.content for r in records if r.owner == "alice"]  # type: ignore[union-attr]
    assert alice == ["first", "second", "third"] * 5


@pytest.mark.parametrize("built", [False, True])
async def test_a_line_nested_too_deeply_is_a_bad_line(tmp_path: Path, built: bool) -> None:
    """Found in this round's review: a line nesting ~1,000 arrays raised RecursionError,
    which stopped the whole ingest with a traceback, even with ``on_error="skip"``."""
    deep = '{"owner": "a", "content": "x", "metadata": {"m": ' + "[" * 5000 + "]" * 5000 + "}}"
    lines = _lines(2 * BUILD_CHUNK + 10, {7: deep, BUILD_CHUNK * 2 + 3: deep})
    summary, log = await _run(tmp_path, "deep", lines, "skip", built)
    assert [e.line for e in summary.errors] == [7, BUILD_CHUNK * 2 + 3]
    assert all("too deeply" in e.error for e in summary.errors)
    assert summary.written == len(log) == summary.lines - 2


async def test_one_line_batches_keep_at_most_max_in_flight_appends_pending(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: `--batch-size 1` kept 20,000 one-line appends in flight
    (the in-flight bound was 20,000 lines' worth), and each append sent waited on all of
    them: a 40k-line file pegged a core for minutes."""
    from prme.producers.ingest import MAX_IN_FLIGHT

    transport = _SlowLog(tmp_path / "log.sqlite3", delay_s=0.005)
    await transport.start()
    try:
        summary = await ingest_lines(_lines(300, {}), Producer(transport), batch_size=1)
    finally:
        await transport.close()
    assert summary.written == 300
    assert transport.most_running == MAX_IN_FLIGHT


def test_an_owner_named_star_is_refused() -> None:
    """``*`` stands for every owner in API keys: an owner ``*`` was stored, and
    ``DELETE /v1/owners?user_id=*`` then erased that owner alone (adversarial trial)."""
    producer = Producer(LocalLogTransport(Path("/nonexistent/log.sqlite3"), 4))
    with pytest.raises(InvalidInput, match="may not be `\\*`"):
        message_from_line(json.dumps({"owner": "*", "content": "x"}), producer)


def test_the_builder_worker_exits_when_ingest_is_killed() -> None:
    """From an operations trial: after a kill -9 of ``prme ingest`` its builder worker was
    reparented to init and waited for tasks forever (one still there 17 minutes later)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import time\n"
        "from prme.producers.ingest_build import builder_process\n"
        "pool = builder_process()\n"
        "print(*pool._processes, flush=True)\n"  # the worker's pid
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        worker = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and "Z" not in _state(worker):
            assert time.monotonic() < deadline, "the builder worker outlived its parent"
            time.sleep(0.1)
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
