"""Shared fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import run_kafka_script

# --- Kafka -------------------------------------------------------------------------------
# A real broker for @pytest.mark.kafka tests, in order of preference: PRME_KAFKA_BOOTSTRAP,
# a testcontainers broker when a Docker engine answers, else deploy/kafka/kafka.sh (a
# local KRaft broker from Maven jars). Kafka tests never skip: no broker is a failure.


def _kafka_script(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    # Cluster nodes are small: three JVMs share a 2-core test machine.
    return run_kafka_script(*args, timeout_s=timeout_s, env_defaults={"PRME_KAFKA_HEAP": "512m"})


def _kafka_failure(step: str, result: subprocess.CompletedProcess[str]) -> None:
    tail = "\n".join((result.stderr or "").splitlines()[-40:])
    pytest.fail(f"kafka.sh {step} failed (exit {result.returncode}):\n{tail}", pytrace=False)


@contextmanager
def _kafka_started(root: Path, start: str, *args: str, stop: str = "stop") -> Iterator[str]:
    """``kafka.sh fetch``, then ``START ROOT ARGS``: its bootstrap; ``STOP ROOT`` afterwards
    (also after a start that failed half-way)."""
    fetched = _kafka_script("fetch", timeout_s=600)
    if fetched.returncode != 0:
        _kafka_failure("fetch", fetched)
    started = _kafka_script(start, str(root), *args, timeout_s=240)
    try:
        if started.returncode != 0:
            _kafka_failure(start, started)
        yield started.stdout.strip().splitlines()[-1]
    finally:
        _kafka_script(stop, str(root), timeout_s=120)


def _docker_kafka() -> Iterator[str] | None:
    try:
        from docker.errors import DockerException
        from testcontainers.community.kafka import KafkaContainer
    except ImportError:
        return None
    try:
        container = KafkaContainer().with_kraft()
    except DockerException:
        return None

    def run() -> Iterator[str]:
        with container:
            yield container.get_bootstrap_server()

    return run()


BROKER_FIXTURES = frozenset({"kafka_bootstrap", "kafka_cluster", "private_kafka"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs two pytest-xdist workers (``--dist loadgroup``): every test that
    needs a broker goes to one of them, in the order written, so one broker serves them
    all (a session fixture is per worker) and the multi-node tests never overlap; the other
    worker takes the rest."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.get_closest_marker("kafka") or fixtures & BROKER_FIXTURES:
            item.add_marker(pytest.mark.xdist_group("broker"))


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a running Kafka broker for the whole test session."""
    configured = os.environ.get("PRME_KAFKA_BOOTSTRAP")
    if configured:
        yield configured
        return
    docker = _docker_kafka()
    if docker is not None:
        yield from docker
        return
    with _kafka_started(tmp_path_factory.mktemp("kafka"), "start") as bootstrap:
        yield bootstrap


class KafkaCluster:
    """A running N-broker cluster started by ``kafka.sh cluster-start`` (node ids 1..N)."""

    def __init__(self, root: Path, bootstrap: str, nodes: int) -> None:
        self.root = root
        self.bootstrap = bootstrap
        self.nodes = nodes

    def kill(self, node: int) -> None:
        """SIGKILL broker ``node`` (a crash: no controlled shutdown)."""
        result = _kafka_script("kill", str(self.root / f"b{node}"), timeout_s=60)
        if result.returncode != 0:
            _kafka_failure(f"kill b{node}", result)

    def start(self, node: int) -> None:
        """Start broker ``node`` again and wait until it answers."""
        result = _kafka_script("start", str(self.root / f"b{node}"), timeout_s=180)
        if result.returncode != 0:
            _kafka_failure(f"start b{node}", result)


@pytest.fixture(scope="module")
def kafka_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """A real 3-broker KRaft cluster on loopback ports, one per test module (it costs
    ~15 s to start); stopped afterwards. Topics on it get 3 replicas, min ISR 2."""
    root = tmp_path_factory.mktemp("kafka-cluster")
    with _kafka_started(root, "cluster-start", "3", stop="cluster-stop") as bootstrap:
        yield KafkaCluster(root, bootstrap, 3)


class PrivateBroker:
    """A one-broker Kafka of one test's own (``kafka.sh start``), which it may kill."""

    def __init__(self, data_dir: Path, bootstrap: str) -> None:
        self.data_dir = data_dir
        self.bootstrap = bootstrap

    def kill(self) -> None:
        """SIGKILL the broker (it becomes unreachable, as a crashed one)."""
        result = _kafka_script("kill", str(self.data_dir), timeout_s=60)
        if result.returncode != 0:
            _kafka_failure("kill", result)

    def pause(self) -> None:
        """SIGSTOP the broker: connections stay open and nothing is answered (a broker
        hung in a long GC pause, or behind a network partition), until ``resume``."""
        os.kill(self._pid(), signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self._pid(), signal.SIGCONT)

    def _pid(self) -> int:
        return int((self.data_dir / "kafka.pid").read_text())


@pytest.fixture
def private_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateBroker]:
    """A broker of the test's own, for tests that make the log unreachable (~10-20 s to
    start); stopped afterwards."""
    data_dir = tmp_path_factory.mktemp("private-kafka")
    with _kafka_started(data_dir, "start") as bootstrap:
        yield PrivateBroker(data_dir, bootstrap)


@pytest.fixture
def kafka_topic() -> str:
    """A fresh topic name per test (the transport creates it)."""
    return f"prme-test-{uuid.uuid4().hex[:12]}"


# --- Embedding model -------------------------------------------------------------------
# @pytest.mark.model tests use the real default model, assembled from PyPI wheels into the
# user's models directory (the test command runs `prme models pull` first).


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The assembled default embedding model (all-MiniLM-L6-v2 int8 ONNX) directory."""
    from prme.projectors.embeddings.model_assets import ensure_default_model
    from prme.schemas.config import Settings

    return ensure_default_model(Settings().models_path)


# --- Sample data -------------------------------------------------------------------------


@pytest.fixture
def demo_sample(tmp_path: Path) -> Path:
    """The `make demo` sample (``examples/make_sample.py``'s output) as a JSONL file."""
    root = Path(__file__).resolve().parents[1]
    sample = subprocess.run(
        [sys.executable, str(root / "examples" / "make_sample.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    source = tmp_path / "sample.jsonl"
    source.write_text(sample)
    return source


# --- Clients and services --------------------------------------------------------------


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Any]:
    """A sync ``MemoryClient`` on a fresh embedded pack with the hashed provider."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.sync_client import MemoryClient

    memory = MemoryClient(tmp_path / "memory", embedding_provider=HashedBagOfWordsProvider())
    yield memory
    memory.close()


@pytest.fixture
def service_url(tmp_path: Path) -> Iterator[str]:
    """The base URL of ``prme serve`` on a fresh pack (API key ``SERVICE_KEY``: alice)."""
    from tests.service_harness import running_service

    with running_service(tmp_path / "served") as url:
        yield url


# --- Engines -----------------------------------------------------------------------------


@pytest.fixture
def hashed_provider() -> object:
    """A deterministic bag-of-words provider: fast, and honest about not being semantic."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    return HashedBagOfWordsProvider()


@pytest.fixture
def local_settings(tmp_path: Path) -> object:
    """Settings for an embedded pack in a fresh directory (4 partitions keep tests fast)."""
    from prme.schemas.config import Settings

    return Settings(data_dir=str(tmp_path / "pack")).replace(log={"partitions": 4})


@pytest.fixture
def kafka_settings(tmp_path: Path, kafka_bootstrap: str, kafka_topic: str) -> object:
    """Settings for an engine on the real broker, with a fresh topic."""
    from prme.schemas.config import Settings

    return Settings(data_dir=str(tmp_path / "pack")).replace(
        log={
            "transport": "kafka",
            "bootstrap": kafka_bootstrap,
            "topic": kafka_topic,
            "dlq_topic": kafka_topic + ".dlq",
            "partitions": 4,
        }
    )


@pytest.fixture
async def http(engine: Any) -> AsyncIterator[Any]:
    """An ``httpx.AsyncClient`` on the service app of the module's ``engine`` fixture."""
    import httpx

    from prme.query.service import create_app

    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://prme") as client:
        yield client


@asynccontextmanager
async def keyed_engine(directory: Path, keys: dict[str, str], **changes: Any) -> AsyncIterator[Any]:
    """A new pack in ``directory`` with the hashed provider and API ``keys`` (``changes``:
    more settings, as ``Settings.replace`` takes them)."""
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.engine import MemoryEngine
    from prme.schemas.config import Settings

    settings = Settings().replace(service={"api_keys": keys}, **changes)
    engine = await MemoryEngine.create(
        directory, settings=settings, embedding_provider=HashedBagOfWordsProvider()
    )
    try:
        yield engine
    finally:
        await engine.close()
