"""A lexical index reopened after a SIGKILL that landed between a commit and the merge that
commit started: the first delete of the next batch must reach every merged segment.

Tantivy stamps a reopened writer's first operation with the last commit's own opstamp. A
merge of the committed segments started by the next commit has that opstamp as its
target, so it took the operation as already applied to a segment whose deletes carry the
same stamp, and moved the merged segment's delete cursor past it: that segment's stale
version of the node stayed next to the new one (the convergence test's lexical digest
differed after ten SIGKILLs, about one run in four under load).

Run as ``python -m tests.test_lexical_restart DIR``, this module is the process that gets
killed: it applies the setup batches to ``DIR`` and sends itself SIGKILL right after the
last commit, while the merge of eight segments that commit started is still running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from prme.projectors.model import ProjectedRecord
from prme.projectors.stores.lexical import LexicalModel

from .record_builders import RecordLog

ROOT = Path(__file__).resolve().parent.parent
SEGMENTS = 8
"""Tantivy's default merge policy merges a level once it holds eight segments."""


def setup_log() -> tuple[RecordLog, list[list[ProjectedRecord]], str]:
    """The log, its batches (one committed segment each) and the node whose stale version
    the bug kept. Each message has its own session, so no batch rewrites another batch's
    documents through their context windows."""
    log = RecordLog()
    batches: list[list[ProjectedRecord]] = []

    def cut() -> None:
        done = sum(len(batch) for batch in batches)
        batches.append(log.records[done:])

    # The largest segment comes first in the merge; its deletes predate the last commit.
    for index in range(200):
        log.message("alice", f"bulk words {index}", session="bulk")
    cut()
    # The segment of the stale candidate: its last delete is in the last commit (below).
    stale = log.message("alice", "the stale candidate", session="stale")
    touched = log.message("alice", "updated by the last commit", session="touched")
    log.message("alice", "keeps the segment from emptying", session="kept")
    cut()
    for index in range(SEGMENTS - 3):
        log.message("alice", f"filler {index}", session=f"filler{index}")
        cut()
    log.archive("alice", touched)  # the eighth segment: its commit starts the merge
    cut()
    return log, batches, stale


def segment_count(path: Path) -> int:
    meta = json.loads((path / "index" / "meta.json").read_text())
    return len(meta["segments"])


def killed_after_the_last_commit(path: Path) -> None:
    """Apply the setup batches in a child process that SIGKILLs itself after the last commit."""
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_lexical_restart", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]


def test_the_first_delete_after_a_restart_reaches_segments_being_merged(tmp_path: Path) -> None:
    log, batches, stale = setup_log()
    for attempt in range(5):
        path = tmp_path / f"attempt{attempt}" / "lexical"
        killed_after_the_last_commit(path)
        if segment_count(path) == SEGMENTS:  # the kill came before the merge landed
            break
    else:
        raise AssertionError("the merge landed before the kill in every attempt")
    setup_records = sum(len(batch) for batch in batches)

    log.archive("alice", stale)
    with LexicalModel(path) as model:
        assert model.applied_offset() == setup_records - 1
        # Deletes the stale version first; the commit starts the merge of the eight.
        model.apply(log.records[setup_records:])
    # Closing waited for the merge.
    assert segment_count(path) < SEGMENTS

    with LexicalModel(path) as model:
        states = [document.state for document in model.documents() if document.node_id == stale]
        assert states == ["archived"]
        assert [hit.node_id for hit in model.search("stale candidate", "alice", None, 5)] == []


def _child(path: Path) -> None:
    _log, batches, _stale = setup_log()
    model = LexicalModel(path)
    for batch in batches:
        model.apply(batch)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
