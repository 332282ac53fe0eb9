"""``prme serve`` over a real socket: uvicorn on 127.0.0.1, the clients in service mode,
and the refusal to serve an open service beyond loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prme import AsyncMemoryClient, MemoryClient
from prme.cli import main
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.embeddings.protocol import EmbeddingProvider
from prme.query.auth import check_bind_safety, is_loopback
from prme.query.serve import run_server
from prme.schemas.config import ServiceSettings, Settings
from prme.schemas.errors import ConfigurationError, Forbidden

from .live_server import ServerThread

KEYS = {"key-alice": "alice", "key-admin": "*"}


def serving(tmp_path: Path, provider: EmbeddingProvider | None) -> Iterator[str]:
    settings = Settings(data_dir=str(tmp_path / "pack"), service=ServiceSettings(api_keys=KEYS))
    server = ServerThread(settings, provider)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def hashed_server(tmp_path: Path) -> Iterator[str]:
    yield from serving(tmp_path, HashedBagOfWordsProvider())


@pytest.fixture
def model_server(tmp_path: Path, default_model_dir: Path) -> Iterator[str]:
    yield from serving(tmp_path, None)


@pytest.mark.model
def test_sync_client_stores_retrieves_and_reads_history_over_http(model_server: str) -> None:
    with MemoryClient(url=model_server, api_key="key-alice", timeout_s=60) as client:
        stored = client.store("My sister Lena lives in Lisbon", "alice", session_id="trip")
        client.store("I booked a flight for the 12th of May", "alice", session_id="trip")
        response = client.retrieve("Where does my sister live?", "alice", after=stored.token)
        assert response.results[0].event_id == stored.event_id
        assert response.results[0].semantic_relevance is not None
        assert "Lisbon" in response.bundle.render()
        assert response.receipt.embedding.model_name.endswith("all-MiniLM-L6-v2")
        history = client.history("alice", "trip")
        assert [m.content for m in history] == [
            "My sister Lena lives in Lisbon",
            "I booked a flight for the 12th of May",
        ]
        with pytest.raises(Forbidden):
            client.history("bob", "trip")


async def test_async_client_reads_its_writes_over_http(hashed_server: str) -> None:
    async with AsyncMemoryClient(url=hashed_server, api_key="key-alice", timeout_s=30) as alice:
        stored = await alice.store("the spare key is under the blue pot", "alice")
        found = await alice.retrieve("spare key blue pot", "alice")
        assert [r.event_id for r in found.results] == [stored.event_id]
        assert [m.content for m in await alice.history("alice")] == [
            "the spare key is under the blue pot"
        ]
    async with AsyncMemoryClient(url=hashed_server, api_key="key-admin") as admin:
        await admin.erase_owner("alice")
        assert await admin.history("alice") == []


async def test_open_service_refuses_a_non_loopback_host(tmp_path: Path) -> None:
    data_dir = tmp_path / "pack"
    settings = Settings(data_dir=str(data_dir), service=ServiceSettings(host="0.0.0.0"))
    with pytest.raises(ConfigurationError, match="without API keys"):
        await run_server(settings, embedding_provider=HashedBagOfWordsProvider())
    assert not data_dir.exists()


def test_serve_command_explains_the_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PRME_SERVICE__API_KEYS", raising=False)
    code = main(["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "pack")])
    assert code == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in capsys.readouterr().err


def test_bind_safety_allows_keys_anywhere_and_an_open_service_on_loopback() -> None:
    check_bind_safety(ServiceSettings(host="0.0.0.0", api_keys=KEYS))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert is_loopback(host)
        check_bind_safety(ServiceSettings(host=host))
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ConfigurationError):
            check_bind_safety(ServiceSettings(host=host))
