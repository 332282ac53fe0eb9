"""`prme ingest` and `prme audit` as a user runs them, on both transports."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

LINES = [
    {"owner": "alice", "session": "s1", "role": "user", "content": "first"},
    {"owner": "bob", "session": "s1", "role": "user", "content": "bob's"},
    {
        "owner": "alice",
        "session": "s1",
        "role": "assistant",
        "content": "second",
        "time": "2023-05-08T13:56:00Z",
        "metadata": {"source": "import"},
    },
    {"owner": "alice", "session": "s2", "role": "user", "content": "third"},
]


def prme(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prme.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def audit(owner: str, options: list[str], env: dict[str, str] | None = None) -> list[dict]:
    result = prme("audit", "--owner", owner, *options, env=env)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def check_ingest_and_audit(
    tmp_path: Path, options: list[str], env: dict[str, str] | None = None
) -> None:
    source = write_jsonl(
        tmp_path / "in.jsonl", [*LINES, '{"owner": "", "content": "x"}', "not json"]
    )
    result = prme("ingest", str(source), "--on-error", "skip", "--quiet", *options, env=env)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["written"] == 4 and summary["skipped"] == 2 and summary["records_per_s"] > 0
    assert f"{source}:5:" in result.stderr and "$.owner" in result.stderr
    assert f"{source}:6:" in result.stderr

    rows = audit("alice", options, env)
    assert [r["record"]["content"] for r in rows] == ["first", "second", "third"]
    offsets = [r["offset"] for r in rows]
    assert offsets == sorted(offsets) and len({r["partition"] for r in rows}) == 1
    second = rows[1]["record"]
    assert second["kind"] == "message" and second["role"] == "assistant"
    assert second["occurred_at"] == "2023-05-08T13:56:00Z"
    assert second["metadata"] == {"source": "import"}
    assert [r["record"]["content"] for r in audit("bob", options, env)] == ["bob's"]


def test_ingest_and_audit_on_the_local_log(tmp_path: Path) -> None:
    check_ingest_and_audit(tmp_path, ["--data-dir", str(tmp_path / "pack")])


@pytest.mark.kafka
def test_ingest_and_audit_on_kafka(tmp_path: Path, kafka_bootstrap: str, kafka_topic: str) -> None:
    # On Kafka the log and the keys are topics: a data directory that holds other files is
    # nothing ingest writes to (a review: it was refused as "not empty").
    elsewhere = tmp_path / "memory"
    elsewhere.mkdir()
    (elsewhere / "todo.md").write_text("mine")
    options = ["--transport", "kafka", "--bootstrap", kafka_bootstrap]
    options += ["--data-dir", str(elsewhere)]
    check_ingest_and_audit(tmp_path, options, env={"PRME_LOG__TOPIC": kafka_topic})


def test_ingest_stops_at_the_first_bad_line_by_default(tmp_path: Path) -> None:
    source = write_jsonl(
        tmp_path / "in.jsonl",
        [LINES[0], {"owner": "alice", "role": "robot", "content": "x"}, LINES[3]],
    )
    data = ["--data-dir", str(tmp_path / "pack")]
    result = prme("ingest", str(source), "--quiet", *data)
    assert result.returncode == 1
    assert f"{source}:2:" in result.stderr and "role" in result.stderr
    assert "stopped at line 2" in result.stderr
    # From an operations trial: a rerun of the fixed file wrote the first lines again.
    assert f"rerun from the line, tail -n +2 {source}" in result.stderr
    summary = json.loads(result.stdout)
    assert (summary["written"], summary["skipped"], summary["stopped_at"]) == (1, 0, 2)
    # The line before the bad one is written, the one after it is not.
    assert [row["record"]["content"] for row in audit("alice", data)] == ["first"]


def test_help_is_plain_text_and_ingest_help_gives_the_line_format() -> None:
    top = prme("--help")
    assert top.returncode == 0 and "``" not in top.stdout and ":class:" not in top.stdout
    assert "ingest" in top.stdout and "serve" in top.stdout
    ingest = prme("ingest", "--help")
    assert ingest.returncode == 0
    for field in ("owner", "content", "session", "role", "time", "metadata", "request_id"):
        assert f"\n  {field} " in ingest.stdout, field
    assert '{"owner": "alice"' in ingest.stdout


def test_version_names_the_distribution() -> None:
    from prme import __version__

    result = prme("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"prme {__version__} (prme-memory)"


def test_ingesting_the_demo_sample_twice_writes_it_once(tmp_path: Path, demo_sample: Path) -> None:
    """`make demo` run twice: the sample's request ids make the second ingest a no-op."""
    source, sample = demo_sample, demo_sample.read_text()
    data = ["--data-dir", str(tmp_path / "pack")]
    summaries = []
    for _ in range(2):
        result = prme("ingest", str(source), "--quiet", *data)
        assert result.returncode == 0, result.stderr
        summaries.append(json.loads(result.stdout.strip().splitlines()[-1]))
    lines = len(sample.splitlines())
    assert (summaries[0]["written"], summaries[0]["duplicates"]) == (lines, 0)
    assert (summaries[1]["written"], summaries[1]["duplicates"]) == (0, lines)
    alice = [r["record"]["content"] for r in audit("alice", data)]
    assert (
        len(alice) == len(set(alice)) == sum('"owner": "alice"' in x for x in sample.splitlines())
    )


async def test_audit_shows_an_erased_owners_records_as_envelopes(tmp_path: Path) -> None:
    from prme import MemoryEngine
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    data = ["--data-dir", str(tmp_path / "pack")]
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    assert prme("ingest", str(source), "--quiet", *data).returncode == 0
    raw = b"".join(p.read_bytes() for p in (tmp_path / "pack").glob("log.sqlite3*"))
    assert b"second" not in raw and b"bob's" not in raw  # sealed on the log
    engine = await MemoryEngine.open(
        tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider(), create_if_missing=True
    )
    try:
        await engine.erase_owner("alice")
    finally:
        await engine.close()
    rows = audit("alice", data)
    assert [r["record"]["kind"] for r in rows] == ["message"] * 3 + ["owner_erased"]
    for row in rows[:3]:
        record = row["record"]
        assert record["erased"] is True and record["owner"] == "alice"
        assert "content" not in record and "metadata" not in record
        assert {"event_id", "session_id", "scope", "recorded_at"} <= set(record)
    assert [r["record"]["content"] for r in audit("bob", data)] == ["bob's"]


@pytest.mark.parametrize(
    ("variable", "value", "where"),
    [
        ("PRME_EMBEDDING__QUERY_THREADS", "0", "$.embedding.query_threads"),
        ("PRME_EMBEDDING__QUERY_PRECISION", "fp16", "$.embedding.query_precision"),
        ("PRME_EMBEDDING__BATCH_SIZE", "-3", "$.embedding.batch_size"),
        ("PRME_SCORING__FUSION", "bogus", "$.scoring.fusion"),
        # A non-ASCII secret used to fail every forwarded request inside httpx (a 500).
        ("PRME_CLUSTER__SECRET", "héllo", "$.cluster"),
        ("PRME_CLUSTER__SECRET", " padded ", "$.cluster"),
    ],
)
def test_bad_settings_are_one_line_and_write_nothing(
    tmp_path: Path, variable: str, value: str, where: str
) -> None:
    data = tmp_path / "data"
    result = prme("serve", "--data-dir", str(data), "--port", "0", env={variable: value})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("prme serve: invalid settings: ") and f"`{where}`" in line
    assert not data.exists()


def test_ingest_into_a_directory_without_a_log_says_it_creates_one(tmp_path: Path) -> None:
    """A typo in --data-dir started a new pack without a word (audit and erase say "no
    PRME log in ..."); ingest still creates the pack, and now says so."""
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    pack = tmp_path / "pack"
    first = prme("ingest", str(source), "--data-dir", str(pack))
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"prme ingest: no PRME log in {pack}: creating one\n")
    again = prme("ingest", str(source), "--data-dir", str(pack))
    assert again.returncode == 0 and "creating one" not in again.stderr


def test_ingest_of_a_missing_file_or_a_directory_is_one_line(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "pack")]
    for path, reason in ((tmp_path / "nothing.jsonl", "No such file"), (tmp_path, "directory")):
        result = prme("ingest", str(path), "--quiet", *data)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"prme ingest: cannot read {path}: ")
        assert reason in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "pack").exists()


def test_a_data_dir_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    """Found by a new-user trial: a FileExistsError traceback from deep in the log."""
    afile = tmp_path / "notes.txt"
    afile.write_text("mine")
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    for command in (["ingest", str(source), "--quiet"], ["serve", "--port", "0"]):
        result = prme(*command, "--data-dir", str(afile))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip() == f"prme {command[0]}: the data directory {afile} is a file"
    assert afile.read_text() == "mine"


DATA_DIR_COMMANDS = [
    ["audit", "--owner", "jo"],
    ["ingest", "IN", "--quiet"],
    ["rebuild", "--quiet"],
    ["serve", "--port", "0"],
    ["project"],
    ["mcp"],
]
"""Every command that opens a data directory (``IN``: the JSONL file to ingest)."""


def check_refused_data_dir(
    data_dir: Path,
    source: Path,
    expected: str,
    prefix: Sequence[str] = (),
    commands: Sequence[list[str]] = DATA_DIR_COMMANDS,
) -> None:
    """Each command refuses ``data_dir`` in one line that names it and ``expected``, with
    exit status 2 (``prefix``: what runs the command, e.g. under a read-only mount)."""
    for command in commands:
        args = [str(source) if a == "IN" else a for a in command]
        result = subprocess.run(
            [*prefix, sys.executable, "-m", "prme.cli", *args, "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2, (command, result.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"prme {command[0]}: "), result.stderr
        assert str(data_dir) in lines[0] and expected in lines[0], (command, lines[0])


def read_only(directory: Path) -> list[str]:
    """What to run a command under for ``directory`` to be read-only to it: nothing once it
    is ``chmod 0555`` (a user's); for root, whom modes do not stop, a read-only bind mount
    in a mount namespace of its own (``unshare -m``), or a skip where none can be made."""
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return []
    mount = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    prefix = ["unshare", "-m", "sh", "-c", mount, str(directory)]
    try:
        probe = subprocess.run([*prefix, "touch", str(directory / "probe")], capture_output=True)
    except FileNotFoundError:
        pytest.skip("running as root (chmod does not stop root) and unshare is missing")
    if probe.returncode == 0 or b"Read-only" not in probe.stderr:
        pytest.skip(f"running as root and no read-only mount can be made: {probe.stderr!r}")
    return prefix


def test_a_read_only_data_dir_is_one_line_naming_it(tmp_path: Path) -> None:
    """Found by a new-user trial: on a read-only data directory every command died with a
    traceback (``sqlite3.OperationalError: unable to open database file``, ``OSError:
    [Errno 30] Read-only file system: '.../prme.lock'``)."""
    pack = tmp_path / "pack"
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    assert prme("ingest", str(source), "--quiet", "--data-dir", str(pack)).returncode == 0
    before = sorted(p.name for p in pack.iterdir())
    try:
        check_refused_data_dir(pack, source, "not writable", read_only(pack))
    finally:
        pack.chmod(0o755)
    assert sorted(p.name for p in pack.iterdir()) == before


def test_a_data_dir_below_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    """Found by a new-user trial: ``prme serve --data-dir afile/sub`` died with a
    ``NotADirectoryError`` traceback."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    check_refused_data_dir(afile / "sub", source, f"{afile} is a file")
    assert afile.read_text() == "mine"


def test_a_non_empty_directory_without_a_pack_is_refused_by_every_command(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: ``serve`` and ``MemoryClient`` refused a directory of
    someone else's files, but ``ingest`` and ``project`` wrote a pack among them."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    creators = [c for c in DATA_DIR_COMMANDS if c[0] not in ("audit", "rebuild")]
    # (a review: the lock file `--workers` takes first made the directory look a pack)
    creators.append(
        ["project", "--workers", "2", "--transport", "kafka", "--bootstrap", "127.0.0.1:1"]
    )
    # (audit and rebuild create nothing: they say "no PRME log in" the directory)
    check_refused_data_dir(
        theirs, source, "is not empty (notes.txt) and holds no PRME pack", commands=creators
    )
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_ingest_reads_past_a_byte_order_mark_and_names_a_lone_surrogate(tmp_path: Path) -> None:
    """Found by a new-user trial: a file saved with a UTF-8 BOM failed at line 1 as
    "malformed JSON", and a lone surrogate escape was reported as "Input data was
    truncated"."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(
        b"\xef\xbb\xbf" + json.dumps(LINES[0]).encode() + b"\n"
        b'{"owner": "alice", "content": "half \\ud83d a pair"}\n'
        + json.dumps(LINES[3]).encode()
        + b"\n"
    )
    data = ["--data-dir", str(tmp_path / "pack")]
    result = prme("ingest", str(source), "--on-error", "skip", "--quiet", *data)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == (
        f"{source}:2: invalid unicode escape \\ud83d at byte 36: a lone surrogate is not a "
        "character (escape a surrogate pair, or send the text as UTF-8)"
    )
    assert [r["record"]["content"] for r in audit("alice", data)] == ["first", "third"]


def test_audit_of_a_directory_without_a_log_says_so_and_creates_nothing(tmp_path: Path) -> None:
    typo = tmp_path / "typo"
    result = prme("audit", "--owner", "alice", "--data-dir", str(typo))
    assert result.returncode == 2
    assert result.stderr.strip() == f"prme audit: no PRME log in {typo}"
    assert not typo.exists()


def test_ingest_batch_size_over_the_write_limit_is_one_append_and_zero_is_refused(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: `--batch-size 2000` failed mid-ingest with a traceback
    (appends were held to the HTTP write limit, `limits.max_batch_records`), and
    `--batch-size 0` was taken."""
    from prme.producers.ingest import INGEST_BATCH, MAX_INGEST_BATCH

    rows = [{"owner": f"u{i % 5}", "content": f"line {i}"} for i in range(2500)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    data = ["--data-dir", str(tmp_path / "pack")]
    result = prme("ingest", str(source), "--quiet", "--batch-size", "2000", *data)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["written"] == 2500
    assert len(audit("u0", data)) == 500
    for size in ("0", "-3", str(MAX_INGEST_BATCH + 1), "many"):
        refused = prme(
            "ingest",
            str(source),
            "--quiet",
            "--batch-size",
            size,
            "--data-dir",
            str(tmp_path / "refused"),
        )
        assert refused.returncode == 2 and "--batch-size" in refused.stderr, size
        assert f"1 to {MAX_INGEST_BATCH} lines" in refused.stderr or size == "many"
        assert not (tmp_path / "refused").exists()
    helped = prme("ingest", "--help").stdout
    assert f"default {INGEST_BATCH}" in helped and f"1 to {MAX_INGEST_BATCH}" in helped


def test_an_interrupted_ingest_says_so_and_leaves_the_files_first_lines(tmp_path: Path) -> None:
    """Found by a new-user trial: Ctrl-C printed a KeyboardInterrupt traceback, and could
    leave holes (the appends in flight were cancelled, later ones not), which a rerun with
    request ids then filled after later lines."""
    import signal
    import sqlite3
    import time

    rows = [{"owner": f"u{i % 20}", "content": f"line {i}"} for i in range(200_000)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    data = tmp_path / "pack"
    # Ctrl-C as a terminal delivers it, whatever this suite inherited: a suite started in
    # the background of a non-interactive shell ignores SIGINT, and so did the ingest,
    # which then ran to the end and exited 0.
    with_ctrl_c = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv[0] = 'prme'; runpy.run_module('prme.cli', run_name='__main__')"
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            with_ctrl_c,
            "ingest",
            str(source),
            "--quiet",
            "--data-dir",
            str(data),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    written = 0
    while written == 0 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
        with contextlib.suppress(sqlite3.Error):
            db = sqlite3.connect(f"file:{data / 'log.sqlite3'}?mode=ro", uri=True)
            try:
                written = db.execute("SELECT count(*) FROM log").fetchone()[0]
            finally:
                db.close()
    assert process.poll() is None, "the ingest ended before it could be interrupted"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    said = stderr.strip().splitlines()
    assert said[-1] == "prme ingest: interrupted"
    assert "Traceback" not in stderr
    numbers = sorted(
        int(row["record"]["content"].split()[1])
        for owner in range(20)
        for row in audit(f"u{owner}", ["--data-dir", str(data)])
    )
    assert 0 < len(numbers) < len(rows)
    assert numbers == list(range(len(numbers)))
    assert said[-2].startswith(f"{source}: {len(numbers)} records written, in the file's order")


def _log_contents(data: Path, owners: list[str]) -> list[str]:
    """The contents on the log of ``owners``' records, in each owner's order (``audit``)."""
    contents: list[str] = []
    for owner in owners:
        audit = prme("audit", "--owner", owner, "--data-dir", str(data))
        assert audit.returncode == 0, audit.stderr
        contents += [json.loads(row)["record"]["content"] for row in audit.stdout.splitlines()]
    return contents


def test_an_ingest_line_reusing_a_request_id_for_other_content_is_a_bad_line(
    tmp_path: Path,
) -> None:
    """Found in review: such a line failed its whole append (5,000 lines) while later ones
    landed, leaving a hole, and the ingest printed a traceback."""
    data = tmp_path / "pack"
    first = write_jsonl(
        tmp_path / "a.jsonl", [{"owner": "alice", "content": "a", "request_id": "r1"}]
    )
    assert prme("ingest", str(first), "--quiet", "--data-dir", str(data)).returncode == 0
    rows = [
        {"owner": "alice", "content": "fresh", "request_id": "r2"},
        {"owner": "alice", "content": "not a", "request_id": "r1"},
        {"owner": "alice", "content": "later", "request_id": "r3"},
        {"owner": "alice", "content": "later, changed", "request_id": "r3"},
    ]
    source = write_jsonl(tmp_path / "b.jsonl", rows)
    stopped = prme("ingest", str(source), "--quiet", "--data-dir", str(data))
    assert stopped.returncode == 1 and "Traceback" not in stopped.stderr
    said = stopped.stderr.strip().splitlines()
    assert said[0] == (
        f"{source}:2: request_id 'r1' of owner 'alice' was already used for a different "
        "write: a line must repeat the write its request_id was first used for"
    )
    assert said[1].startswith(f"{source}: stopped at line 2")
    assert _log_contents(data, ["alice"]) == ["a", "fresh"]
    skipped = prme("ingest", str(source), "--quiet", "--data-dir", str(data), "--on-error", "skip")
    assert skipped.returncode == 0
    assert [line.split(": ")[0] for line in skipped.stderr.strip().splitlines()] == [
        f"{source}:2",
        f"{source}:4",  # repeats a line of the same run with other content
    ]
    assert _log_contents(data, ["alice"]) == ["a", "fresh", "later"]


def test_a_large_ingest_stops_at_a_reused_request_id_with_the_lines_before_it_written(
    tmp_path: Path,
) -> None:
    data = tmp_path / "pack"
    rows = [
        {"owner": f"u{i % 7}", "content": f"line {i}", "request_id": f"r{i}"} for i in range(12_000)
    ]
    rows[11_000] = {"owner": "u0", "content": "line 0 changed", "request_id": "r0"}
    source = write_jsonl(tmp_path / "big.jsonl", rows)
    result = prme("ingest", str(source), "--quiet", "--data-dir", str(data), "--batch-size", "500")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"{source}:11001: request_id 'r0' of owner 'u0'")
    assert sorted(_log_contents(data, [f"u{i}" for i in range(7)])) == sorted(
        f"line {i}" for i in range(11_000)
    )


@contextlib.contextmanager
def serving(data: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``prme serve`` on ``data`` at a free loopback port, up (killed if still running)."""
    import socket
    import time
    import urllib.request

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "prme.cli", "serve", "--data-dir", str(data)]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--log-level", "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(url + "/v1/health", timeout=5),
            ):
                break
            assert process.poll() is None and time.monotonic() < deadline, "never came up"
            time.sleep(0.2)  # poll interval while the server starts
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_stopped_server_closes_its_engine_before_it_exits(tmp_path: Path, stop: str) -> None:
    """Found by a new-user trial: uvicorn re-raised the signal it caught, so SIGTERM killed
    the process before the engine was closed (exit -15) and SIGINT cancelled the close; a
    Kafka node stopped on purpose left its group only by the session timeout."""
    import signal

    with serving(tmp_path / "d") as (process, _):
        process.send_signal(getattr(signal, stop))
        _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "stopped: the engine is closed" in stderr
    assert "Traceback" not in stderr


def test_a_body_nested_too_deeply_is_a_400_in_the_metrics_too(tmp_path: Path) -> None:
    """Found by a new-user trial: the forwarding middleware's look at the body raised the
    decoder's RecursionError past the request observer, so the client's 400 was logged and
    counted as a 500 (anyone could set off 5xx alerts)."""
    import httpx

    deep = "[" * 2000 + "]" * 2000
    with serving(tmp_path / "d") as (_, url):
        for path, body in (
            ("/v1/memories", f'{{"user_id":"a","content":"x","metadata":{{"k":{deep}}}}}'),
            ("/v1/retrieve", f'{{"user_id":"a","query":{deep}}}'),
        ):
            answer = httpx.post(
                url + path, content=body, headers={"content-type": "application/json"}
            )
            assert answer.status_code == 400, answer.text
        counts = [
            line
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("prme_http_request_duration_seconds_count")
        ]
    client_errors = [line.split('route="')[1].split('"')[0] for line in counts if "4xx" in line]
    assert sorted(client_errors) == ["/v1/memories", "/v1/retrieve"], counts
    assert not any('status="5xx"' in line for line in counts), counts


def test_careless_ports_and_a_mistyped_pack_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: ``--port 99999`` ended in an OverflowError traceback after
    the data directory was created, and ``prme rebuild`` of a mistyped directory created an
    empty pack and exited 0."""
    for command in (
        ["serve", "--port", "99999"],
        ["serve", "--port", "-5"],
        ["project", "--metrics-port", "70000"],
        ["mcp", "--http", "--port", "port"],
    ):
        refused = prme(*command, "--data-dir", str(tmp_path / "never"))
        assert refused.returncode == 2, (command, refused.stderr)
        assert "port" in refused.stderr and "Traceback" not in refused.stderr
    # The settings check the port, so the environment's is refused the same way.
    from_env = prme(
        "serve", "--data-dir", str(tmp_path / "never"), env={"PRME_SERVICE__PORT": "99999"}
    )
    assert from_env.returncode == 2 and "port" in from_env.stderr, from_env.stderr
    rebuilt = prme("rebuild", "--quiet", "--data-dir", str(tmp_path / "never"))
    assert rebuilt.returncode == 2, rebuilt.stderr
    assert f"no PRME log in {tmp_path / 'never'}" in rebuilt.stderr
    assert not (tmp_path / "never").exists()


def test_careless_counts_and_settings_are_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: ``--processes 0`` served with no process projecting, and
    negative candidates, standbys or timeouts from the environment started a service."""
    for command in (
        ["serve", "--processes", "0"],
        ["serve", "--processes", "-2"],
        ["rebuild", "--processes", "0"],
        ["project", "--workers", "0"],
        ["serve", "--standby-replicas", "-1"],
    ):
        refused = prme(*command, "--data-dir", str(tmp_path / "never"))
        assert refused.returncode == 2, (command, refused.stderr)
        assert "Traceback" not in refused.stderr
    for name, value in (
        ("PRME_SCORING__CANDIDATES", "0"),
        ("PRME_SCORING__WEIGHTS", '{"vector": -1}'),
        ("PRME_CLUSTER__SESSION_TIMEOUT_S", "inf"),
        ("PRME_QUERY__CONSISTENCY_TIMEOUT_S", "-1"),
        ("PRME_LIMITS__MAX_BATCH_RECORDS", "0"),
        ("PRME_LEXICAL__WINDOW_BEFORE", "-1"),
    ):
        refused = prme("serve", "--data-dir", str(tmp_path / "never"), env={name: value})
        assert refused.returncode == 2, (name, refused.stderr)
        assert "invalid settings" in refused.stderr, refused.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ('{"": "*"}', "an empty key"),
        ('{" sk-pad ": "alice"}', "whitespace"),
        ('{"sk-tab\\tkey": "alice"}', "control characters"),
        ('{"sk-x": ""}', "owner"),
        ('{"sk-x": " alice "}', "owner"),
    ],
)
def test_api_keys_that_can_never_authenticate_are_refused_without_echoing_them(
    tmp_path: Path, keys: str, problem: str
) -> None:
    """Found by a new-user trial: an empty key, a padded one (headers are trimmed, so
    ``Bearer  sk-pad `` was 401) and an empty owner started a service without a word."""
    try:
        refused = subprocess.run(
            [sys.executable, "-m", "prme.cli", "serve", "--port", "0"]
            + ["--data-dir", str(tmp_path / "never")],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PRME_SERVICE__API_KEYS": keys},
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"prme serve started with PRME_SERVICE__API_KEYS={keys}")
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prme serve: invalid settings"), lines
    assert problem in lines[0] and "service.api_keys" in lines[0], lines[0]
    for key in json.loads(keys):
        assert not key.strip() or key.strip() not in lines[0]  # the key is never echoed
    assert not (tmp_path / "never").exists()


def test_audit_refuses_a_bad_owner_and_status_a_timeout_that_is_not_positive(
    tmp_path: Path,
) -> None:
    """Found by a new-user trial: ``prme audit --owner ""`` exited 0 with no output, and
    ``prme status --timeout 0`` reported "no PRME service answers" (Errno 115)."""
    pack = tmp_path / "pack"
    source = write_jsonl(tmp_path / "in.jsonl", LINES)
    assert prme("ingest", str(source), "--quiet", "--data-dir", str(pack)).returncode == 0
    for owner in ("", " alice ", "a\tb"):
        refused = prme("audit", "--owner", owner, "--data-dir", str(pack))
        assert refused.returncode == 2 and refused.stdout == "", refused.stderr
        assert "argument --owner" in refused.stderr and "owner id" in refused.stderr
    for timeout in ("0", "-1", "nan", "inf", "soon"):
        refused = prme("status", "--timeout", timeout, "--url", "http://127.0.0.1:9")
        assert refused.returncode == 2, (timeout, refused.stderr)
        assert "argument --timeout" in refused.stderr and "answers" not in refused.stderr


class _KeyedStatus(http.server.BaseHTTPRequestHandler):
    """``GET /v1/status`` behind a key, as a proxy in front of a service may put it."""

    def do_GET(self) -> None:
        if self.headers.get("Authorization") != "Bearer sk-status":
            self.send_response(401)
            self.end_headers()
            return
        body = json.dumps({"refused": [], "duplicates": []}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_status_takes_its_api_key_from_the_environment() -> None:
    """Found by a new-user trial: the key could only be given as ``--api-key KEY``, on the
    command line that ``ps`` shows every user."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeyedStatus)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        keyed = prme("status", "--json", "--url", url, env={"PRME_API_KEY": "sk-status"})
        assert keyed.returncode == 0, keyed.stderr
        assert json.loads(keyed.stdout) == {"refused": [], "duplicates": []}
        flagged = prme("status", "--json", "--url", url, "--api-key", "sk-status")
        assert flagged.returncode == 0, flagged.stderr
        unkeyed = prme("status", "--json", "--url", url, env={"PRME_API_KEY": "sk-wrong"})
        assert unkeyed.returncode == 1 and "answered 401" in unkeyed.stderr
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_a_taken_port_is_refused_before_the_pack_is_opened(tmp_path: Path) -> None:
    """Found by a cluster trial: a node whose port was taken opened its pack and joined its
    group (taking partitions from the others) before uvicorn failed to bind."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for processes in ("1", "2"):
            refused = prme(
                "serve",
                "--port",
                str(port),
                "--processes",
                processes,
                "--data-dir",
                str(tmp_path / "node"),
            )
            assert refused.returncode == 2, refused.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in refused.stderr
            assert not (tmp_path / "node").exists()


@pytest.mark.kafka
async def test_rebuild_of_a_stopped_kafka_node_leaves_the_live_group_alone(
    tmp_path: Path, kafka_settings: object
) -> None:
    """Found by a cluster trial: ``prme rebuild`` of a stopped node's directory joined the
    live group, took partitions from the running nodes and rebuilt whatever it was given."""
    from prme import MemoryEngine
    from prme.schemas.config import Settings

    assert isinstance(kafka_settings, Settings)
    stopped = kafka_settings.replace(data_dir=str(tmp_path / "stopped"))
    async with await MemoryEngine.create(settings=stopped) as engine:
        for i in range(6):
            await engine.store(f"note {i} about the garden", f"owner{i}")
    live = await MemoryEngine.create(
        settings=kafka_settings.replace(data_dir=str(tmp_path / "live"))
    )
    try:
        assert live.runner.cluster_map is not None
        generation = live.runner.cluster_map.generation
        log = kafka_settings.log
        env = {"PRME_LOG__TOPIC": log.topic, "PRME_LOG__DLQ_TOPIC": log.dlq_topic}
        kafka = ["--transport", "kafka", "--bootstrap", log.bootstrap]
        rebuilt = await asyncio.to_thread(
            prme, "rebuild", "--quiet", "--data-dir", stopped.data_dir, *kafka, env=env
        )
        assert rebuilt.returncode == 0, rebuilt.stderr
        report = json.loads(rebuilt.stdout.strip().splitlines()[-1])
        assert set(report["replayed"]) <= {"0", "1", "2", "3"}
        assert sum(report["replayed"].values()) == 6
        assert report["vectors"]["encoded"] == 0
        assert live.runner.cluster_map.generation == generation
        assert set(live.runner.shards) == {0, 1, 2, 3}
        nothing = str(tmp_path / "nothing")
        refused = await asyncio.to_thread(
            prme, "rebuild", "--quiet", "--data-dir", nothing, *kafka, env=env
        )
        assert refused.returncode == 2
        assert "holds no partition's read models" in refused.stderr
        assert not Path(nothing).exists()
    finally:
        await live.close()


def test_rebuild_quiet_prints_no_server_log_lines_and_status_names_no_group_when_embedded(
    tmp_path: Path,
) -> None:
    """``prme rebuild --quiet`` printed ~30 INFO lines of the runner (a new-user trial), and
    the status of an embedded node named a consumer group it does not have."""
    data = ["--data-dir", str(tmp_path / "pack")]
    assert prme("ingest", str(write_jsonl(tmp_path / "in.jsonl", LINES)), "--quiet", *data)
    rebuilt = prme("rebuild", "--quiet", *data)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert " INFO " not in rebuilt.stderr, rebuilt.stderr
    assert json.loads(rebuilt.stdout)["replayed"]
    from prme.cli import render_status

    status = {
        "transport": "local",
        "group": "prme-projectors",
        "lag_records": 0,
        "dead_letters": 0,
        "partitions": [],
        "embedding": {
            "model_name": "m",
            "model_version": "1",
            "dimension": 3,
            "mismatched_partitions": [],
        },
    }
    assert "group" not in render_status(status)
    assert "group prme-projectors" in render_status({**status, "transport": "kafka"})


def test_erase_takes_an_owner_out_of_a_stopped_pack_and_through_a_running_service(
    tmp_path: Path,
) -> None:
    """``prme erase``: the trial found no command for an operator's erasure request."""
    from .mcp_harness import clean_env, prme_serve

    pack = tmp_path / "pack"
    data = ["--data-dir", str(pack)]
    assert prme("ingest", str(write_jsonl(tmp_path / "in.jsonl", LINES)), "--quiet", *data)
    erased = prme("erase", "--owner", "alice", *data)
    assert erased.returncode == 0, erased.stderr
    assert json.loads(erased.stdout)["event_id"]
    rows = [json.loads(line) for line in prme("audit", "--owner", "alice", *data).stdout.split()]
    assert rows[-1]["record"]["kind"] == "owner_erased"
    assert all(row["record"].get("erased") for row in rows[:-1])
    bob = prme("audit", "--owner", "bob", *data).stdout
    assert "bob's" in bob and '"erased"' not in bob
    for careless, why in (
        (["--owner", "*", *data], "erase owners one at a time"),
        (["--owner", " x", *data], "whitespace"),
        (["--owner", "x", "--data-dir", str(tmp_path / "never")], "no PRME log"),
        (["--owner", "x", "--url", "localhost:8765"], "url"),
    ):
        refused = prme("erase", *careless)
        assert refused.returncode == 2, (careless, refused.stderr)
        assert why in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    env = clean_env(PRME_SERVICE__API_KEYS=json.dumps({"sk-bob": "bob", "sk-admin": "*"}))
    with prme_serve(pack, env) as url:
        wrong = prme("erase", "--owner", "bob", "--url", url, env={"PRME_API_KEY": "sk-nope"})
        assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr
        through = prme("erase", "--owner", "bob", "--url", url, env={"PRME_API_KEY": "sk-bob"})
        assert through.returncode == 0, through.stderr
        history = httpx.get(
            f"{url}/v1/history",
            params={"user_id": "bob", "session_id": "s1"},
            headers={"Authorization": "Bearer sk-admin"},
        )
        assert history.status_code == 200 and history.json() == []


def test_an_unknown_model_in_the_settings_is_a_configuration_error_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """From an operations trial: PRME_EMBEDDING__MODEL naming a model fastembed does not
    know printed a traceback ending in a Python-only hint (``FastEmbedProvider(...,
    dimension=N)``) and exited 1."""
    from prme.cli import main

    monkeypatch.setenv("PRME_EMBEDDING__MODEL", "sentence-transformers/all-MiniLM-L6-v3")
    code = main(["serve", "--data-dir", str(tmp_path / "pack"), "--port", "1"])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("prme serve: embedding.model 'sentence-transformers/all-MiniLM-L6-v3'")
    assert "PRME_EMBEDDING__DIMENSION" in error and "Traceback" not in error
    assert "add_custom_model" in error  # (a dimension alone does not make a model loadable)


@pytest.mark.model
async def test_a_prme_error_of_any_kind_is_one_line_not_a_traceback(
    tmp_path: Path, default_model_dir: Path
) -> None:
    """From an operations trial: with ``prme.lock`` deleted under a running process,
    ``prme rebuild`` got past the lock and stopped on the vector shard's own lock with a
    60-line traceback (a ``ShardUnavailable``, neither a configuration nor a transport
    error)."""
    from prme import MemoryEngine
    from prme.schemas.config import Settings

    pack = tmp_path / "pack"
    async with await MemoryEngine.create(settings=Settings(data_dir=str(pack))) as engine:
        await engine.store("held by this process", "alice")
        (pack / "prme.lock").unlink()
        result = prme("rebuild", "--data-dir", str(pack))
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("prme rebuild: ")
    assert "Traceback" not in result.stderr


def test_status_and_the_http_client_name_a_server_that_is_not_prme(tmp_path: Path) -> None:
    """From an operations trial: ``prme status`` and ``prme erase`` against a server that
    is not PRME printed its whole HTML page."""
    import http.server
    import threading

    import httpx

    from prme.query.http_client import error_from_response

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = prme("status", "--url", url)
        assert result.returncode == 1
        assert result.stderr.strip() == (
            f"prme status: {url} answered 404 with no PRME status: is it a PRME service? (--url)"
        )
        page = httpx.delete(f"{url}/v1/owners", params={"user_id": "bob"})
        said = str(error_from_response(page))
        assert "an HTML page: not a PRME node's answer" in said and f"{url}/ a PRME" in said
        assert "<" not in said
    finally:
        server.shutdown()


@pytest.mark.model
def test_models_pull_makes_the_query_copy_unless_queries_are_float(
    default_model_dir: Path, tmp_path: Path
) -> None:
    from prme.projectors.embeddings.query_model import (
        int8_dot_products,
        query_model_dir,
        verify_query_model,
    )

    models = tmp_path / "models"
    shutil.copytree(default_model_dir, models / default_model_dir.name)  # nothing to download
    exact = prme(
        "models",
        "pull",
        "--models-dir",
        str(models),
        env={"PRME_EMBEDDING__QUERY_PRECISION": "float"},
    )
    assert exact.returncode == 0, exact.stderr
    assert exact.stdout.splitlines() == [str(models / default_model_dir.name)]
    assert not query_model_dir(models / default_model_dir.name).exists()
    pulled = prme("models", "pull", "--models-dir", str(models))
    assert pulled.returncode == 0, pulled.stderr
    query_dir = query_model_dir(models / default_model_dir.name)
    if not int8_dot_products():  # queries stay exact on these cores: no copy to make
        assert pulled.stdout.splitlines() == [str(models / default_model_dir.name)]
        return
    assert pulled.stdout.splitlines() == [str(models / default_model_dir.name), str(query_dir)]
    assert verify_query_model(query_dir, rehash=True)


def test_models_pull_into_a_directory_it_cannot_make_is_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    pulled = prme("models", "pull", "--models-dir", str(blocked / "models"))
    assert pulled.returncode == 1 and pulled.stdout == ""
    [line] = pulled.stderr.strip().splitlines()
    assert line.startswith("prme models pull: ") and "a-file" in line


@pytest.mark.model
def test_rebuild_and_erase_of_a_stopped_pack_make_no_query_copy(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Neither command embeds a query, yet each made the default model's int8 query copy
    (a few seconds, once a machine) as its engine started."""
    from prme.projectors.embeddings.query_model import int8_dot_products, query_model_dir

    models = tmp_path / "models"
    shutil.copytree(default_model_dir, models / default_model_dir.name)  # nothing to download
    env = {"PRME_MODELS_DIR": str(models)}
    data = ["--data-dir", str(tmp_path / "pack")]
    assert prme("ingest", str(write_jsonl(tmp_path / "in.jsonl", LINES)), "--quiet", *data)
    rebuilt = prme("rebuild", "--quiet", *data, env=env)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert json.loads(rebuilt.stdout)["replayed"]
    erased = prme("erase", "--owner", "alice", *data, env=env)
    assert erased.returncode == 0, erased.stderr
    assert not query_model_dir(models / default_model_dir.name).exists()
    if int8_dot_products():  # the engine a query is served from still makes it
        from prme.query.engine import MemoryEngine
        from prme.schemas.config import Settings

        async def served() -> None:
            settings = Settings(data_dir=str(tmp_path / "pack"), models_dir=str(models))
            async with await MemoryEngine.open(settings=settings):
                pass

        asyncio.run(served())
        assert query_model_dir(models / default_model_dir.name).exists()


def test_erase_of_an_owner_with_no_record_says_so(tmp_path: Path) -> None:
    """An erasure of a mistyped owner looked like any other: it is still made (a request
    about someone who never wrote is answered the same way), and says that nothing of the
    owner was on the log."""
    data = ["--data-dir", str(tmp_path / "pack")]
    assert prme("ingest", str(write_jsonl(tmp_path / "in.jsonl", LINES)), "--quiet", *data)
    erased = prme("erase", "--owner", "alice", *data)
    assert erased.returncode == 0, erased.stderr
    assert "no record" not in erased.stderr
    mistyped = prme("erase", "--owner", "Alice", *data)
    assert mistyped.returncode == 0, mistyped.stderr
    assert json.loads(mistyped.stdout)["event_id"]
    assert "no record of owner 'Alice' was on the log" in mistyped.stderr
    again = prme("erase", "--owner", "Alice", *data)  # its marker is on the log now
    assert again.returncode == 0 and "no record" not in again.stderr, again.stderr
