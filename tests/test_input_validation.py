"""Input the API refuses with ``400 invalid_input`` naming the field, writing nothing, over
HTTP and in-process alike (docs/HTTP.md "Validation"): gaps a review found after the
first rules were in place."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from prme.producers.ingest import message_from_line
from prme.producers.local_log import LocalLogTransport
from prme.producers.producer import MessageDraft, Producer
from prme.query.engine import MemoryEngine
from prme.query.http_client import HttpMemoryBackend
from prme.query.service import create_app
from prme.schemas.errors import InvalidInput

from .conftest import keyed_engine

KEY = {"Authorization": "Bearer key-admin"}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[MemoryEngine]:
    async with keyed_engine(tmp_path / "pack", {"key-admin": "*"}) as opened:
        yield opened


def service_backend(engine: MemoryEngine) -> HttpMemoryBackend:
    app = create_app(engine)
    return HttpMemoryBackend(
        "http://prme", "key-admin", timeout_s=10, transport=httpx.ASGITransport(app=app)
    )


async def log_size(engine: MemoryEngine) -> int:
    return sum((await engine.runner.transport.end_offsets()).values())


async def refused(
    http: httpx.AsyncClient, engine: MemoryEngine, method: str, path: str, **request: Any
) -> str:
    """The detail of the 400 ``invalid_input`` the request gets; it must write nothing."""
    before = await log_size(engine)
    response = await http.request(method, path, headers=KEY, **request)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_input"
    assert await log_size(engine) == before
    detail: str = response.json()["detail"]
    return detail


# -- occurred_at ----------------------------------------------------------------------


async def test_an_occurred_at_without_a_utc_offset_is_refused_with_an_example(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """It was stored as written, naive: date cues read it as UTC, the vector payload as the
    server's local time."""
    naive = {"user_id": "alice", "content": "x", "occurred_at": "2024-05-01T10:00:00"}
    detail = await refused(http, engine, "POST", "/v1/memories", json=naive)
    assert "occurred_at" in detail and "2024-05-01T10:00:00Z" in detail
    batch = {"messages": [{**naive, "occurred_at": "2024-05-01T10:00:00Z"}, naive]}
    detail = await refused(http, engine, "POST", "/v1/memories/batch", json=batch)
    assert "occurred_at" in detail and "$.messages[1]" in detail
    message = {"content": "x", "occurred_at": "2024-05-01T10:00:00"}
    history = {"user_id": "alice", "session_id": "s", "messages": [message]}
    for path in ("/v1/history/messages", "/v1/history/replace"):
        detail = await refused(http, engine, "POST", path, json=history)
        assert "occurred_at" in detail and "$.messages[0]" in detail
    for aware in ("2024-05-01T10:00:00Z", "2024-05-01T12:00:00+02:00"):
        ok = await http.post("/v1/memories", json={**naive, "occurred_at": aware}, headers=KEY)
        assert ok.status_code == 201, ok.text


async def test_a_naive_datetime_is_refused_in_process_and_by_the_http_client(
    engine: MemoryEngine,
) -> None:
    naive = datetime(2024, 5, 1, 10, 0)
    for backend in (engine, service_backend(engine)):
        before = await log_size(engine)
        with pytest.raises(InvalidInput, match="occurred_at .* has no UTC offset"):
            await backend.store("x", "alice", occurred_at=naive)
        draft = MessageDraft(owner="alice", session_id="s", content="x", occurred_at=naive)
        with pytest.raises(InvalidInput, match="occurred_at"):
            await backend.store_many([draft])
        with pytest.raises(InvalidInput, match="occurred_at"):
            await backend.add_messages("alice", "s", [draft])
        with pytest.raises(InvalidInput, match="occurred_at"):
            await backend.replace_history("alice", "s", [draft])
        assert await log_size(engine) == before
    stored = await engine.store("x", "alice", occurred_at=naive.replace(tzinfo=UTC))
    event = await engine.get_event(stored.event_id, "alice")
    assert event.record.occurred_at == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


def test_an_ingest_line_whose_time_has_no_utc_offset_is_a_bad_line(tmp_path: Path) -> None:
    producer = Producer(LocalLogTransport(tmp_path / "log"))
    line = '{"owner": "alice", "content": "x", "time": "2024-05-01T10:00:00"}'
    with pytest.raises(InvalidInput, match=r"no UTC offset.* - at \$\.time"):
        message_from_line(line, producer)
    message, _ = message_from_line(line.replace(':00"', ':00Z"'), producer)
    assert message.occurred_at == datetime(2024, 5, 1, 10, 0, tzinfo=UTC)


# -- empty names ----------------------------------------------------------------------

NAMES = ("name", "tool_call_id", "message_id")


@pytest.mark.parametrize("field", NAMES)
async def test_an_empty_name_or_message_id_is_refused(
    http: httpx.AsyncClient, engine: MemoryEngine, field: str
) -> None:
    """They were stored as "", which reads as absent in one place (``name or role``) and
    present in another."""
    body = {"user_id": "alice", "content": "x", field: ""}
    detail = await refused(http, engine, "POST", "/v1/memories", json=body)
    assert f"$.{field}" in detail
    history = {"user_id": "alice", "session_id": "s", "messages": [{"content": "x", field: ""}]}
    detail = await refused(http, engine, "POST", "/v1/history/messages", json=history)
    assert f"$.messages[0].{field}" in detail
    draft = MessageDraft(owner="alice", content="x", **{field: ""})
    with pytest.raises(InvalidInput, match=rf"{field} must not be empty.* - at \$\.{field}"):
        await engine.store_many([draft])
    ok = await http.post("/v1/memories", json={**body, field: "x1"}, headers=KEY)
    assert ok.status_code == 201, ok.text


def test_a_framework_message_with_an_empty_name_or_id_is_stored_without_one() -> None:
    messages = pytest.importorskip("langchain_core.messages")
    from prme.adapters.messages import langchain_to_draft

    message = messages.ToolMessage(content="42", tool_call_id="", name="", id="")
    draft = langchain_to_draft(message, "alice", "s", "default")
    assert (draft.name, draft.tool_call_id, draft.message_id) == (None, None, None)


# -- control and invisible characters in ids ------------------------------------------

UNSEEN = ["\u200b", "\u200c", "\u200d", "\ufeff", "\u2060", "\u202e", "\x07", "\n"]
UNSEEN += ["\u3164", "\u034f", "\u061c", "\ufe0f", "\u2800", "\u2028", "\U000e0001"]
"""Zero-width space, non-joiner, joiner, byte order mark, word joiner, right-to-left
override, a bell, a newline; and what a new-user trial still got through: a Hangul filler,
the combining grapheme joiner, the Arabic letter mark, a variation selector, the braille
blank, the line separator, a tag character."""


@pytest.mark.parametrize("char", UNSEEN)
async def test_an_id_with_an_invisible_or_control_character_is_refused(
    http: httpx.AsyncClient, engine: MemoryEngine, char: str
) -> None:
    """``"alice\\u200b"`` was another owner than ``"alice"`` that looks the same; control
    characters were refused in owner ids only (and a final newline not even there)."""
    memory = {"user_id": "alice", "content": "x"}
    cases: list[tuple[str, str, dict[str, Any], str]] = [
        ("POST", "/v1/memories", {"json": {**memory, "user_id": "alice" + char}}, "$.user_id"),
        ("POST", "/v1/memories", {"json": {**memory, "user_id": char}}, "$.user_id"),
        ("POST", "/v1/memories", {"json": {**memory, "session_id": "s" + char}}, "$.session_id"),
        ("POST", "/v1/memories", {"json": {**memory, "scope": char}}, "$.scope"),
        ("POST", "/v1/memories", {"json": {**memory, "request_id": f"r{char}1"}}, "request_id"),
        (
            "POST",
            "/v1/history/clear",
            {"json": {"user_id": "alice", "session_id": f"s{char}"}},
            "$.session_id",
        ),
        ("GET", "/v1/history", {"params": {"user_id": f"alice{char}"}}, "user_id"),
        ("GET", "/v1/history", {"params": {"user_id": "a", "scope": f"w{char}"}}, "scope"),
        ("GET", f"/v1/events/e{quote(char)}", {"params": {"user_id": "alice"}}, "event_id"),
        ("POST", f"/v1/nodes/mem:{quote(char)}/archive", {"json": {"user_id": "a"}}, "node_id"),
    ]
    for method, path, request, named in cases:
        detail = await refused(http, engine, method, path, **request)
        assert named in detail and "invisible" in detail, (path, request, detail)
    before = await log_size(engine)
    drafts = [
        MessageDraft(owner="alice" + char, content="x"),
        MessageDraft(owner="alice", session_id="s" + char, content="x"),
        MessageDraft(owner="alice", scope=char, content="x"),
        MessageDraft(owner="alice", content="x", request_id=f"r{char}"),
    ]
    for draft in drafts:
        with pytest.raises(InvalidInput, match="control character or an invisible one"):
            await engine.store_many([draft])
    with pytest.raises(InvalidInput, match="invisible"):
        await engine.history("alice", f"s{char}")
    with pytest.raises(InvalidInput, match="invisible"):
        await engine.clear_history("alice", "s", scope=f"w{char}")
    assert await log_size(engine) == before


async def test_ids_in_other_scripts_and_inner_spaces_are_still_ids(
    http: httpx.AsyncClient,
) -> None:
    body = {"user_id": "josé", "session_id": "日本 trip", "scope": "Ωmega", "content": "x"}
    response = await http.post("/v1/memories", json=body, headers=KEY)
    assert response.status_code == 201, response.text


# -- query parameters -----------------------------------------------------------------


@pytest.mark.parametrize("limit", ["1e3", "10.0", "0x10", " 5", "５", "1_000"])
async def test_a_limit_not_written_in_digits_is_refused(
    http: httpx.AsyncClient, engine: MemoryEngine, limit: str
) -> None:
    """``limit=1e3`` and ``limit=10.0`` were read as 1000 and 10 (query strings were
    converted laxly)."""
    params = {"user_id": "alice", "limit": limit}
    detail = await refused(http, engine, "GET", "/v1/history", params=params)
    assert "query parameter `limit`" in detail and "whole number" in detail
    assert (await http.get("/v1/history", params={**params, "limit": "10"}, headers=KEY)).is_success


async def test_an_unknown_query_parameter_is_refused_naming_it(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """``?limt=5`` was ignored: the whole history came back, as if no limit was asked."""
    stored = await http.post("/v1/memories", json={"user_id": "alice", "content": "x"}, headers=KEY)
    event_id = stored.json()["event_id"]
    cases = [
        ("GET", "/v1/history", {"params": {"user_id": "alice", "limt": "5"}}, "'limt'"),
        ("GET", f"/v1/events/{event_id}", {"params": {"user_id": "alice", "x": ""}}, "'x'"),
        (
            "DELETE",
            f"/v1/history/messages/{event_id}",
            {"params": {"user_id": "alice", "wiat": "false"}},
            "'wiat'",
        ),
        (
            "POST",
            "/v1/retrieve",
            {"params": {"top_k": "3"}, "json": {"user_id": "alice", "query": "x"}},
            "'top_k'",
        ),
    ]
    for method, path, request, named in cases:
        detail = await refused(http, engine, method, path, **request)
        assert f"unknown query parameter {named}" in detail, detail
    detail = await refused(http, engine, "GET", "/v1/history", params={"user_id": "a", "y": ""})
    assert "takes after, limit, scope, session_id, user_id" in detail
    without_key = await http.get("/v1/history", params={"user_id": "alice", "limt": "5"})
    assert without_key.status_code == 401  # the key first, as for a body
    backend = service_backend(engine)  # the client sends only what the routes declare
    assert len(await backend.history("alice", limit=5)) == 1
    await backend.delete_message("alice", event_id, wait=False)


# -- repeated deletes -----------------------------------------------------------------


async def test_deleting_a_message_again_writes_nothing_and_answers_the_first_deletion(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """Each repeat appended another ``message_deleted`` record to the log."""
    kept = await engine.store("kept", "alice")
    gone = await engine.store("gone", "alice")
    path = f"/v1/history/messages/{gone.event_id}"
    first = await http.delete(path, params={"user_id": "alice"}, headers=KEY)
    assert first.status_code == 200, first.text
    size = await log_size(engine)
    for _ in range(2):
        again = await http.delete(path, params={"user_id": "alice"}, headers=KEY)
        assert (again.status_code, again.json()) == (200, first.json())
    in_process = await engine.delete_message("alice", gone.event_id)
    assert in_process.event_id == first.json()["event_id"]
    assert await log_size(engine) == size
    assert [m.event_id for m in await engine.history("alice")] == [kept.event_id]
    event = await engine.get_event(first.json()["event_id"], "alice")
    assert (event.kind, event.record.target_event_id) == ("message_deleted", gone.event_id)


# -- long ids -------------------------------------------------------------------------


async def test_a_path_id_over_the_length_limit_is_refused_before_lookup_without_its_echo(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    long = "e" * 10_000
    cases = [
        ("GET", f"/v1/events/{long}", {"params": {"user_id": "alice"}}, "event_id"),
        ("GET", f"/v1/events/{long}/nodes", {"params": {"user_id": "alice"}}, "event_id"),
        ("DELETE", f"/v1/history/messages/{long}", {"params": {"user_id": "alice"}}, "event_id"),
        ("POST", f"/v1/nodes/mem:{long}/archive", {"json": {"user_id": "alice"}}, "node_id"),
        ("POST", f"/v1/nodes/mem:{long}/restore", {"json": {"user_id": "alice"}}, "node_id"),
        (
            "POST",
            f"/v1/nodes/mem:{long}/supersede",
            {"json": {"user_id": "alice", "by_node_id": "mem:x"}},
            "node_id",
        ),
    ]
    for method, path, request, named in cases:
        detail = await refused(http, engine, method, path, **request)
        assert detail == f"Expected `str` of length <= 256 - at path parameter `{named}`"


async def test_query_string_errors_quote_a_long_value_cut_short(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """``?<10,000 characters>=1&<the same>=2`` was sent back whole in the detail (two
    of 7,000 now: a target over 16 KiB is refused before its parameters are read)."""
    name = "q" * 10_000
    twice = "q" * 7_000
    repeated = await http.get("/v1/history", params=[(twice, "1"), (twice, "2")], headers=KEY)
    assert repeated.status_code == 400 and len(repeated.text) < 300, repeated.text
    assert "'qqqq" in repeated.text and "... (7000 characters)" in repeated.text
    unknown = await refused(http, engine, "GET", "/v1/history", params={"user_id": "a", name: ""})
    assert len(unknown) < 300 and "(10000 characters)" in unknown
    limit = await refused(
        http, engine, "GET", "/v1/history", params={"user_id": "a", "limit": "9" * 9_999 + "x"}
    )
    assert len(limit) < 300 and "(10000 characters)" in limit


async def test_an_mcp_resource_that_does_not_exist_is_named_cut_short(tmp_path: Path) -> None:
    pytest.importorskip("mcp")
    from prme import AsyncMemoryClient
    from prme.adapters.mcp_server import PrmeMcp
    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
    from prme.query.auth import Caller
    from prme.schemas.config import Settings
    from prme.schemas.errors import NotFound

    long = "r" * 10_000
    provider = HashedBagOfWordsProvider()
    async with AsyncMemoryClient(tmp_path / "pack", embedding_provider=provider) as client:
        server = PrmeMcp(client, Settings(), transport="stdio")
        for uri in (f"prme://receipts/{long}", f"prme://nowhere/{long}"):
            with pytest.raises(NotFound) as missing:
                await server._resource_body(uri, Caller("*"))
            assert len(str(missing.value)) < 300 and "(10" in str(missing.value)
        with pytest.raises(InvalidInput) as unknown:
            await server._resource_body(f"prme://history/mo/s?{long}=1", Caller("*"))
        assert len(str(unknown.value)) < 300


async def test_an_owner_written_before_ids_refused_invisible_characters_can_be_erased(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """Found reviewing the id rule: reads refuse such an owner, and erasure refused it too,
    so an owner an earlier version stored could never be erased."""
    from prme.producers.transport import LogItem
    from prme.schemas.codec import encode_record

    from .record_builders import msg

    owner = "alice\u200b"
    transport = engine.runner.transport
    written = await transport.append(LogItem(owner.encode(), encode_record(msg("e", "x", owner))))
    await engine.wait_for([written])
    shard = await engine.runner.shard_for(owner)

    async def history() -> list[Any]:
        found: list[Any] = await shard.call(
            "history", lambda model: model.messages(owner, "s1", "default")
        )
        return found

    assert len(await history()) == 1
    erased = await http.delete("/v1/owners", params={"user_id": owner}, headers=KEY)
    assert erased.status_code == 200, erased.text
    assert await history() == []
    await engine.erase_owner(owner)  # in-process too
    detail = await refused(http, engine, "DELETE", "/v1/owners", params={"user_id": " alice"})
    assert "user_id" in detail
    # `*` is every owner in API keys: an erasure of "*" erased an owner of that name alone.
    detail = await refused(http, engine, "DELETE", "/v1/owners", params={"user_id": "*"})
    assert "erase owners one at a time" in detail
    # An owner an earlier version stored as "*" stays erasable in-process (no API keys).
    star = await transport.append(LogItem(b"*", encode_record(msg("e2", "old", "*"))))
    await engine.wait_for([star])
    starred = await engine.runner.shard_for("*")
    assert await starred.call("history", lambda m: m.messages("*", "s1", "default"))
    await engine.erase_owner("*")
    assert await starred.call("history", lambda m: m.messages("*", "s1", "default")) == []
    detail = await refused(
        http, engine, "POST", "/v1/memories", json={"user_id": "*", "content": "x"}
    )
    assert "not `*`" in detail
