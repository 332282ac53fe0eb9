"""Cluster figures (JSON on stdout).

``throughput``: retrieve throughput and p50/p95 with concurrent clients against
``prme serve --processes 1`` and ``--processes 2`` on the same machine and the same pack
(the embedded local log, default model), interleaved ``--runs`` times. The clients read
the cluster map from the one port and send each call to the owner's process
(``ClusterRoutes``, the map ``AsyncMemoryClient(url=...)`` keeps; the load generator sends
raw requests over keep-alive connections and decodes nothing, ``benchmarks/raw_http.py``,
and reports the CPU it spent per request). ``--processes 2`` is
also measured with clients that send everything to the one port (the processes forward
half of it to each other).

``failover``: three ``prme serve`` nodes on Kafka; one is SIGKILLed, and the seconds until
every owner answers again are timed, with ``--standby-replicas`` 0 and 1. Both wait out
the session timeout; without a standby the survivors then restore the dead node's
partitions (vectors from the changelog, every record replayed), so a standby's gain grows
with the records those partitions hold.

``scaleout``: one ``prme serve`` node on Kafka holds the pack; a second joins, and every
owner's history is asked through the first node, 16 at a time, until the two nodes own
and serve six partitions each: requests that did not answer 200, their latency, and the
seconds until the split, with warm-up replicas (``cluster.max_warmup_replicas`` 2, the
default) and without (0: a moved partition is replayed by its new owner before it is
served).

    python -m benchmarks.cluster throughput [--memories 2000] [--clients 16] [--seconds 20]
    python -m benchmarks.cluster failover [--owners 200] [--messages 60000]
        [--session-timeout-s 3] [--bootstrap HOST:PORT]
    python -m benchmarks.cluster scaleout [--owners 200] [--messages 60000] [--bootstrap ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import (
    add_common_options,
    chat_turn,
    emit,
    kafka_broker,
    latency_summary,
    machine,
    median,
    process_tree_cpu_s,
    question,
    ratio,
    scratch_directory,
)
from benchmarks.raw_http import RawHttpConnection
from prme.query.http_client import ClusterRoutes

READY_TIMEOUT_S = 600.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRME_")}
    env.update(extra)
    return env


def start_serve(
    data_dir: Path, port: int, args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "prme.cli", "serve", "--data-dir", str(data_dir)]
    command += ["--port", str(port), "--log-level", "warning", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


async def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the node (and, behind one port, every member it names) answers ready."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5) as http:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"prme serve exited:\n{log.read_text()[-3000:]}")
            try:
                view = (await http.get(url + "/v1/cluster")).json()
                urls = [m["url"] for m in view["members"]] or [url]
                answers = [await http.get(u + "/v1/ready") for u in urls]
                if all(a.status_code == 200 for a in answers):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready in {READY_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            await asyncio.sleep(0.2)  # poll interval while the node starts


# -- throughput -----------------------------------------------------------------------


async def fill_pack(url: str, memories: int, owners: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    names = [f"owner-{i}" for i in range(owners)]
    async with httpx.AsyncClient(timeout=600) as http:
        for start in range(0, memories, 200):
            batch = [
                {"user_id": names[(start + i) % owners], "content": chat_turn(rng)}
                for i in range(min(200, memories - start))
            ]
            answer = await http.post(
                url + "/v1/memories/batch", json={"messages": batch, "wait": False}
            )
            answer.raise_for_status()
        while (await http.get(url + "/v1/ready")).json()["lag"]:  # projected, all of it
            await asyncio.sleep(0.5)  # poll interval while the model embeds the pack
    return names


async def load(
    url: str,
    owners: list[str],
    clients: int,
    seconds: float,
    *,
    routed: bool,
    seed: int,
    server_pid: int,
) -> dict[str, Any]:
    """``clients`` tasks retrieving for ``seconds``: requests/s, latency, and the CPU that
    the servers (``server_pid`` and its children) and the load generator (it shares the
    cores with them) spent per request and in all."""
    rng = random.Random(seed)
    samples: list[float] = []
    errors = 0
    stop_at = time.monotonic() + seconds
    routes = ClusterRoutes([url])
    if routed:
        # The client's copy of the map (what AsyncMemoryClient(url=...) keeps) picks the
        # owner's process for each call.
        async with httpx.AsyncClient(timeout=60) as http:
            await routes.refresh(http)

    async def client_loop(index: int) -> None:
        nonlocal errors
        local = random.Random(rng.random() + index)
        # Raw requests, nothing decoded: the cores the load generator shares go to the
        # servers.
        connections: dict[str, RawHttpConnection] = {}
        try:
            while time.monotonic() < stop_at:
                owner = local.choice(owners)
                body = {"user_id": owner, "query": question(local), "top_k": 5}
                node = routes.node_for(owner) if routed else url
                connection = connections.get(node) or connections.setdefault(
                    node, RawHttpConnection(node)
                )
                began = time.perf_counter()
                try:
                    status, _ = await connection.post_json(
                        "/v1/retrieve", json.dumps(body).encode()
                    )
                except (OSError, ValueError, asyncio.IncompleteReadError):
                    await connection.close()  # counted; the next call reconnects
                    status = 0
                if status == 200:
                    samples.append(time.perf_counter() - began)
                else:
                    errors += 1
        finally:
            for connection in connections.values():
                await connection.close()

    started, cpu_started = time.monotonic(), time.process_time()
    server_cpu_started = process_tree_cpu_s(server_pid)
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu_started
    server_cpu = process_tree_cpu_s(server_pid) - server_cpu_started
    requests = max(1, len(samples) + errors)
    return {
        "requests_per_s": round(len(samples) / elapsed, 1),
        "errors": errors,
        "latency": latency_summary(samples),
        "server_cpu_ms_per_request": round(1000 * server_cpu / requests, 3),
        "server_cores_busy": round(server_cpu / elapsed, 3),
        "load_generator_cpu_ms_per_request": round(1000 * cpu / requests, 3),
        "load_generator_cores_busy": round(cpu / elapsed, 3),
    }


async def throughput(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    pack, log = work / "pack", work / "serve.log"
    env = clean_env()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    seeding = start_serve(pack, port, [], env, log)
    try:
        await wait_ready(url, seeding, log)
        began = time.monotonic()
        owners = await fill_pack(url, arguments.memories, arguments.owners, seed=7)
        filled_s = time.monotonic() - began
    finally:
        stop(seeding)
    variants = [
        ("processes_1", 1, True),
        ("processes_2", 2, True),
        ("processes_2_one_port", 2, False),
    ]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    for run in range(arguments.runs):
        for name, processes, routed in variants:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            args = [] if processes == 1 else ["--processes", str(processes)]
            process = start_serve(pack, port, args, env, log)
            try:
                await wait_ready(url, process, log)
                await load(  # warm-up
                    url,
                    owners,
                    arguments.clients,
                    2.0,
                    routed=routed,
                    seed=run,
                    server_pid=process.pid,
                )
                runs[name].append(
                    await load(
                        url,
                        owners,
                        arguments.clients,
                        arguments.seconds,
                        routed=routed,
                        seed=run,
                        server_pid=process.pid,
                    )
                )
            finally:
                stop(process)

    def summary(name: str) -> dict[str, Any]:
        figures = runs[name]
        return {
            "requests_per_s": median([f["requests_per_s"] for f in figures]),
            "p50_ms": median([f["latency"].p50_ms for f in figures]),
            "p95_ms": median([f["latency"].p95_ms for f in figures]),
            "errors": sum(f["errors"] for f in figures),
            "server_cpu_ms_per_request": median([f["server_cpu_ms_per_request"] for f in figures]),
            "server_cores_busy": median([f["server_cores_busy"] for f in figures]),
            "load_generator_cpu_ms_per_request": median(
                [f["load_generator_cpu_ms_per_request"] for f in figures]
            ),
            "load_generator_cores_busy": median([f["load_generator_cores_busy"] for f in figures]),
            "runs": figures,
        }

    results = {name: summary(name) for name in runs}
    return {
        "benchmark": "cluster.throughput",
        "machine": machine(),
        "load_average": os.getloadavg(),
        "pack": {"memories": arguments.memories, "owners": arguments.owners, "fill_s": filled_s},
        "clients": arguments.clients,
        "seconds_per_run": arguments.seconds,
        "results": results,
        "processes_2_to_1_throughput": ratio(
            results["processes_2"]["requests_per_s"], results["processes_1"]["requests_per_s"]
        ),
        "processes_2_to_1_p95": ratio(
            results["processes_2"]["p95_ms"], results["processes_1"]["p95_ms"]
        ),
        "processes_2_to_1_ceiling": throughput_ceiling(
            results["processes_1"], results["processes_2"], len(os.sched_getaffinity(0))
        ),
    }


def throughput_ceiling(one: dict[str, Any], two: dict[str, Any], cores: int) -> float | None:
    """The most ``two`` could serve relative to ``one`` on this machine: every core busy
    at two's measured CPU per request (servers and load generator together). When one
    process already keeps most cores busy, a second has little left to add."""
    cpu_ms = two["server_cpu_ms_per_request"] + two["load_generator_cpu_ms_per_request"]
    if cpu_ms <= 0:
        return None
    return ratio(1000 * cores / cpu_ms, one["requests_per_s"])


def kafka_env(
    bootstrap: str, topic: str, arguments: argparse.Namespace, **extra: str
) -> dict[str, str]:
    return clean_env(
        PRME_LOG__TRANSPORT="kafka",
        PRME_LOG__BOOTSTRAP=bootstrap,
        PRME_LOG__TOPIC=topic,
        PRME_LOG__DLQ_TOPIC=f"{topic}.dlq",
        PRME_CLUSTER__GROUP=f"{topic}-group",
        PRME_CLUSTER__SECRET="bench",
        PRME_CLUSTER__SESSION_TIMEOUT_S=str(arguments.session_timeout_s),
        PRME_EMBEDDING__THREADS="1",
        **extra,
    )


async def fill_from_pool(
    http: httpx.AsyncClient, urls: list[str], names: list[str], arguments: argparse.Namespace
) -> None:
    """``--messages`` messages of ``names`` drawn from ``--distinct-texts`` texts, so the
    fill embeds the pool, not every message; each (owner, text) still has its own record,
    changelog entry and documents, which a moved partition restores. Waits until every
    node has projected them."""
    rng = random.Random(5)
    pool = [chat_turn(rng) for _ in range(arguments.distinct_texts)]
    for start in range(0, arguments.messages, 200):
        batch = [
            {"user_id": rng.choice(names), "content": rng.choice(pool)}
            for _ in range(min(200, arguments.messages - start))
        ]
        answer = await http.post(
            urls[start // 200 % len(urls)] + "/v1/memories/batch",
            json={"messages": batch, "wait": False},
        )
        answer.raise_for_status()
    for url in urls:
        while (await http.get(url + "/v1/ready")).json()["lag"]:
            await asyncio.sleep(0.5)  # poll interval while the nodes embed the pack


# -- failover -------------------------------------------------------------------------


async def answering(urls: list[str], owners: list[str], headers: dict[str, str]) -> bool:
    """Whether every owner's history answers 200 through the first live node (asked 16 at
    a time, so one check takes milliseconds, not a sweep of every owner in turn)."""
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:

        async def answers(owner: str) -> bool:
            async with gate:
                try:
                    answer = await http.get(urls[0] + "/v1/history", params={"user_id": owner})
                except httpx.HTTPError:
                    return False
                return answer.status_code == 200

        return all(await asyncio.gather(*(answers(owner) for owner in owners)))


async def failover_once(
    bootstrap: str, work: Path, arguments: argparse.Namespace, standbys: int, tag: str
) -> dict[str, Any]:
    owners = arguments.owners
    topic = f"failover-{tag}"
    env = kafka_env(bootstrap, topic, arguments, PRME_CLUSTER__STANDBY_REPLICAS=str(standbys))
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    log = work / f"{tag}.log"
    nodes = [start_serve(work / f"{tag}-n{i}", p, [], env, log) for i, p in enumerate(ports)]
    names = [f"fo-{i}" for i in range(owners)]
    try:
        for url, node in zip(urls, nodes, strict=True):
            await wait_ready(url, node, log)
        async with httpx.AsyncClient(timeout=120) as http:
            deadline = time.monotonic() + 120
            while True:  # the three nodes split the partitions before anything is written
                views = [(await http.get(u + "/v1/cluster")).json() for u in urls]
                if all(len(v["members"]) == 3 and v["serving"] for v in views):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no 3-way split: {views}")
                await asyncio.sleep(0.2)  # poll interval while the group settles
            for name in names:
                body = {"user_id": name, "content": f"{name} keeps bees"}
                (await http.post(urls[0] + "/v1/memories", json=body)).raise_for_status()
            await fill_from_pool(http, urls, names, arguments)
            if standbys:
                await asyncio.sleep(3.0)
        victim = nodes[2]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.wait(timeout=30)
        while not await answering(urls[:2], names, {}):
            if time.monotonic() - killed > 300:
                raise RuntimeError("owners did not answer again within 300 s")
            await asyncio.sleep(0.1)  # poll interval while the group rebalances
        return {"failover_s": round(time.monotonic() - killed, 2)}
    finally:
        for node in nodes:
            stop(node)


async def failover(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    figures: dict[str, list[float]] = {"standby_0": [], "standby_1": []}
    with kafka_broker(arguments.bootstrap, work / "kafka") as bootstrap:
        for run in range(arguments.runs):
            for standbys in (0, 1):
                once = await failover_once(
                    bootstrap, work, arguments, standbys, f"s{standbys}-r{run}-{os.getpid()}"
                )
                figures[f"standby_{standbys}"].append(once["failover_s"])
    return {
        "benchmark": "cluster.failover",
        "machine": machine(),
        "owners": arguments.owners,
        "messages": arguments.messages,
        "session_timeout_s": arguments.session_timeout_s,
        "failover_s": {k: {"median": median(v), "runs": v} for k, v in figures.items()},
        "standby_1_to_0": ratio(median(figures["standby_1"]), median(figures["standby_0"])),
        "distinct_texts": arguments.distinct_texts,
        "method": "3 nodes, one SIGKILLed; seconds until every owner's history answers 200 "
        "through a surviving node (the session timeout included)",
    }


# -- scale-out ------------------------------------------------------------------------


async def scaleout_once(
    bootstrap: str, work: Path, arguments: argparse.Namespace, warmups: int, tag: str
) -> dict[str, Any]:
    topic = f"scaleout-{tag}"
    env = kafka_env(bootstrap, topic, arguments, PRME_CLUSTER__MAX_WARMUP_REPLICAS=str(warmups))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    log = work / f"{tag}.log"
    first = start_serve(work / f"{tag}-n0", ports[0], [], env, log)
    nodes = [first]
    names = [f"so-{i}" for i in range(arguments.owners)]
    try:
        await wait_ready(urls[0], first, log)
        async with httpx.AsyncClient(timeout=120) as http:
            await fill_from_pool(http, urls[:1], names, arguments)
        samples: list[tuple[float, int]] = []
        failures: list[str] = []
        stop_asking = asyncio.Event()

        async def ask() -> None:
            gate = asyncio.Semaphore(16)
            async with httpx.AsyncClient(timeout=60) as http:

                async def one(owner: str) -> None:
                    async with gate:
                        began = time.monotonic()
                        try:
                            answer = await http.get(
                                urls[0] + "/v1/history", params={"user_id": owner}
                            )
                            status = answer.status_code
                            if status != 200 and len(failures) < 5:
                                failures.append(f"{status} {answer.text[:160]}")
                        except httpx.HTTPError as error:
                            status = 0
                            failures.append(f"{type(error).__name__}: {error}"[:160])
                        samples.append((time.monotonic() - began, status))

                while not stop_asking.is_set():
                    await asyncio.gather(*(one(owner) for owner in names))

        asking = asyncio.get_running_loop().create_task(ask())
        joined = time.monotonic()
        second = start_serve(work / f"{tag}-n1", ports[1], [], env, log)
        nodes.append(second)
        half = 6
        async with httpx.AsyncClient(timeout=30) as http:
            while True:
                try:
                    views = [(await http.get(u + "/v1/cluster")).json() for u in urls]
                    mine = [
                        next((m["partitions"] for m in v["members"] if m["url"] == u), [])
                        for u, v in zip(urls, views, strict=True)
                    ]
                    if [len(p) for p in mine] == [half, half] and all(
                        len(v["serving"]) == half for v in views
                    ):
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                if time.monotonic() - joined > 900:
                    raise RuntimeError("the two nodes did not split the partitions in 900 s")
                await asyncio.sleep(0.2)  # poll interval while the group rebalances
        split_s = time.monotonic() - joined
        stop_asking.set()
        await asking
        failed = sum(1 for _, status in samples if status != 200)
        return {
            "split_s": round(split_s, 2),
            "requests": len(samples),
            "failed": failed,
            "failures": failures,
            "latency": latency_summary([s for s, _ in samples]),
        }
    finally:
        for node in nodes:
            stop(node)


async def scaleout(arguments: argparse.Namespace, work: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"warmups_2": [], "warmups_0": []}
    with kafka_broker(arguments.bootstrap, work / "kafka") as bootstrap:
        for run in range(arguments.runs):
            for warmups in (2, 0):
                runs[f"warmups_{warmups}"].append(
                    await scaleout_once(
                        bootstrap, work, arguments, warmups, f"w{warmups}-r{run}-{os.getpid()}"
                    )
                )
    return {
        "benchmark": "cluster.scaleout",
        "machine": machine(),
        "owners": arguments.owners,
        "messages": arguments.messages,
        "distinct_texts": arguments.distinct_texts,
        "runs": runs,
        "median": {
            name: {
                "split_s": median([r["split_s"] for r in rs]),
                "failed": median([r["failed"] for r in rs]),
                "max_ms": median([r["latency"].max_ms for r in rs]),
                "p95_ms": median([r["latency"].p95_ms for r in rs]),
            }
            for name, rs in runs.items()
        },
        "method": "one node holds the pack, a second joins; every owner's history is asked "
        "through the first node, 16 at a time, until each node owns and serves 6 partitions",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figure", choices=["throughput", "failover", "scaleout"])
    parser.add_argument("--memories", type=int, default=2_000)
    parser.add_argument("--owners", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--bootstrap", help="failover: use this broker instead of starting one")
    parser.add_argument(
        "--messages", type=int, default=60_000, help="failover: messages in the partitions"
    )
    parser.add_argument(
        "--distinct-texts", type=int, default=4_000, help="failover: the texts they draw on"
    )
    parser.add_argument(
        "--session-timeout-s", type=float, default=3.0, help="failover: the group's timeout"
    )
    add_common_options(parser)
    arguments = parser.parse_args(argv)
    with scratch_directory(arguments.work_dir) as work:
        measure = {"throughput": throughput, "failover": failover, "scaleout": scaleout}[
            arguments.figure
        ]
        report = asyncio.run(measure(arguments, work))
    emit(report, arguments.out)


if __name__ == "__main__":
    main()
