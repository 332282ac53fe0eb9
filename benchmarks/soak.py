"""A bounded soak of the HTTP service: 16 concurrent clients, mixed writes and retrieves,
for ``--seconds`` (default 5 minutes); errors, server RSS growth and p50/p95 per operation
(JSON on stdout).

The server is ``prme serve`` as the CLI runs it (``query.serve.run_server``: the embedded
engine, uvicorn), in a child process of its own (so its RSS is the server's alone), on a
socket bound to 127.0.0.1 by the child; API keys are configured, every client uses one
(an admin key and owner-bound keys, alternating). Embedding: ``--provider hashed``
(default; a deterministic bag of words at 384 dimensions, so the soak measures the
service, not the model) or ``default`` (all-MiniLM-L6-v2 through FastEmbed).

Each client loops until the time is up: with probability ``--write-share`` it stores a
memory (``wait: true``, read-your-writes) for one of ``--owners`` owners, else it
retrieves for one of them; now and then (1 in 20) it reads a chat history. Every answer
other than the expected 2xx, and every transport error, is an error. At the end every
acknowledged write is looked for in its owner's history: ``lost_writes`` must be 0.
RSS (VmRSS of the server process) is sampled every ``--rss-every`` seconds; ``start`` is
after a warm-up of ``--warmup`` seconds of the same load, so start-up allocation is not
counted as growth.

    python -m benchmarks.soak [--seconds 300] [--clients 16] [--owners 64]
        [--provider hashed|default] [--out FILE] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    add_common_options,
    chat_turn,
    emit,
    latency_summary,
    machine,
    question,
    scratch_directory,
)

ADMIN_KEY = "soak-admin"


def owner_name(index: int) -> str:
    return f"soak-owner-{index:03d}"


def api_keys(owners: int) -> dict[str, str]:
    """One key per owner and an admin key."""
    return {ADMIN_KEY: "*", **{f"soak-key-{i:03d}": owner_name(i) for i in range(owners)}}


# -- the server (child process) -----------------------------------------------------------


def serve_child(data_dir: Path, port_file: Path, provider: str, owners: int) -> None:
    """Run ``prme serve`` on 127.0.0.1 (a free port, written to ``port_file``)."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.serve import run_server
    from prme.schemas.config import Settings

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(256)
    settings = Settings(data_dir=str(data_dir)).replace(service={"api_keys": api_keys(owners)})
    embedding = HashedBagOfWordsProvider(dimension=384) if provider == "hashed" else None
    staged = port_file.with_name(port_file.name + ".tmp")
    staged.write_text(str(listener.getsockname()[1]))
    staged.rename(port_file)  # the parent never reads half a port
    asyncio.run(
        run_server(settings, embedding_provider=embedding, sockets=[listener], log_level="warning")
    )


def rss_mib(pid: int) -> float:
    """The resident set size of process ``pid`` in MiB (Linux: /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


# -- the load (this process) ---------------------------------------------------------------


@dataclass
class Tally:
    latencies: dict[str, list[float]] = field(
        default_factory=lambda: {"store": [], "retrieve": [], "history": []}
    )
    errors: list[str] = field(default_factory=list)
    stored: dict[str, list[str]] = field(default_factory=dict)
    """Owner -> event ids of acknowledged writes."""


async def client_loop(
    index: int,
    http: httpx.AsyncClient,
    arguments: argparse.Namespace,
    deadline: float,
    tally: Tally,
) -> None:
    rng = random.Random(1000 + index)
    while time.monotonic() < deadline:
        owner_index = rng.randrange(arguments.owners)
        owner = owner_name(owner_index)
        # Half the clients use the owner's own key, half the admin key.
        key = ADMIN_KEY if index % 2 else f"soak-key-{owner_index:03d}"
        headers = {"Authorization": f"Bearer {key}"}
        roll = rng.random()
        if roll < 0.05:
            operation, method, path = "history", "GET", "/v1/history"
            kwargs: dict[str, Any] = {"params": {"user_id": owner, "session_id": "soak"}}
        elif roll < 0.05 + arguments.write_share:
            operation, method, path = "store", "POST", "/v1/memories"
            body = {"user_id": owner, "session_id": "soak", "content": chat_turn(rng)}
            kwargs = {"json": body}
        else:
            operation, method, path = "retrieve", "POST", "/v1/retrieve"
            body = {"user_id": owner, "query": question(rng), "top_k": 10, "token_budget": 512}
            kwargs = {"json": body}
        started = time.perf_counter()
        try:
            response = await http.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as error:
            tally.errors.append(f"{operation}: {type(error).__name__}: {error}")
            continue
        elapsed = time.perf_counter() - started
        expected = 201 if operation == "store" else 200
        if response.status_code != expected:
            tally.errors.append(f"{operation}: {response.status_code} {response.text[:200]}")
            continue
        tally.latencies[operation].append(elapsed)
        if operation == "store":
            tally.stored.setdefault(owner, []).append(response.json()["event_id"])


async def run_load(url: str, arguments: argparse.Namespace, seconds: float, tally: Tally) -> None:
    limits = httpx.Limits(max_connections=arguments.clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(client_loop(i, http, arguments, deadline, tally) for i in range(arguments.clients))
        )


async def lost_writes(url: str, tally: Tally) -> int:
    """Acknowledged writes missing from their owner's history."""
    missing = 0
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        for owner, event_ids in tally.stored.items():
            response = await http.get(
                "/v1/history", params={"user_id": owner, "session_id": "soak"}
            )
            response.raise_for_status()
            seen = {message["event_id"] for message in response.json()}
            missing += sum(1 for event_id in event_ids if event_id not in seen)
    return missing


async def sample_rss(pid: int, every_s: float, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(rss_mib(pid))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


async def soak(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    data_dir, port_file = work / "pack", work / "port"
    port_file.unlink(missing_ok=True)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.soak",
            "--serve-child",
            str(data_dir),
            str(port_file),
            "--provider",
            arguments.provider,
            "--owners",
            str(arguments.owners),
        ],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists() or not port_file.read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the soak server did not start")
            await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        await _wait_ready(url, child)
        warmup = Tally()
        await run_load(url, arguments, arguments.warmup, warmup)
        rss_start = rss_mib(child.pid)
        samples: list[float] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(child.pid, arguments.rss_every, samples, stop))
        tally = Tally()
        started = time.monotonic()
        await run_load(url, arguments, arguments.seconds, tally)
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        rss_end = rss_mib(child.pid)
        lost = await lost_writes(url, tally)
    finally:
        child.terminate()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    operations = {
        name: latency_summary(samples_s) for name, samples_s in tally.latencies.items() if samples_s
    }
    requests = sum(len(samples_s) for samples_s in tally.latencies.values()) + len(tally.errors)
    return {
        "benchmark": "soak",
        "machine": machine(),
        "setup": {
            "seconds": arguments.seconds,
            "warmup_seconds": arguments.warmup,
            "clients": arguments.clients,
            "owners": arguments.owners,
            "write_share": arguments.write_share,
            "provider": arguments.provider,
            "server": "prme serve (run_server) in a child process on 127.0.0.1, embedded log",
        },
        "requests": requests,
        "requests_per_s": round(requests / elapsed, 1) if elapsed else None,
        "operations": {
            name: {"count": len(tally.latencies[name]), "latency": summary}
            for name, summary in operations.items()
        },
        "errors": len(tally.errors),
        "error_samples": tally.errors[:10],
        "acknowledged_writes": sum(len(ids) for ids in tally.stored.values()),
        "lost_writes": lost,
        "rss_mib": {
            "start": round(rss_start, 1),
            "end": round(rss_end, 1),
            "max": round(max([rss_start, rss_end, *samples]), 1),
            "growth": round(rss_end - rss_start, 1),
            "growth_pct": round(100 * (rss_end - rss_start) / rss_start, 1),
            "growth_per_1000_writes": round(
                1000 * (rss_end - rss_start) / max(1, sum(map(len, tally.stored.values()))), 2
            ),
            "samples": len(samples),
            "series": [round(sample, 1) for sample in samples],
        },
    }


async def _wait_ready(url: str, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        while True:
            try:
                if (await http.get("/v1/ready")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the soak server did not become ready")
            await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="load time (default 300)")
    parser.add_argument("--warmup", type=float, default=10.0, help="warm-up before RSS start")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--owners", type=int, default=64)
    parser.add_argument("--write-share", type=float, default=0.45)
    parser.add_argument("--provider", choices=("hashed", "default"), default="hashed")
    parser.add_argument("--rss-every", type=float, default=5.0, help="RSS sampling period (s)")
    parser.add_argument("--serve-child", nargs=2, metavar=("DATA_DIR", "PORT_FILE"))
    add_common_options(parser)
    arguments = parser.parse_args(argv)
    if arguments.serve_child:
        data_dir, port_file = (Path(p) for p in arguments.serve_child)
        serve_child(data_dir, port_file, arguments.provider, arguments.owners)
        return
    with scratch_directory(arguments.work_dir) as work:
        report = asyncio.run(soak(arguments, work))
    emit(report, arguments.out)
    if report["errors"] or report["lost_writes"]:
        print(json.dumps({"failed": "errors or lost writes"}), file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
