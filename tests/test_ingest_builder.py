"""Ingest with the lines built in a worker process writes what the in-process path writes:
the same records in the same order, the same batches, the same errors and stop rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prme.producers.ingest import ingest_lines
from prme.producers.ingest_build import BUILD_CHUNK, builder_process
from prme.producers.local_log import LocalLogTransport
from prme.producers.producer import Producer
from prme.schemas.codec import decode_record


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
    if on_error == "stop":  # two full batches went out; the one holding line 1234 did not
        assert built.written == 1000


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
