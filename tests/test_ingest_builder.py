"""Ingest with the lines built in a worker process writes what the in-process path writes:
the same records in the same order, the same batches, the same errors and stop rule."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prme.producers.ingest import draft_from_line, ingest_lines
from prme.producers.ingest_build import (
    BUILD_CHUNK,
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
async def test_built_lines_give_the_same_log_and_summary(tmp_path: Path, on_error: str) -> None:
    count = 3 * BUILD_CHUNK + 321
    lines = _lines(count, {1234: "not json", 4100: '{"owner": "", "content": "x"}'})
    plain, plain_log = await _run(tmp_path, "plain", lines, on_error, built=False)
    built, built_log = await _run(tmp_path, "built", lines, on_error, built=True)
    assert built_log == plain_log
    assert (built.lines, built.written, built.skipped) == (
        plain.lines,
        plain.written,
        plain.skipped,
    )
    assert built.errors == plain.errors
    assert [e.line for e in built.errors] == ([1234, 4100] if on_error == "skip" else [1234])
    assert built.stopped_at == plain.stopped_at == (1234 if on_error == "stop" else None)
    if on_error == "stop":  # every line before line 1234 (one of them blank), none after
        assert built.written == 1232


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
    lines built before it knew their owners' keys (the first chunks in flight)."""
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
    # Only the chunks handed over before the first was back and its keys made; the rest
    # was sealed in the worker.
    assert 0 < sealed_here <= WORKER_QUEUE * BUILD_CHUNK


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
        draft_from_line(b'{"owner": "a", "content": "x", "session": ""}', producer)


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
            draft_from_line(line, producer)
        assert str(refused.value) == (
            "Expected an owner id without whitespace at either end - at `$.owner`"
        )
