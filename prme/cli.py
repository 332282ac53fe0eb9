"""The prme command line: ingest, audit, erase, models, project, rebuild, serve, status, mcp."""

from __future__ import annotations

import argparse
import asyncio
import codecs
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from prme.projectors.registry import MODEL_NAMES
from prme.schemas.cluster import DUPLICATE_URL, SECRET_REFUSED
from prme.schemas.config import Settings

LAG_REFRESH_S = 5.0
"""How often ``prme project`` checks its projector (and, with ``--metrics-port``, recomputes
the lag gauges)."""


def _settings(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if getattr(args, "data_dir", None):
        overrides["data_dir"] = args.data_dir
    log: dict[str, Any] = {}
    if getattr(args, "transport", None):
        log["transport"] = args.transport
    if getattr(args, "bootstrap", None):
        log["bootstrap"] = args.bootstrap
    if log:
        overrides["log"] = log
    settings = Settings.from_env(**overrides)
    from prme.producers.paths import file_in_the_way
    from prme.schemas.errors import ConfigurationError

    blocker = file_in_the_way(settings.data_path)
    if blocker == settings.data_path:
        raise ConfigurationError(f"the data directory {settings.data_dir} is a file")
    if blocker is not None:
        raise ConfigurationError(
            f"the data directory {settings.data_dir} cannot be made: {blocker} is a file"
        )
    return settings


def _add_log_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="data directory (PRME_DATA_DIR, default ./memory)")
    parser.add_argument("--transport", choices=["local", "kafka"], help="PRME_LOG__TRANSPORT")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (PRME_LOG__BOOTSTRAP)")


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="log lines on stderr: text, or one JSON object per line",
    )


def _read_lines(path: str) -> Iterator[bytes]:
    """The file's lines; a UTF-8 byte order mark (as some Windows editors write) is not
    part of the first."""
    with contextlib.nullcontext(sys.stdin.buffer) if path == "-" else _opened(path) as handle:
        first = next(handle, None)
        if first is None:
            return
        yield first.removeprefix(codecs.BOM_UTF8)
        yield from handle


def _opened(path: str) -> BinaryIO:
    from prme.schemas.errors import ConfigurationError

    try:
        return open(path, "rb")
    except OSError as error:
        raise ConfigurationError(f"cannot read {path}: {error.strerror or error}") from None


def _require_log(settings: Settings) -> None:
    """An embedded log is read only where one exists (a typo in ``--data-dir`` is an
    error, not an empty answer and a new directory)."""
    from prme.schemas.errors import ConfigurationError

    if not _has_log(settings):
        raise ConfigurationError(f"no PRME log in {settings.data_dir}")


def _has_log(settings: Settings) -> bool:
    """The log exists: Kafka's is the broker's to say; the embedded one is a file."""
    from prme.producers.factory import LOCAL_LOG_FILE

    return settings.log.transport != "local" or (settings.data_path / LOCAL_LOG_FILE).exists()


def _require_shards(settings: Settings) -> None:
    """``prme rebuild`` on Kafka rebuilds what a stopped node's directory holds."""
    from prme.projectors.runner import existing_shards
    from prme.schemas.errors import ConfigurationError

    if not existing_shards(settings.data_path):
        raise ConfigurationError(
            f"{settings.data_dir} holds no partition's read models: on Kafka, prme rebuild "
            "rebuilds the partitions a stopped node's data directory holds (shards/p<N>); "
            "the others are restored by the nodes the group gives them to"
        )


def _port(text: str) -> int:
    """``--metrics-port``: a port as the settings' ports are checked (``--port`` is one)."""
    from prme.schemas.config import Port

    try:
        return msgspec.convert(int(text), Port)
    except (ValueError, msgspec.ValidationError) as error:
        raise argparse.ArgumentTypeError(f"a port (0 to 65535), not {text!r}") from error


def _owner(text: str) -> str:
    """``--owner`` of ``prme audit``: any owner a record may hold (as erasure takes one:
    ids an earlier version stored with an invisible character, or named ``*``, included)."""
    from prme.query.http_types import check_erasable
    from prme.schemas.errors import InvalidInput

    try:
        check_erasable(text)
    except InvalidInput:
        raise argparse.ArgumentTypeError(
            f"an owner id (1 to 256 characters, no control characters, no whitespace at "
            f"either end), not {text!r}"
        ) from None
    return text


def _seconds(text: str) -> float:
    """``--timeout``: more than 0 seconds and at most a day, as the settings' timeouts."""
    from prme.schemas.config import Seconds

    try:
        return msgspec.convert(float(text), Seconds)
    except (ValueError, msgspec.ValidationError):
        raise argparse.ArgumentTypeError(
            f"a number of seconds above 0 (at most 86400), not {text!r}"
        ) from None


def _positive(text: str) -> int:
    """``--processes``, ``--workers``: a count of at least 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, not {text!r}")
    return count


def _ingest_batch_size(text: str) -> int:
    from prme.producers.ingest import check_batch_size
    from prme.schemas.errors import InvalidInput

    try:
        size = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of lines, not {text!r}") from None
    try:
        check_batch_size(size)
    except InvalidInput as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return size


async def _ingest(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prme.producers.factory import open_key_store, open_transport
    from prme.producers.free_space import append_room
    from prme.producers.ingest import INGEST_BATCH, ingest_lines
    from prme.producers.ingest_build import BUILD_CHUNK, builder_process
    from prme.producers.producer import Producer
    from prme.query.pack_config import check_pack_directory
    from prme.schemas.errors import RequestIdConflict, ShardUnavailable

    settings = _settings(args)
    if settings.log.transport == "local":  # (on Kafka the log and keys are topics)
        check_pack_directory(settings.data_path)  # (before reading a file that may be large)
    total = None if args.file == "-" else sum(1 for _ in _read_lines(args.file))
    if not args.quiet and not _has_log(settings):  # a typo in --data-dir starts a new pack
        print(f"prme ingest: no PRME log in {settings.data_dir}: creating one", file=sys.stderr)
    # Large inputs are built in a worker process while this one sends (forked before the
    # transport starts any thread); a small file is not worth the process.
    large = total is None or total > 2 * BUILD_CHUNK
    builder = builder_process() if large else None
    transport = open_transport(settings)
    keys = open_key_store(settings) if settings.log.seal_records else None
    await transport.start()
    try:
        if keys is not None:
            await keys.start()
        landed = 0

        def progress(count: int) -> None:
            nonlocal landed
            landed += count
            bar.update(count)

        with tqdm(total=total, unit="rec", disable=args.quiet, file=sys.stderr) as bar:
            try:
                summary = await ingest_lines(
                    _read_lines(args.file),
                    Producer(transport, settings.limits, keys=keys, room=append_room(settings)),
                    on_error=args.on_error,
                    batch_size=args.batch_size or INGEST_BATCH,
                    progress=progress,
                    builder=builder,
                )
            except RequestIdConflict as conflict:  # the append of its chunk wrote nothing
                bar.close()
                print(
                    f"prme ingest: {args.file}: {conflict} (from the chunk holding that line); "
                    f"{landed} records of the file were written",
                    file=sys.stderr,
                )
                return 1
            except ShardUnavailable as refused:  # (a nearly full disk) nothing of the chunk
                bar.close()
                print(
                    f"prme ingest: {refused}; {landed} records of the file were written, in "
                    "its order from the first line",
                    file=sys.stderr,
                )
                return 1
            except asyncio.CancelledError:  # Ctrl-C; the appends in flight have landed
                bar.close()
                print(
                    f"{args.file}: {landed} records written, in the file's order from its "
                    "first line (a rerun writes them again, but applies a line with a "
                    "request_id once)",
                    file=sys.stderr,
                )
                raise
    finally:
        if keys is not None:
            await keys.close()
        await transport.close()
        if builder is not None:
            builder.shutdown(cancel_futures=True)
    for error in summary.errors:
        print(f"{args.file}:{error.line}: {error.error}", file=sys.stderr)
    if summary.stopped_at is not None:
        print(
            f"{args.file}: stopped at line {summary.stopped_at}: the lines before it are "
            "written, none from it on (--on-error skip passes over bad lines; a rerun of the "
            "whole file writes the lines before it again, applying once only those with a "
            f"request_id: rerun from the line, tail -n +{summary.stopped_at} {args.file})",
            file=sys.stderr,
        )
    print(
        msgspec.json.encode(
            {k: v for k, v in msgspec.structs.asdict(summary).items() if k != "errors"}
        ).decode()
    )
    if summary.errors and args.on_error == "stop":
        return 1
    return 0


async def _audit(args: argparse.Namespace) -> int:
    from prme.producers.audit import audit_owner
    from prme.producers.factory import open_key_store, open_transport

    settings = _settings(args)
    _require_log(settings)
    transport, keys = open_transport(settings), open_key_store(settings)
    await transport.start()
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        await keys.start()
        async for row in audit_owner(transport, args.owner, keys=keys):
            out.write(encoder.encode(row) + b"\n")
    except BrokenPipeError:
        return 0
    finally:
        await keys.close()
        await transport.close()
        out.flush()
    return 0


async def _erase(args: argparse.Namespace) -> int:
    """Erase one owner through a running service (``--url``) or in a stopped pack."""
    from prme.producers.audit import owner_on_log
    from prme.query.client import AsyncMemoryClient
    from prme.query.engine import MemoryEngine
    from prme.query.http_types import check_erasable, node_urls
    from prme.schemas.errors import ConfigurationError, InvalidInput, PRMEError

    try:
        check_erasable(args.owner)
        if args.owner == "*":
            raise InvalidInput(
                "`*` stands for every owner in API keys: erase owners one at a time (an owner "
                "an earlier version stored as `*`: MemoryEngine.erase_owner('*'))"
            )
    except InvalidInput as error:
        print(f"prme erase: --owner: {error}", file=sys.stderr)
        return 2
    settings = _settings(args)
    backend: AsyncMemoryClient | MemoryEngine
    if args.url is not None:
        if args.data_dir is not None:
            raise ConfigurationError("give --url (a running prme serve) or --data-dir, not both")
        node_urls(args.url)  # a careless URL: one line, exit 2
    else:
        _require_log(settings)  # a mistyped --data-dir is no pack to erase from
    try:
        if args.url is not None:
            backend = AsyncMemoryClient(url=args.url, api_key=args.api_key or settings.api_key)
        else:  # an engine of its own: it never embeds a query
            backend = await MemoryEngine.open(
                settings=settings, create_if_missing=True, serves_queries=False
            )
        async with backend:
            known = (
                None
                if isinstance(backend, AsyncMemoryClient)
                else await owner_on_log(backend.runner.transport, args.owner)
            )
            result = await backend.erase_owner(args.owner, wait=not args.no_wait)
    except ConfigurationError:
        raise
    except PRMEError as error:
        print(f"prme erase: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(msgspec.json.encode(result).decode())
    if known is False:  # erased all the same: a request about someone who never wrote
        print(
            f"prme erase: no record of owner {args.owner!r} was on the log (owner ids match "
            "exactly, case included): only the erasure's marker was appended",
            file=sys.stderr,
        )
    return 0


def _models_pull(args: argparse.Namespace) -> int:
    from prme.projectors.embeddings.model_assets import ModelAssetError, ensure_default_model
    from prme.projectors.embeddings.query_model import ensure_query_model, int8_queries

    settings = _settings(args)
    directory = Path(args.models_dir) if args.models_dir else settings.models_path
    try:
        model_dir = ensure_default_model(directory)
        print(model_dir)
        if int8_queries(settings.embedding.query_precision):
            print(ensure_query_model(model_dir))
    except (OSError, ModelAssetError) as error:
        print(f"prme models pull: {error}", file=sys.stderr)
        return 1
    return 0


def _serve(args: argparse.Namespace) -> int:
    from prme.logs import configure
    from prme.query.serve import run_server

    configure(args.log_format, getattr(logging, args.log_level.upper()), "prme serve")
    settings = _serve_settings(args)
    if args.processes > 1:
        from prme.query.processes import serve_processes

        return serve_processes(settings, args.processes, _child_options(args))
    try:
        # A --processes child's URL is a socket its parent bound for it: nothing to check,
        # and probing would turn away the requests queued there while it restarted.
        asyncio.run(
            run_server(
                settings,
                log_level=args.log_level,
                sockets=_inherited(args),
                check_url=args.listen_fd is None,
            )
        )
    except KeyboardInterrupt:
        return 0
    return 0


def _serve_settings(args: argparse.Namespace) -> Settings:
    settings = _settings(args)
    service: dict[str, Any] = {}
    if args.host:
        service["host"] = args.host
    if args.port is not None:
        service["port"] = args.port
    cluster: dict[str, Any] = {}
    if args.advertised_url:
        cluster["advertised_url"] = args.advertised_url
    if args.no_project:
        cluster["project"] = False
    if args.standby_replicas is not None:
        cluster["standby_replicas"] = args.standby_replicas
    if args.static_members:
        cluster["static_members"] = args.static_members.split(",")
    changes = {k: v for k, v in (("service", service), ("cluster", cluster)) if v}
    return settings.replace(**changes) if changes else settings


def _child_options(args: argparse.Namespace) -> list[str]:
    """The options a ``--processes`` child repeats (its own port and URL are added)."""
    options = ["--log-format", args.log_format, "--log-level", args.log_level]
    for option in ("data_dir", "transport", "bootstrap", "standby_replicas"):
        if getattr(args, option, None) is not None:
            options += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    return options


def _inherited(args: argparse.Namespace) -> list[Any] | None:
    """The shared listening socket a ``--processes`` parent handed this child."""
    import socket

    if args.listen_fd is None:
        return None
    return [socket.socket(fileno=int(fd)) for fd in args.listen_fd.split(",")]


def _mcp(args: argparse.Namespace) -> int:
    from prme.schemas.errors import ConfigurationError, DataDirInUse, PRMEError, ShardUnavailable

    settings = _settings(args)
    mcp: dict[str, Any] = {}
    for option in ("user_id", "url", "host", "port", "path"):
        if getattr(args, option) is not None:
            mcp[option] = getattr(args, option)
    if mcp:
        settings = settings.replace(mcp=mcp)
    try:
        if settings.mcp.url and args.data_dir:
            raise ConfigurationError("give --url (a running prme serve) or --data-dir, not both")
        from prme.adapters import mcp_server

        if args.http:
            serve = mcp_server.serve_http(
                settings, log_level=args.log_level, on_ready=mcp_server.announce
            )
            asyncio.run(serve)
        else:
            asyncio.run(mcp_server.serve_stdio(settings))
    except PRMEError as error:
        # Raised while starting (tool calls answer their own errors): a pack held by
        # another process, a service that refuses the key, bad settings.
        print(f"prme mcp: {error}", file=sys.stderr)
        if isinstance(error, (ShardUnavailable, DataDirInUse)) and not settings.mcp.url:
            print(
                "prme mcp: a pack is opened by one process; to share it, run `prme serve` "
                "on it and start `prme mcp --url http://127.0.0.1:8765` (docs/MCP.md)",
                file=sys.stderr,
            )
        return 2
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in ("mcp", "mcp_types"):
            raise
        print('prme mcp: the MCP SDK is missing: pip install "prme-memory[mcp]"', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


async def _project(settings: Settings, metrics_port: int | None = None) -> str | None:
    """Project until SIGINT/SIGTERM; why the projector stopped when it failed (the worker
    then exits 1 for its supervisor to see, instead of idling out of the group)."""
    from prometheus_client import start_http_server

    from prme.producers.factory import open_dead_letters, open_transport
    from prme.projectors.runner import ProjectorRunner
    from prme.projectors.status import (
        partition_statuses,
        projector_failure,
        read_log_ends,
        record_statuses,
    )
    from prme.query.data_lock import DataDirLock
    from prme.query.engine import default_provider
    from prme.query.pack_config import check_pack_directory
    from prme.schemas.metrics import Metrics
    from prme.schemas.tracing import Tracing

    check_pack_directory(settings.data_path)
    lock = DataDirLock.acquire(settings.data_path)
    transport, dead_letters = open_transport(settings), open_dead_letters(settings)
    await transport.start()
    await dead_letters.start()
    metrics = Metrics(
        enabled=metrics_port is not None and settings.metrics.enabled,
        tracing=Tracing.create(settings.tracing.enabled),
    )
    runner = ProjectorRunner(
        settings,
        transport,
        default_provider(settings),
        dead_letters=dead_letters,
        metrics=metrics,
        group=settings.cluster.group,
        own_data_dir=lock.held,  # False for --workers: they share one directory
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    server = None

    async def run_until_stopped() -> None:
        # The scrape runs on the exporter's thread: the lag is refreshed here, meanwhile.
        while not stop.is_set() and runner.failure is None:
            if metrics_port is not None:
                with contextlib.suppress(Exception):
                    ends = await read_log_ends(runner)  # unreachable: the last ends, stale
                    record_statuses(metrics, await partition_statuses(runner, ends=ends), ends)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), LAG_REFRESH_S)

    try:
        if metrics_port is not None:  # up before joining the group: a join can take seconds
            server, _ = start_http_server(metrics_port, "127.0.0.1", metrics.registry)
            print(f"metrics on http://127.0.0.1:{metrics_port}/metrics", file=sys.stderr)
        await runner.start()
        print(f"projecting {sorted(runner.shards)} into {settings.data_dir}", file=sys.stderr)
        await run_until_stopped()
        return None if runner.failure is None else projector_failure(runner)
    finally:
        if server is not None:
            server.shutdown()
        await runner.close()
        await dead_letters.close()
        await transport.close()
        lock.release()


def _project_command(args: argparse.Namespace) -> int:
    from prme.logs import configure
    from prme.query.data_lock import DataDirLock
    from prme.query.processes import supervise
    from prme.schemas.errors import DataDirInUse

    configure(args.log_format, tag=f"prme project[{os.getpid()}]")
    settings = _settings(args)
    if args.workers <= 1:
        try:
            failure = asyncio.run(_project(settings, args.metrics_port))
        except DataDirInUse as error:
            print(f"prme project: {error}", file=sys.stderr)
            return 2
        if failure is not None:
            print(f"prme project: {failure}", file=sys.stderr)
            return 1
        return 0
    if settings.log.transport != "kafka":
        print(
            "prme project: --workers > 1 needs the kafka transport (the consumer group splits "
            "partitions); the local log is projected by one process",
            file=sys.stderr,
        )
        return 2
    from prme.query.pack_config import check_pack_directory

    try:
        check_pack_directory(settings.data_path)  # (the lock file would make it look a pack)
        lock = DataDirLock.acquire(settings.data_path)  # the workers share it with us
    except DataDirInUse as error:
        print(f"prme project: {error}", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "prme.cli", "project", "--workers", "1"]
    command += ["--log-format", args.log_format]
    for option in ("data_dir", "transport", "bootstrap"):
        if getattr(args, option, None):
            command += [f"--{option.replace('_', '-')}", getattr(args, option)]
    ports = [
        None if args.metrics_port is None else args.metrics_port + i for i in range(args.workers)
    ]

    def start(index: int) -> subprocess.Popen[bytes]:
        port = ports[index]
        return subprocess.Popen(
            command + ([] if port is None else ["--metrics-port", str(port)]),
            env=lock.child_environment(),
            pass_fds=lock.child_fds(),
        )

    try:
        return supervise(start, args.workers)
    finally:
        lock.release()


async def _rebuild(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prme.logs import configure
    from prme.query.engine import MemoryEngine

    # The runner's per-partition lines are a server's; --quiet keeps warnings and errors.
    configure(args.log_format, logging.WARNING if args.quiet else logging.INFO, "prme rebuild")
    models = MODEL_NAMES if args.model == "all" else (args.model,)
    # A directory holding only an ingested log is a pack whose read models are all missing.
    settings = _settings(args)
    _require_log(settings)  # a mistyped --data-dir is no pack to rebuild
    on_kafka = settings.log.transport == "kafka"
    if on_kafka:  # the node is stopped: its partitions, read from the log, outside the group
        _require_shards(settings)
        settings = settings.replace(cluster={"project": False})
    async with await MemoryEngine.open(
        settings=settings, create_if_missing=True, serves_queries=False
    ) as engine:
        if on_kafka:
            await engine.runner.hold_stored()
        cache = engine.runner.vector_cache
        hits, misses = cache.hits, cache.misses
        ends = await engine.runner.transport.end_offsets()
        total = sum(ends.get(partition, 0) for partition in engine.runner.shards)
        # tqdm shows the rate (rec/s) next to the count; the bar goes to stderr, which
        # carries one JSON object per line under --log-format json, so no bar then.
        hidden = args.quiet or args.log_format == "json"
        with tqdm(total=total, unit="rec", disable=hidden, file=sys.stderr) as bar:
            replayed = await engine.rebuild(models, progress=bar.update, processes=args.processes)
        # A durable-cache miss is a text the embedding model encoded for this rebuild.
        vectors = {"from_cache": cache.hits - hits, "encoded": cache.misses - misses}
    report = {"models": list(models), "replayed": replayed, "vectors": vectors}
    print(msgspec.json.encode(report).decode())
    return 0


def _status(args: argparse.Namespace) -> int:
    import httpx

    from prme.query.http_types import node_urls
    from prme.schemas.errors import ConfigurationError

    settings = _settings(args)
    host = settings.service.host
    served = f"http://{f'[{host}]' if ':' in host else host}:{settings.service.port}"
    try:
        (url,) = node_urls(args.url or served)
    except ConfigurationError as error:
        given = "--url" if args.url else "PRME_SERVICE__HOST / PRME_SERVICE__PORT"
        print(f"prme status: {given}: {error}", file=sys.stderr)
        return 2
    key = args.api_key or settings.api_key  # PRME_API_KEY keeps it off the command line
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{url}/v1/status", headers=headers, timeout=args.timeout)
    except httpx.HTTPError as error:
        print(
            f"prme status: no PRME service answers at {url} ({error}); status reports what a "
            "running `prme serve` projects: start one, or pass --url",
            file=sys.stderr,
        )
        return 1
    try:
        status = response.json()
    except ValueError:
        status = None
    if not isinstance(status, dict):  # an HTML page was printed whole
        print(
            f"prme status: {url} answered {response.status_code} with no PRME status: is it "
            "a PRME service? (--url)",
            file=sys.stderr,
        )
        return 1
    if response.status_code != 200:
        detail = status.get("detail", response.text)
        print(f"prme status: {url} answered {response.status_code}: {detail}", file=sys.stderr)
        return 1
    if args.json:
        print(response.text)
    else:
        print(render_status(status))
    # A member the group refused is a misconfigured cluster, a projector that stopped (its
    # node left the group) a broken node, and a partition without a live owner serving it
    # (a node killed, a rebalance, a restore) a cluster that does not answer every owner:
    # a health check should say so. (A service from before ``cluster`` cannot tell.)
    cluster = status.get("cluster")
    failing = (
        status.get("refused")
        or status.get("duplicates")
        or status.get("other_topic")
        or status.get("failure")
        or status.get("log_unavailable")  # (as /v1/ready: 503 then)
        or (cluster is not None and not cluster.get("healthy"))
    )
    return 1 if failing else 0


def render_status(status: dict[str, Any]) -> str:
    """The text form of ``prme status``: one line per partition, then the group."""
    embedding = status["embedding"]
    failure = status.get("failure")
    lines = [f"FAILED: {failure}"] if failure else []
    if unavailable := status.get("log_unavailable"):
        age = status.get("log_end_age_s")
        known = "never read" if age is None else f"as read {age:.0f}s ago"
        lines.append(f"LOG UNAVAILABLE: {unavailable}; log ends and lag below are {known}")
    cluster = status.get("cluster")
    if cluster is not None:
        lines += [f"DEGRADED: {problem}" for problem in cluster.get("problems") or []]
        if cluster.get("healthy"):
            served = len(cluster.get("partitions") or [])
            lines.append(f"cluster: all {served} partitions have a live owner serving them")
    lines += [
        f"transport {status['transport']}  "
        + (f"group {status['group']}  " if status["transport"] == "kafka" else "")
        + f"lag {status['lag_records']} records  dead letters {status['dead_letters']}",
        f"embedding {embedding['model_name']} {embedding['model_version']} "
        f"dim {embedding['dimension']}"
        + (f"  queries {precision}" if (precision := embedding.get("query_precision")) else "")
        + (
            f"  MISMATCH in partitions {embedding['mismatched_partitions']}"
            if embedding["mismatched_partitions"]
            else ""
        ),
        f"{'partition':>9} {'log end':>9} {'applied':>9} {'lag':>7} {'lag s':>7} "
        f"{'dead':>5} {'size MiB':>9}",
    ]
    if legacy := status.get("lexical_legacy_partitions"):
        lines.insert(
            len(lines) - 1,
            f"lexical: earlier terms (no accent folding, a CJK run one word) in partitions "
            f"{legacy}: prme rebuild --model lexical",
        )
    for p in status["partitions"]:
        size = sum(p["size_bytes"].values()) / 2**20
        lines.append(
            f"{p['partition']:>9} {p['log_end']:>9} {p['applied_offset']:>9} "
            f"{p['lag_records']:>7} {p['lag_seconds']:>7.1f} {p['dead_letters']:>5} {size:>9.2f}"
        )
    for member in status.get("group_members") or []:
        who = member.get("url") or member["client_id"]
        lines.append(f"member {who} at {member['host']}: partitions {member['partitions']}")
    for url in status.get("refused") or []:
        lines.append(f"REFUSED {url}: no partitions, {SECRET_REFUSED}")
    for url in status.get("duplicates") or []:
        lines.append(f"REFUSED a second node at {url}: no partitions, {DUPLICATE_URL}")
    for member in status.get("other_topic") or []:
        lines.append(
            f"REFUSED {member['url'] or 'a worker'}: no partitions, it reads the topic "
            f"{member['topic']!r}, the group reads {status.get('topic')!r} (PRME_LOG__TOPIC "
            "must be the same on every node of a group)"
        )
    return "\n".join(lines)


DESCRIPTION = """\
PRME: long-term memory for LLM agents, event-sourced on a log (Kafka or an embedded
SQLite log). Every command reads its configuration from PRME_* variables; the options
below override them. See README.md and docs/OPERATIONS.md."""

INGEST_FORMAT = """\
line format (JSON lines, one message per line):
  {"owner": "alice", "content": "Aurora needs approval.", "session": "planning",
   "role": "user", "time": "2023-05-08T13:56:00Z", "metadata": {"source": "import"}}

  owner       required: the owner id (the log key)
  content     required: a string, or a list of content blocks
  session     chat session id (default "default")
  role        user | assistant | system | tool | function | developer
              (default "user")
  scope       memory scope (default "default")
  name        speaker name
  time        when it happened (RFC 3339; default: unknown)
  metadata    a JSON object kept with the record
  request_id  idempotency key: a line ingested again with the same owner and
              request_id is applied once (on Kafka a second run appends it again,
              as the same event, which the read models apply once)
Unknown fields are refused. '-' reads standard input."""


def build_parser() -> argparse.ArgumentParser:
    from prme import __version__
    from prme.projectors.rebuild_worker import default_processes

    parser = argparse.ArgumentParser(prog="prme", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"prme {__version__} (prme-memory)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ingest = commands.add_parser(
        "ingest",
        help="append messages from a JSONL file to the log",
        description="Append messages from a JSONL file to the log, with progress.",
        epilog=INGEST_FORMAT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ingest.add_argument("file", help="JSONL file, one message per line ('-' for stdin)")
    ingest.add_argument(
        "--on-error",
        choices=["skip", "stop"],
        default="stop",
        help="at a bad line: stop (default; the lines before it are written, none from it "
        "on) or skip it and go on; exit status 1 when it stopped",
    )
    ingest.add_argument(
        "--batch-size",
        type=_ingest_batch_size,
        default=None,
        help="lines per append, 1 to 20000 (default 5000)",
    )
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_log_options(ingest)
    ingest.set_defaults(run=lambda a: asyncio.run(_ingest(a)))

    audit = commands.add_parser("audit", help="print every raw record of an owner (JSON lines)")
    audit.add_argument("--owner", required=True, type=_owner, help="the owner id")
    _add_log_options(audit)
    audit.set_defaults(run=lambda a: asyncio.run(_audit(a)))

    erase = commands.add_parser(
        "erase",
        help="erase an owner: every read model forgets it, its data keys are deleted "
        "(docs/OPERATIONS.md)",
        description="Erase one owner, as DELETE /v1/owners does: through a running `prme "
        "serve` (--url; on Kafka any node of the cluster) or in a stopped pack (--data-dir). "
        "Prints the erasure's StoreResult (JSON); with --no-wait it does not wait until the "
        "read models' files are purged. Exit 0 once erased; 1 if the service refuses; 2 "
        "for a careless argument.",
    )
    erase.add_argument("--owner", required=True, help="the owner id")
    erase.add_argument("--url", help="a running service (on Kafka, any node)")
    erase.add_argument(
        "--api-key",
        help="with --url: the owner's key or an admin key; PRME_API_KEY does the same "
        "without showing the key in ps",
    )
    erase.add_argument("--no-wait", action="store_true", help="do not wait for the purge")
    _add_log_options(erase)
    erase.set_defaults(run=lambda a: asyncio.run(_erase(a)))

    models = commands.add_parser("models", help="manage embedding models")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pull = models_commands.add_parser(
        "pull",
        help="assemble the default model offline, and its int8 query copy where queries use it",
    )
    pull.add_argument("--models-dir", help="default ~/.cache/prme/models (PRME_MODELS_DIR)")
    pull.set_defaults(run=_models_pull)

    project = commands.add_parser("project", help="run projector workers until interrupted")
    project.add_argument(
        "--workers", type=_positive, default=1, help="processes in the consumer group"
    )
    project.add_argument(
        "--metrics-port",
        type=_port,
        help="serve Prometheus metrics on 127.0.0.1:PORT/metrics (worker i: PORT+i)",
    )
    _add_log_options(project)
    _add_log_format(project)
    project.set_defaults(run=_project_command)

    rebuild = commands.add_parser(
        "rebuild", help="replay the log into fresh read models and swap them in (blue/green)"
    )
    rebuild.add_argument("--model", choices=["all", *MODEL_NAMES], default="all")
    rebuild.add_argument(
        "--processes",
        type=_positive,
        default=default_processes(),
        help="replay in up to this many worker processes (default: the cores, at most 4; 1, "
        "or a pack under 10,000 records, replays in this process)",
    )
    rebuild.add_argument(
        "--quiet", action="store_true", help="no progress bar, and no log line below warnings"
    )
    _add_log_options(rebuild)
    _add_log_format(rebuild)
    rebuild.set_defaults(run=lambda a: asyncio.run(_rebuild(a)))

    serve = commands.add_parser("serve", help="run the HTTP service (docs/HTTP.md)")
    serve.add_argument("--host", help="bind address (PRME_SERVICE__HOST, default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (PRME_SERVICE__PORT, default 8765)")
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.add_argument(
        "--advertised-url",
        help="the URL other nodes and clients reach this node at (PRME_CLUSTER__ADVERTISED_URL;"
        " default http://HOST:PORT)",
    )
    serve.add_argument(
        "--no-project",
        action="store_true",
        help="serve-only: append writes and route every read to the partition's owner "
        "(PRME_CLUSTER__PROJECT=false)",
    )
    serve.add_argument(
        "--processes",
        type=_positive,
        default=1,
        help="N member processes behind this one port, splitting the partitions (on the "
        "embedded log: process i owns partitions p mod N == i)",
    )
    serve.add_argument(
        "--standby-replicas",
        type=int,
        help="warm copies of each partition kept on other nodes (PRME_CLUSTER__STANDBY_REPLICAS)",
    )
    serve.add_argument("--listen-fd", help=argparse.SUPPRESS)
    serve.add_argument("--static-members", help=argparse.SUPPRESS)
    _add_log_options(serve)
    _add_log_format(serve)
    serve.set_defaults(run=_serve)

    status = commands.add_parser(
        "status",
        help="what a running service projects: partitions, offsets, lag, sizes, group",
        description="Ask a running `prme serve` (GET /v1/status) which partitions it projects, "
        "each one's log end, applied offset, lag and size on disk, its dead letters, its "
        "embedding identity and, on Kafka, the consumer group's members; and whether every "
        "partition of the topic has a live owner serving it. Exit status 0: healthy; 1: no "
        "service answers, a partition lacks a live, caught-up owner (DEGRADED lines: "
        "unowned, an owner that does not answer, a rebalance, a restore), the group refused "
        "a node (REFUSED lines), the log does not answer (LOG UNAVAILABLE) or the node's "
        "projector stopped (a FAILED line).",
    )
    status.add_argument("--json", action="store_true", help="print the JSON document")
    status.add_argument(
        "--url", help="the service (default http://PRME_SERVICE__HOST:PRME_SERVICE__PORT)"
    )
    status.add_argument(
        "--api-key",
        help="sent as a bearer token, if the service wants one; PRME_API_KEY does the same "
        "without showing the key in ps",
    )
    status.add_argument("--timeout", type=_seconds, default=30.0, help="seconds (default 30)")
    status.set_defaults(run=_status)

    mcp = commands.add_parser(
        "mcp", help="run an MCP server: stdio, or streamable HTTP with --http (docs/MCP.md)"
    )
    mcp.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    mcp.add_argument("--user-id", help="the one owner this server acts for (PRME_MCP__USER_ID)")
    mcp.add_argument(
        "--url", help="front a running prme serve (PRME_MCP__URL; key: PRME_MCP__API_KEY)"
    )
    mcp.add_argument("--host", help="--http bind address (PRME_MCP__HOST, default 127.0.0.1)")
    mcp.add_argument("--port", type=int, help="--http port (PRME_MCP__PORT, default 8766; 0: any)")
    mcp.add_argument("--path", help="--http endpoint path (PRME_MCP__PATH, default /mcp)")
    mcp.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    _add_log_options(mcp)
    mcp.set_defaults(run=_mcp)
    return parser


def main(argv: list[str] | None = None) -> int:
    from prme.schemas.errors import ConfigurationError, PRMEError

    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ConfigurationError as error:  # bad settings, a held data dir: one line, no traceback
        print(f"prme {args.command}: {error}", file=sys.stderr)
        return 2
    except PRMEError as error:  # the log cannot be reached (a wrong --bootstrap), a shard held
        print(f"prme {args.command}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"prme {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
