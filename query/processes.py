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

import os
import secrets
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from prme.schemas.config import Settings
from prme.schemas.errors import ConfigurationError

from .auth import check_bind_safety
from .data_lock import DataDirLock


def serve_processes(settings: Settings, processes: int, options: Sequence[str]) -> int:
    """Run ``processes`` ``prme serve`` children until SIGINT/SIGTERM; their exit status."""
    check_bind_safety(settings.service)
    if settings.cluster.advertised_url:
        raise ConfigurationError(
            "--processes gives each process its own URL (HOST:PORT+1+i): leave "
            "--advertised-url unset"
        )
    data_dir = settings.data_path
    data_dir.mkdir(parents=True, exist_ok=True)
    lock = DataDirLock.acquire(data_dir)
    host, port = settings.service.host, settings.service.port
    sockets: list[socket.socket] = []
    try:
        return _serve_children(settings, processes, options, host, port, sockets, lock)
    finally:
        for sock in sockets:
            sock.close()
        lock.release()


def _serve_children(
    settings: Settings,
    processes: int,
    options: Sequence[str],
    host: str,
    port: int,
    sockets: list[socket.socket],
    lock: DataDirLock,
) -> int:
    public = _listen(host, port)
    sockets.append(public)
    port = public.getsockname()[1]
    # Each child's own port: PORT+1+i when free (firewall rules like fixed ports), else any.
    fixed = settings.service.port != 0
    own = [_listen(host, port + 1 + i if fixed else 0, any_if_taken=True) for i in range(processes)]
    sockets.extend(own)
    shown = f"[{host}]" if ":" in host else host
    urls = [f"http://{shown}:{s.getsockname()[1]}" for s in own]
    env = lock.child_environment()
    # Members forward to each other: a secret for this cluster of processes if none is set.
    env.setdefault("PRME_CLUSTER__SECRET", settings.cluster.secret or secrets.token_urlsafe(24))
    if settings.embedding.threads is None:  # N model sessions share the cores
        env["PRME_EMBEDDING__THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    children: list[subprocess.Popen[bytes]] = []
    try:
        for sock, url in zip(own, urls, strict=True):
            command = [sys.executable, "-m", "prme.cli", "serve", *options]
            command += ["--listen-fd", f"{public.fileno()},{sock.fileno()}"]
            command += ["--advertised-url", url]
            if settings.log.transport == "local":
                command += ["--static-members", ",".join(urls)]
            children.append(
                subprocess.Popen(command, env=env, pass_fds=(public.fileno(), sock.fileno()))
            )
        print(
            f"prme serve: {processes} processes on http://{shown}:{port} ({', '.join(urls)})",
            file=sys.stderr,
            flush=True,
        )
        forward_signals(children)
        codes = [child.wait() for child in children]
        # A child stopped by the signal it was forwarded ends by that signal (uvicorn
        # re-raises it after shutting down): a clean stop, not a failure.
        failed = [c for c in codes if c not in (0, -signal.SIGTERM, -signal.SIGINT)]
        return failed[0] if failed else 0
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def _listen(host: str, port: int, *, any_if_taken: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if any_if_taken and port:
            return _listen(host, 0)
        raise ConfigurationError(f"cannot listen on {host}:{port}: {error}") from error
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def forward_signals(children: list[subprocess.Popen[bytes]]) -> None:
    """This process's first SIGINT or SIGTERM becomes one SIGTERM to each child."""
    forwarded = False

    def forward(signum: int, frame: object) -> None:
        # Ctrl-C reaches the children through the process group too; one SIGTERM each
        # covers a signal sent to this process alone. Children stop on the first signal.
        nonlocal forwarded
        if not forwarded:
            forwarded = True
            for child in children:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
