"""One data directory, one process: only the members a holder starts share its lock."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prme.query.data_lock import TOKEN_ENV, DataDirLock
from prme.schemas.errors import DataDirInUse

_OPEN = """
import sys
from pathlib import Path
from prme.query.data_lock import DataDirLock
from prme.schemas.errors import DataDirInUse
try:
    lock = DataDirLock.acquire(Path(sys.argv[1]))
except DataDirInUse as error:
    print(error)
    sys.exit(2)
print("shared" if not lock.held else "held")
"""


def _open_in_child(
    directory: Path, env: dict[str, str], fds: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _OPEN, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        pass_fds=fds,
    )


def test_only_a_child_started_with_the_locks_token_shares_it(tmp_path: Path) -> None:
    lock = DataDirLock.acquire(tmp_path)
    try:
        assert lock.held and TOKEN_ENV not in os.environ
        plain_env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        stranger = _open_in_child(tmp_path, plain_env)  # a child, but not a member
        assert stranger.returncode == 2, stranger.stdout + stranger.stderr
        assert f"pid {os.getpid()}" in stranger.stdout
        forged = _open_in_child(tmp_path, {**plain_env, TOKEN_ENV: "0" * 32})
        assert forged.returncode == 2
        # With the holder's descriptors, and (from a review) without them: the member
        # read a descriptor it was not given, took the error for its holder's end and
        # stopped itself, 2 runs in 3.
        for fds in (lock.child_fds(), ()):
            member = _open_in_child(tmp_path, lock.child_environment(), fds)
            assert member.returncode == 0, member.stdout + member.stderr
            assert member.stdout.strip() == "shared"
        # Not our parent's lock: ours, taken twice. (From a new-user trial: this said
        # "open in another process, pid <this process>".)
        with pytest.raises(DataDirInUse, match="is already open in this process"):
            DataDirLock.acquire(tmp_path)
    finally:
        lock.release()
    assert _open_in_child(tmp_path, dict(os.environ)).stdout.strip() == "held"


def test_a_holder_with_this_processs_pid_elsewhere_is_another_process(tmp_path: Path) -> None:
    """From a review: two containers sharing a volume are both pid 1, so a lock line naming
    this process's pid does not make the holder this process."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom pathlib import Path\n"
            "from prme.query.data_lock import DataDirLock\n"
            "lock = DataDirLock.acquire(Path(sys.argv[1]))\nprint('held', flush=True)\n"
            "time.sleep(60)\n",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock_file = next(tmp_path.glob("prme.lock"))
        line = lock_file.read_text().split(" ", 1)[1]
        lock_file.write_text(f"{os.getpid()} {line}")  # as another container's pid 1
        with pytest.raises(DataDirInUse, match="is open in another process"):
            DataDirLock.acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
