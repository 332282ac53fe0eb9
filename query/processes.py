"""``prme serve --processes N``: N member processes behind one listening port.

The parent binds the clients' port once and hands the socket to every child (as uvicorn's
and gunicorn's workers share theirs: the kernel gives each connection to one of them), and
binds each child a port of its own, the URL it advertises to the others. The children
split the partitions like any nodes of a cluster — on Kafka through the consumer group, on
the embedded log by the static split p mod N — and forward to each other with the same
routing code. The parent holds the data directory's lock; its children share the
directory (each projects other partitions).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .auth import check_bind_safety
from .data_lock import DataDirLock
from .listening import listen

RESTARTS_PER_MINUTE = 5
RESTART_DELAY_S = 1.0
_log = logging.getLogger("prme.serve")


def serve_processes(settings: Settings, processes: int, options: Sequence[str]) -> int:
    """Run ``processes`` ``prme serve`` children until SIGINT/SIGTERM; their exit status."""
    check_bind_safety(settings.service)
    if settings.cluster.advertised_url:
        raise ConfigurationError(
            "--processes gives each process its own URL (HOST:PORT+1+i): leave "
            "--advertised-url unset"
        )
    host, port = settings.service.host, settings.service.port
    sockets = [listen(host, port)]  # a taken port is refused before the directory is made
    try:
        data_dir = settings.data_path
        lock = DataDirLock.acquire(data_dir)
        try:
            return _serve_children(settings, processes, options, host, sockets, lock)
        finally:
            lock.release()
    finally:
        for sock in sockets:
            sock.close()


def _serve_children(
    settings: Settings,
    processes: int,
    options: Sequence[str],
    host: str,
    sockets: list[socket.socket],
    lock: DataDirLock,
) -> int:
    public = sockets[0]
    port = public.getsockname()[1]
    # Each child's own port: PORT+1+i when free (firewall rules like fixed ports), else any.
    fixed = settings.service.port != 0
    own = [listen(host, port + 1 + i if fixed else 0, any_if_taken=True) for i in range(processes)]
    sockets.extend(own)
    shown = f"[{host}]" if ":" in host else host
    urls = [f"http://{shown}:{s.getsockname()[1]}" for s in own]
    env = lock.child_environment()
    held = lock.child_fds()
    # Members forward to each other: a secret for this cluster of processes if none is set.
    env.setdefault("PRME_CLUSTER__SECRET", settings.cluster.secret or secrets.token_urlsafe(24))
    if settings.embedding.threads is None:  # N model sessions share the cores
        env["PRME_EMBEDDING__THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))

    def start(index: int) -> subprocess.Popen[bytes]:
        sock, url = own[index], urls[index]
        command = [sys.executable, "-m", "prme.cli", "serve", *options]
        command += ["--listen-fd", f"{public.fileno()},{sock.fileno()}"]
        command += ["--advertised-url", url]
        if settings.log.transport == "local":
            command += ["--static-members", ",".join(urls)]
        return subprocess.Popen(command, env=env, pass_fds=(public.fileno(), sock.fileno(), *held))

    announced = f"prme serve: {processes} processes on http://{shown}:{port} ({', '.join(urls)})"

    def stop_listening() -> None:  # the children close their copies as they stop
        for sock in sockets:
            sock.close()

    return supervise(start, processes, announced, on_stop=stop_listening)


def supervise(
    start: Callable[[int], subprocess.Popen[bytes]],
    count: int,
    announced: str = "",
    *,
    on_stop: Callable[[], None] = lambda: None,
) -> int:
    """Run ``count`` children (``start(i)``) until SIGINT/SIGTERM, forwarded to them
    (``on_stop`` runs first: the parent stops listening, so a connection nobody will
    serve is refused rather than queued and reset);
    the first failure's exit status, else 0. A child that exits on its own is started
    again (as gunicorn does its workers: its partitions would otherwise answer 503, or
    move to the others, for good); more than ``RESTARTS_PER_MINUTE`` such exits in a
    minute is a crash loop, which stops the others and returns its status."""
    children: list[subprocess.Popen[bytes]] = []
    try:
        children.extend(start(index) for index in range(count))
        if announced:
            print(announced, file=sys.stderr, flush=True)
        return _supervise(children, start, forward_signals(children, on_stop))
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def _supervise(
    children: list[subprocess.Popen[bytes]],
    start: Callable[[int], subprocess.Popen[bytes]],
    stopping: threading.Event,
) -> int:
    """See :func:`supervise`. A child that ends by the signal it was forwarded stopped
    cleanly (uvicorn re-raises it)."""
    running = {child.pid: index for index, child in enumerate(children)}
    exits: collections.deque[float] = collections.deque()
    failed = 0
    while running:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # none left to wait for
            break
        index = running.pop(pid, None)
        if index is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        children[index].returncode = code  # reaped here: Popen must not wait for it again
        if stopping.is_set():
            if code not in (0, -signal.SIGTERM, -signal.SIGINT) and not failed:
                failed = code
            continue
        now = time.monotonic()
        exits.append(now)
        while exits and exits[0] < now - 60:
            exits.popleft()
        if len(exits) > RESTARTS_PER_MINUTE:
            _log.error("process %d exited with %d again: stopping the others", index, code)
            stopping.set()
            _terminate(children)
            failed = failed or code or 1
            continue
        _log.error("process %d (pid %d) exited with %d: starting it again", index, pid, code)
        time.sleep(RESTART_DELAY_S)  # a stop signal meanwhile runs its handler and returns
        if stopping.is_set():
            continue
        children[index] = start(index)
        running[children[index].pid] = index
        if stopping.is_set():  # the signal came while it started: the handler missed it
            _terminate([children[index]])
    return failed


def _terminate(children: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each child not yet reaped. By pid, not ``Popen.poll``: polling would reap a
    child behind :func:`_supervise`'s ``os.wait``; an unreaped pid is never reused."""
    for child in children:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)


def forward_signals(
    children: list[subprocess.Popen[bytes]], on_stop: Callable[[], None] = lambda: None
) -> threading.Event:
    """This process's first SIGINT or SIGTERM runs ``on_stop``, then becomes one SIGTERM
    to each child; the event returned is set from then on."""
    stopping = threading.Event()

    def forward(signum: int, frame: object) -> None:
        # Ctrl-C reaches the children through the process group too; one SIGTERM each
        # covers a signal sent to this process alone. Children stop on the first signal.
        if not stopping.is_set():
            stopping.set()
            on_stop()
            _terminate(children)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return stopping
