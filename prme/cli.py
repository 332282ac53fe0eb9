"""The ``prme`` command line: ingest, audit, models, project, rebuild, serve."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from prme.schemas.config import Settings


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
    return Settings.from_env(**overrides)


def _add_log_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="data directory (PRME_DATA_DIR, default ./memory)")
    parser.add_argument("--transport", choices=["local", "kafka"], help="PRME_LOG__TRANSPORT")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (PRME_LOG__BOOTSTRAP)")


def _read_lines(path: str) -> Iterator[bytes]:
    if path == "-":
        yield from sys.stdin.buffer
        return
    with open(path, "rb") as handle:
        yield from handle


async def _ingest(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from prme.producers.factory import open_transport
    from prme.producers.ingest import ingest_lines
    from prme.producers.producer import Producer

    settings = _settings(args)
    transport = open_transport(settings)
    await transport.start()
    total = None if args.file == "-" else sum(1 for _ in _read_lines(args.file))
    try:
        with tqdm(total=total, unit="rec", disable=args.quiet, file=sys.stderr) as bar:
            summary = await ingest_lines(
                _read_lines(args.file),
                Producer(transport, settings.limits),
                on_error=args.on_error,
                batch_size=args.batch_size,
                progress=bar.update,
            )
    finally:
        await transport.close()
    for error in summary.errors:
        print(f"{args.file}:{error.line}: {error.error}", file=sys.stderr)
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
    from prme.producers.factory import open_transport

    transport = open_transport(_settings(args))
    await transport.start()
    encoder = msgspec.json.Encoder()
    out = sys.stdout.buffer
    try:
        async for row in audit_owner(transport, args.owner):
            out.write(encoder.encode(row) + b"\n")
    except BrokenPipeError:
        return 0
    finally:
        await transport.close()
        out.flush()
    return 0


def _models_pull(args: argparse.Namespace) -> int:
    from prme.projectors.embeddings.model_assets import ensure_default_model

    settings = _settings(args)
    directory = Path(args.models_dir) if args.models_dir else settings.models_path
    print(ensure_default_model(directory))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prme", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    ingest = commands.add_parser("ingest", help="append messages from a JSONL file to the log")
    ingest.add_argument("file", help="JSONL file, one message per line ('-' for stdin)")
    ingest.add_argument("--on-error", choices=["skip", "stop"], default="stop")
    ingest.add_argument("--batch-size", type=int, default=500)
    ingest.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_log_options(ingest)
    ingest.set_defaults(run=lambda a: asyncio.run(_ingest(a)))

    audit = commands.add_parser("audit", help="print every raw record of an owner (JSON lines)")
    audit.add_argument("--owner", required=True)
    _add_log_options(audit)
    audit.set_defaults(run=lambda a: asyncio.run(_audit(a)))

    models = commands.add_parser("models", help="manage embedding models")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    pull = models_commands.add_parser("pull", help="assemble the default model offline")
    pull.add_argument("--models-dir", help="default ~/.cache/prme/models (PRME_MODELS_DIR)")
    pull.set_defaults(run=_models_pull)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
