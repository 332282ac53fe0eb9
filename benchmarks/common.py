"""Shared helpers of the benchmark commands: timing summaries, synthetic chat text, JSON
output, and a Kafka broker started with ``deploy/kafka/kafka.sh`` for the length of a run."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[1]
KAFKA_SCRIPT = REPO_ROOT / "deploy" / "kafka" / "kafka.sh"

SPEAKERS = ("Caroline", "Melanie", "Jon", "Gina", "Priya", "Tomas", "Aiko", "Lars")
_VOCABULARY_TEXT = (
    "the project deadline moved to friday because the client asked for another review of "
    "budget numbers and marketing plan while caroline joined a support group melanie "
    "painted sunrise over lake after long week at work team shipped new release with "
    "faster search better memory lower latency during busy morning meeting about hiring "
    "two engineers next quarter and travel plans for conference in berlin adoption agency "
    "pottery class camping trip with kids guitar lessons charity race violin concert "
    "garden tomatoes birthday dinner new puppy named oscar hiking trail near the river"
)
VOCABULARY = tuple(_VOCABULARY_TEXT.split())


class LatencySummary(msgspec.Struct, frozen=True):
    """Percentiles of latency samples, in milliseconds."""

    samples: int
    p50_ms: float
    p95_ms: float
    mean_ms: float
    max_ms: float


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0..1) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("no samples")
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_summary(samples_s: Sequence[float]) -> LatencySummary:
    """p50/p95/mean/max of samples given in seconds, reported in milliseconds."""
    milliseconds = [sample * 1000.0 for sample in samples_s]
    return LatencySummary(
        samples=len(milliseconds),
        p50_ms=round(percentile(milliseconds, 0.50), 3),
        p95_ms=round(percentile(milliseconds, 0.95), 3),
        mean_ms=round(statistics.fmean(milliseconds), 3),
        max_ms=round(max(milliseconds), 3),
    )


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 else None


def chat_turn(rng: random.Random, words: int = 30) -> str:
    """A synthetic chat turn prefixed with its speaker (``"Caroline: ..."``)."""
    speaker = rng.choice(SPEAKERS)
    body = " ".join(rng.choices(VOCABULARY, k=words))
    return f"{speaker}: {body.capitalize()} #{rng.getrandbits(32):08x}."


def question(rng: random.Random, words: int = 6) -> str:
    """A short synthetic query naming a speaker."""
    return f"what did {rng.choice(SPEAKERS)} say about " + " ".join(
        rng.choices(VOCABULARY, k=words)
    )


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def process_tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) spent so far by process ``pid`` and its descendants
    (Linux ``/proc``): the live ones' own, and the reaped ones' as their parents' children
    time; one that exits between two reads is skipped."""
    ticks = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text()
            fields = stat.rsplit(")", 1)[1].split()  # from field 3 (state) on
            ticks += sum(int(field) for field in fields[11:15])  # utime stime cutime cstime
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return ticks / os.sysconf("SC_CLK_TCK")


def emit(report: dict[str, Any], out: Path | None) -> None:
    """Print ``report`` as JSON on stdout, and write it to ``out`` when given."""
    text = json.dumps(report, indent=2, default=msgspec.to_builtins)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    parser.add_argument(
        "--work-dir", type=Path, help="scratch directory (default: a temporary directory)"
    )


def add_workload_options(
    parser: argparse.ArgumentParser,
    *,
    messages: int,
    owners: int,
    partitions: int,
    messages_help: str | None = None,
) -> None:
    """``--messages``, ``--owners``, ``--partitions`` and ``--runs`` (default 3)."""
    parser.add_argument("--messages", type=int, default=messages, help=messages_help)
    parser.add_argument("--owners", type=int, default=owners)
    parser.add_argument("--partitions", type=int, default=partitions)
    parser.add_argument("--runs", type=int, default=3)


def add_broker_options(parser: argparse.ArgumentParser, *, local_only: bool = True) -> None:
    """``--bootstrap`` (a running broker) and, where the benchmark can skip Kafka, ``--no-kafka``."""
    parser.add_argument("--bootstrap", help="use this broker instead of starting one")
    if local_only:
        parser.add_argument("--no-kafka", dest="kafka", action="store_false", help="local log only")


Measure = Callable[[argparse.Namespace, Path], Awaitable[dict[str, Any]]]


def run_benchmark(
    parser: argparse.ArgumentParser, measure: Measure, argv: list[str] | None
) -> None:
    """The main of every benchmark: add ``--out``/``--work-dir``, parse ``argv``, run
    ``measure`` in the scratch directory, and emit its report as JSON."""
    add_common_options(parser)
    arguments = parser.parse_args(argv)
    with scratch_directory(arguments.work_dir) as work:
        report = asyncio.run(measure(arguments, work))
    emit(report, arguments.out)


@contextmanager
def scratch_directory(work_dir: Path | None) -> Iterator[Path]:
    """``work_dir`` when given (kept afterwards), else a temporary directory (removed)."""
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)
        yield work_dir
        return
    with tempfile.TemporaryDirectory(prefix="prme-bench-") as directory:
        yield Path(directory)


def run_kafka_script(
    *args: str, timeout_s: float, env_defaults: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``deploy/kafka/kafka.sh`` with this interpreter as ``PRME_PYTHON``;
    ``env_defaults`` are variables the caller's environment may override. Shared with the
    test fixtures."""
    env = {**(env_defaults or {}), **os.environ, "PRME_PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(KAFKA_SCRIPT), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def _kafka_script(*args: str, timeout_s: float) -> str:
    result = run_kafka_script(*args, timeout_s=timeout_s)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.splitlines()[-20:])
        raise RuntimeError(f"kafka.sh {args[0]} failed (exit {result.returncode}):\n{tail}")
    return result.stdout.strip()


@contextmanager
def kafka_broker(bootstrap: str | None, data_dir: Path) -> Iterator[str]:
    """``bootstrap`` when given; else a broker started under ``data_dir`` and stopped after."""
    if bootstrap:
        yield bootstrap
        return
    _kafka_script("fetch", timeout_s=600)
    started = _kafka_script("start", str(data_dir), timeout_s=240)
    try:
        yield started.splitlines()[-1]
    finally:
        _kafka_script("stop", str(data_dir), timeout_s=120)
