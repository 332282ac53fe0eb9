"""MemoryClient: the sync face over the worker loop, sharing one engine per directory."""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from prme import AsyncMemoryClient, MemoryClient
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.schemas.config import ScoringSettings, Settings
from prme.schemas.errors import ClientClosed, ConfigurationError


class LoopBoundProvider(HashedBagOfWordsProvider):
    """Creates a loop-bound resource lazily inside embed, as an HTTP client would, and
    refuses to be used from another loop."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        running = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = running
        elif self.loop is not running:
            raise RuntimeError("this provider's resources belong to another event loop")
        await asyncio.sleep(0)
        return await super().embed(texts)

    def close(self) -> None:
        self.closed = True


def test_provider_coroutines_run_on_the_clients_worker_loop(tmp_path: Path) -> None:
    provider = LoopBoundProvider()
    client = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    try:
        client.store("Aurora needs approval.", user_id="alice")
        results: list[list[str]] = []

        def retrieve_from_another_thread() -> None:
            results.append([r.text for r in client.retrieve("Aurora", user_id="alice").results])

        thread = threading.Thread(target=retrieve_from_another_thread)
        thread.start()
        thread.join()
        assert results == [["Aurora needs approval."]]
        assert provider.loop is client.loop
    finally:
        client.close()
    assert provider.closed is False


def test_clients_of_one_directory_share_one_engine(tmp_path: Path) -> None:
    provider = HashedBagOfWordsProvider()
    first = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    second = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    try:
        assert first.engine is second.engine
        first.store("shared write", user_id="alice", session_id="s")
        assert [m.content for m in second.history("alice", "s")] == ["shared write"]
        first.close()
        assert [r.text for r in second.retrieve("shared", user_id="alice").results] == [
            "shared write"
        ]
        with pytest.raises(ConfigurationError, match="another embedding provider"):
            MemoryClient(tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider())
    finally:
        second.close()
    reopened = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    try:
        assert [m.content for m in reopened.history("alice", "s")] == ["shared write"]
    finally:
        reopened.close()


def test_a_second_client_with_other_settings_is_refused_not_silently_ignored(
    tmp_path: Path,
) -> None:
    """From a new-user trial: a second MemoryClient of an open directory passing
    ``settings=`` (fusion "rrf") got the first one's engine, and "zscore", without a word."""
    provider = HashedBagOfWordsProvider()
    rrf = Settings(scoring=ScoringSettings(fusion="rrf"))
    first = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    try:
        with pytest.raises(ConfigurationError, match="other settings"):
            MemoryClient(tmp_path / "pack", settings=rrf)
        same = MemoryClient(tmp_path / "pack", settings=Settings.from_env())
        none = MemoryClient(tmp_path / "pack")  # no settings: whatever is open
        same.close()
        none.close()
    finally:
        first.close()
    with MemoryClient(tmp_path / "pack", settings=rrf, embedding_provider=provider) as client:
        client.store("one memory", user_id="alice")
        assert client.retrieve("memory", user_id="alice").receipt.fusion == "rrf"
        with MemoryClient(tmp_path / "pack", settings=rrf) as second:
            assert second.engine is client.engine


def test_an_async_client_used_from_a_second_event_loop_says_so(tmp_path: Path) -> None:
    """From a new-user trial: a second ``asyncio.run`` with the same AsyncMemoryClient
    failed with "<Condition> is bound to a different event loop", and ``close`` with
    "Event loop is closed"."""
    provider = HashedBagOfWordsProvider()
    client = AsyncMemoryClient(tmp_path / "pack", embedding_provider=provider)
    first_loop = asyncio.new_event_loop()
    try:
        first_loop.run_until_complete(client.store("first", user_id="u"))
        with pytest.raises(ConfigurationError, match="another event loop"):
            asyncio.run(client.store("second", user_id="u"))
        with pytest.raises(ConfigurationError, match="one client per loop"):
            asyncio.run(client.close())
        first_loop.run_until_complete(client.close())  # in its own loop it closes
    finally:
        first_loop.close()

    async def one_loop() -> list[str]:
        async with AsyncMemoryClient(tmp_path / "other", embedding_provider=provider) as memory:
            await memory.store("kept", user_id="u")
            return [r.text for r in (await memory.retrieve("kept", user_id="u")).results]

    assert asyncio.run(one_loop()) == ["kept"]


def test_a_directory_of_other_files_is_not_made_a_pack(tmp_path: Path) -> None:
    """From a new-user trial: ``MemoryClient("examples")`` scattered log.sqlite3, shards/,
    prme.json ... among a folder's own files."""
    folder = tmp_path / "examples"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ConfigurationError, match=r"is not empty \(notes.txt\) and holds no PRME"):
        MemoryClient(folder, embedding_provider=HashedBagOfWordsProvider())
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    # From a review: a volume's lost+found or a .gitkeep does not make a directory taken.
    (empty / "lost+found").mkdir()
    (empty / ".gitkeep").touch()
    with MemoryClient(empty, embedding_provider=HashedBagOfWordsProvider()) as client:
        client.store("a pack now", user_id="alice")
    (empty / "notes.txt").write_text("a file beside a pack's own is no reason to refuse it")
    with MemoryClient(empty, embedding_provider=HashedBagOfWordsProvider()) as client:
        assert [m.content for m in client.history("alice", "default")] == ["a pack now"]


def test_settings_refuse_a_dict_for_a_section() -> None:
    """``Settings(scoring={"fusion": "rrf"})`` was accepted and held a dict."""
    with pytest.raises(
        ConfigurationError, match=r"not dict: pass prme.schemas.config.ScoringSettings\("
    ):
        Settings(scoring={"fusion": "rrf"})  # type: ignore[arg-type]
    assert Settings().replace(scoring={"fusion": "rrf"}).scoring.fusion == "rrf"


@pytest.mark.parametrize(
    "url",
    ["127.0.0.1:8765", "localhost:8765", "ftp://x", ["http://a:1", "b:2"], [], "http://[::1"],
)
def test_a_client_url_without_http_is_refused_when_the_client_is_made(url: object) -> None:
    """From a new-user trial: MemoryClient(url="127.0.0.1:8765") was accepted and failed at
    its first call with httpx's "missing an 'http://'"."""
    with pytest.raises(ConfigurationError, match="node URL"):
        MemoryClient(url=url)  # type: ignore[arg-type]


def test_a_client_needs_exactly_one_of_directory_or_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        MemoryClient()
    with pytest.raises(ConfigurationError):
        MemoryClient(tmp_path, url="http://127.0.0.1:1")


async def test_the_async_client_has_the_same_surface(tmp_path: Path) -> None:
    sync_methods = {n for n in dir(MemoryClient) if not n.startswith("_")} - {"loop"}
    async_methods = {n for n in dir(AsyncMemoryClient) if not n.startswith("_")}
    assert sync_methods <= async_methods
    async with AsyncMemoryClient(
        tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider()
    ) as client:
        await client.store("async write", "alice")
        assert [r.text for r in (await client.retrieve("async", "alice")).results] == [
            "async write"
        ]


def _refused_without_warnings(call: Callable[[], object]) -> None:
    """``call`` raises ClientClosed, and leaves no coroutine unawaited behind it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ClientClosed, match="closed"):
            call()
        gc.collect()  # an unawaited coroutine warns when it is collected
    assert [str(w.message) for w in caught] == []


def test_a_closed_client_says_it_is_closed(tmp_path: Path) -> None:
    """Found by a new-user trial: a client used after its ``with`` block raised
    ``RuntimeError: Event loop is closed`` and warned of a coroutine never awaited, embedded
    and over HTTP."""
    with MemoryClient(tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider()) as m:
        m.store("Aurora needs approval.", user_id="pat")
    _refused_without_warnings(lambda: m.store("x", user_id="pat"))
    _refused_without_warnings(lambda: m.history("pat"))
    # Another client of the same directory keeps the shared engine open: still refused.
    provider = HashedBagOfWordsProvider()
    first = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    second = MemoryClient(tmp_path / "pack", embedding_provider=provider)
    try:
        first.close()
        _refused_without_warnings(lambda: first.history("pat"))
        assert [m.content for m in second.history("pat")] == ["Aurora needs approval."]
    finally:
        second.close()
    remote = MemoryClient(url="http://127.0.0.1:9", timeout_s=5)  # nothing is sent
    remote.close()
    _refused_without_warnings(lambda: remote.store("x", user_id="pat"))
    remote.close()  # closing again is harmless


async def test_a_closed_async_client_says_it_is_closed(tmp_path: Path) -> None:
    """An async client used after ``close()`` opened its engine again (and held the data
    directory until the process exited)."""
    async with AsyncMemoryClient(
        tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider()
    ) as client:
        await client.store("async write", "pat")
    with pytest.raises(ClientClosed, match="closed"):
        await client.store("again", "pat")
    with pytest.raises(ClientClosed, match="closed"):
        async with client:
            pass
    assert client.engine is None
    reopened = MemoryClient(tmp_path / "pack", embedding_provider=HashedBagOfWordsProvider())
    try:  # the directory was released: nothing holds it
        assert [m.content for m in reopened.history("pat")] == ["async write"]
    finally:
        reopened.close()


def test_a_directory_below_a_file_is_a_configuration_error_naming_it(tmp_path: Path) -> None:
    """It was a NotADirectoryError traceback from deep inside the engine's start."""
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ConfigurationError, match=f"{afile} is a file"):
        MemoryClient(afile / "sub", embedding_provider=HashedBagOfWordsProvider())
    assert afile.read_text() == "mine"


async def test_a_first_start_that_fails_leaves_no_pack_file_deciding_the_pack(
    tmp_path: Path,
) -> None:
    """From an operations trial: a first ``prme rebuild`` with a model that did not load
    wrote ``prme.json`` naming that model; the next start, with the default one, built
    vectors the pack file did not describe. A first start that fails decides nothing."""
    from prme import MemoryEngine
    from prme.query.pack_config import load_pack_config
    from prme.schemas.config import Settings
    from prme.schemas.errors import TransportError

    pack = tmp_path / "pack"
    unreachable = Settings(data_dir=str(pack)).replace(
        log={"transport": "kafka", "bootstrap": "127.0.0.1:1", "request_timeout_s": 2}
    )
    with pytest.raises(TransportError):
        await MemoryEngine.create(
            settings=unreachable, embedding_provider=HashedBagOfWordsProvider()
        )
    assert load_pack_config(pack) is None
    provider = HashedBagOfWordsProvider(dimension=32)
    async with await MemoryEngine.create(
        settings=Settings(data_dir=str(pack)), embedding_provider=provider
    ):
        pass
    saved = load_pack_config(pack)
    assert saved is not None and saved.embedding.dimension == 32
    assert saved.log.transport == "local"
