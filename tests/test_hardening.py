"""The faults of issue 13 (found by fuzzing and adversarial probes), one test each: every
one of them failed before its fix."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from prme.producers.factory import open_transport
from prme.producers.local_log import LocalLogTransport
from prme.producers.producer import MessageDraft, Producer, log_item
from prme.producers.transport import LogItem, Position, dedupe_key, split_dedupe_key
from prme.projectors.dead_letters import dead_letters_of
from prme.projectors.runner import remove_stale_staging
from prme.projectors.stores.graph import GraphModel
from prme.query.engine import MemoryEngine
from prme.query.http_types import RetrieveRequest
from prme.schemas.codec import encode_record
from prme.schemas.config import Settings
from prme.schemas.errors import InvalidInput, NotFound

from .conftest import keyed_engine
from .record_builders import msg, projected, superseded

KEYS = {"key-jose": "josé", "key-alice": "alice", "key-admin": "*"}
JOSE = {"Authorization": "Bearer key-jose"}
ALICE = {"Authorization": "Bearer key-alice"}
ADMIN = {"X-API-Key": "key-admin"}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[MemoryEngine]:
    async with keyed_engine(tmp_path / "pack", KEYS, log={"partitions": 4}) as opened:
        yield opened


async def log_size(engine: MemoryEngine) -> int:
    return sum((await engine.runner.transport.end_offsets()).values())


# -- 1: non-ASCII owners with an owner-bound key ----------------------------------------


async def test_a_key_bound_to_a_non_ascii_owner_acts_for_it_and_only_for_it(
    http: httpx.AsyncClient,
) -> None:
    stored = await http.post(
        "/v1/memories", json={"user_id": "josé", "content": "olá"}, headers=JOSE
    )
    assert stored.status_code == 201, stored.text
    history = await http.get("/v1/history", params={"user_id": "josé"}, headers=JOSE)
    assert [m["content"] for m in history.json()] == ["olá"]
    for owner in ("zoë", "alice"):
        other = await http.get("/v1/history", params={"user_id": owner}, headers=JOSE)
        assert other.status_code == 403, other.text
    assert (
        await http.get("/v1/history", params={"user_id": "josé"}, headers=ALICE)
    ).status_code == 403


# -- 2: request_id dedupe keys never collide across owners ------------------------------


def test_dedupe_keys_of_different_owners_never_collide() -> None:
    first = msg("e1", "first", owner="alice\x1fx")
    second = msg("e2", "second", owner="alice")
    pairs = [(first, "y"), (second, "x\x1fy")]
    keys = [log_item(type(r)(**{**_fields(r), "request_id": rid})).dedupe_key for r, rid in pairs]
    assert keys[0] != keys[1]
    # Owners without a unit separator keep the key the log already stores (no migration).
    plain = msg("e3", "third", owner="bob")
    assert log_item(type(plain)(**{**_fields(plain), "request_id": "r1"})).dedupe_key == "bob\x1fr1"


def _fields(record: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.structs.asdict(record)


@pytest.mark.parametrize("owner", ["alice\x1fx", "a\x00b", "tab\there", "bell\x07"])
async def test_an_owner_id_with_control_characters_is_refused_and_nothing_is_written(
    local_settings: Settings, owner: str
) -> None:
    transport = open_transport(local_settings)
    await transport.start()
    try:
        producer = Producer(transport)
        with pytest.raises(InvalidInput, match="control character"):
            await producer.append_message(MessageDraft(owner=owner, content="x", request_id="y"))
        with pytest.raises(InvalidInput, match="control character"):
            await producer.append_control("history_cleared", owner)
        assert sum((await transport.end_offsets()).values()) == 0
    finally:
        await transport.close()


async def check_request_ids_of_two_owners_both_write(settings: Settings) -> None:
    transport = open_transport(settings)
    await transport.start()
    try:
        producer = Producer(transport)
        # Records as an older writer could have put them on the log (built, not validated).
        legacy = [
            type(r)(**{**_fields(r), "request_id": rid})
            for r, rid in (
                (msg("e1", "one", owner="alice\x1fx"), "y"),
                (msg("e2", "two"), "x\x1fy"),
            )
        ]
        receipts = await producer.append_records(legacy, atomic=False)
        assert receipts[0].position != receipts[1].position
        assert sum((await transport.end_offsets()).values()) == 2
        again = await producer.append_records(legacy, atomic=False)  # a retry writes nothing
        assert [r.position for r in again] == [r.position for r in receipts]
        assert sum((await transport.end_offsets()).values()) == 2
    finally:
        await transport.close()


async def test_the_same_request_id_of_two_owners_writes_both(local_settings: Settings) -> None:
    await check_request_ids_of_two_owners_both_write(local_settings)


@pytest.mark.kafka
async def test_the_same_request_id_of_two_owners_writes_both_on_kafka(
    kafka_settings: Settings,
) -> None:
    await check_request_ids_of_two_owners_both_write(kafka_settings)


# -- 3: a node cannot supersede itself ---------------------------------------------------


async def test_a_node_superseding_itself_is_refused_and_nothing_is_written(
    engine: MemoryEngine, http: httpx.AsyncClient
) -> None:
    stored = await engine.store("Miso is a cat", "alice")
    node = stored.node_ids[0]
    before = await log_size(engine)
    with pytest.raises(InvalidInput, match="itself"):
        await engine.supersede(node, node, "alice")
    response = await http.post(
        f"/v1/nodes/{node}/supersede", json={"user_id": "alice", "by_node_id": node}, headers=ALICE
    )
    assert response.status_code == 400, response.text
    assert "by_node_id" in response.json()["detail"]
    assert await log_size(engine) == before
    assert (await engine.retrieve("Miso cat", "alice")).results[0].node_id == node


def test_the_graph_marks_a_self_superseded_node_as_vector_and_lexical_do(tmp_path: Path) -> None:
    graph = GraphModel(tmp_path / "graph")
    try:
        graph.apply(projected([msg("e1", "Caroline went to Rome")]))
        graph.apply(projected([superseded("x1", "mem:e1", "mem:e1")], start=1))
        assert graph.node_state("alice", "mem:e1") == "superseded"
        assert all(edge.kind != "supersedes" for edge in graph.edges_of("alice", "mem:e1"))
    finally:
        graph.close()


# -- 4: a record whose owner is not its log key is dead-lettered -------------------------


async def test_a_record_whose_owner_differs_from_its_log_key_is_dead_lettered(
    local_settings: Settings, hashed_provider: Any
) -> None:
    transport = open_transport(local_settings)
    await transport.start()
    forged = msg("0190a000-0000-7000-8000-000000000001", "bob's forged memory", owner="bob")
    await transport.append(LogItem(b"alice", encode_record(forged)))
    await transport.close()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        await engine.store("after the forged record", "alice")
        assert engine.runner.dead_letter_count == 1
        for owner in ("alice", "bob"):
            with pytest.raises(NotFound):
                await engine.get_event(forged.event_id, owner)
            assert "forged" not in str(await engine.history(owner, "s1"))
    letters = await dead_letters_of(local_settings)
    assert len(letters) == 1 and "key" in letters[0].error and "owner" in letters[0].error


# -- 5: `after` must name the owner's partition and an offset the log has ----------------


async def test_after_naming_a_partition_that_does_not_exist_is_refused_at_once(
    engine: MemoryEngine, http: httpx.AsyncClient
) -> None:
    started = time.monotonic()
    with pytest.raises(InvalidInput, match="after"):
        await engine.retrieve_request(
            RetrieveRequest(query="x", user_id="alice", after=Position(99, 0))
        )
    with pytest.raises(InvalidInput, match="after"):
        await engine.history("alice", after=Position(99, 0))
    body = {"user_id": "alice", "query": "x", "after": {"partition": 99, "offset": 0}}
    retrieved = await http.post("/v1/retrieve", json=body, headers=ALICE)
    assert retrieved.status_code == 400 and "after" in retrieved.json()["detail"]
    history = await http.get(
        "/v1/history", params={"user_id": "alice", "after": "99:0"}, headers=ALICE
    )
    assert history.status_code == 400 and "after" in history.json()["detail"]
    assert time.monotonic() - started < 2


async def test_after_naming_another_owners_partition_or_a_future_offset_is_refused(
    engine: MemoryEngine,
) -> None:
    mine = (await engine.store("alice's memory", "alice")).token
    other = next(p for p in range(engine.runner.transport.partitions) if p != mine.partition)
    started = time.monotonic()
    for token in (Position(other, 0), Position(mine.partition, mine.offset + 1000)):
        with pytest.raises(InvalidInput, match="after"):
            await engine.history("alice", after=token)
    assert time.monotonic() - started < 2
    assert [m.content for m in await engine.history("alice", after=mine)] == ["alice's memory"]


# -- 8: a killed rebuild's staging folder is cleaned up -----------------------------------


async def test_a_stale_rebuild_folder_is_removed_when_the_runner_opens(
    local_settings: Settings, hashed_provider: Any
) -> None:
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        stored = await engine.store("kept across the killed rebuild", "alice")
    shards = local_settings.data_path / "shards"
    live = shards / f"p{stored.token.partition}"
    stale = [shards / "p0.rebuild", shards / "p3.rebuild", live / "lexical.retired"]
    for folder in stale:
        (folder / "graph").mkdir(parents=True)
        (folder / "graph" / "junk").write_bytes(b"half-written")
    async with await MemoryEngine.open(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        assert not [folder for folder in stale if folder.exists()]
        await engine.rebuild()
        results = (await engine.retrieve("killed rebuild", "alice")).results
        assert [r.event_id for r in results] == [stored.event_id]
    assert sorted(p.name for p in shards.iterdir() if ".rebuild" in p.name) == []


def test_a_model_moved_aside_by_a_killed_swap_goes_back_in_place(tmp_path: Path) -> None:
    shard = tmp_path / "shards" / "p2"
    (shard / "graph.retired").mkdir(parents=True)
    (shard / "graph.retired" / "graph.sqlite3").write_bytes(b"the old model")
    (shard / "vector").mkdir()
    assert remove_stale_staging(tmp_path) == [shard / "graph.retired"]
    assert (shard / "graph" / "graph.sqlite3").read_bytes() == b"the old model"
    assert sorted(p.name for p in shard.iterdir()) == ["graph", "vector"]


# -- 9: validation gaps at the HTTP edge ----------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"user_id": "alice", "content": ""}, "content must have a visible character"),
        ({"user_id": "alice", "content": "  \n\t "}, "content must have a visible character"),
        ({"user_id": "alice", "content": []}, "content must have a visible character"),
        # Invisible or control characters alone: they came back as results, and into bundles.
        ({"user_id": "alice", "content": "\u200b"}, "content must have a visible character"),
        ({"user_id": "alice", "content": "\x00"}, "content must have a visible character"),
        ({"user_id": "alice", "content": "\ufeff\u200d\u2060 "}, "content must have a visible"),
        ({"user_id": "alice", "content": [{}]}, "content must have a visible character"),
        ({"user_id": "alice", "content": [{"type": "text"}]}, "content must have a visible"),
        (
            {"user_id": "alice", "content": [{"type": "text", "text": "\u200b"}]},
            "content must have a visible character",
        ),
        ({"user_id": "a\x00b", "content": "x"}, "$.user_id"),
        ({"user_id": "", "content": "x"}, "$.user_id"),
        ({"user_id": "alice", "content": "x", "session_id": ""}, "$.session_id"),
    ],
)
async def test_bad_store_values_are_400_naming_the_field_and_write_nothing(
    http: httpx.AsyncClient, engine: MemoryEngine, body: dict[str, Any], named: str
) -> None:
    before = await log_size(engine)
    response = await http.post("/v1/memories", json=body, headers=ADMIN)
    assert response.status_code == 400, response.text
    assert named in response.json()["detail"]
    assert "$.owner" not in response.json()["detail"]
    assert await log_size(engine) == before


async def test_empty_content_is_refused_by_the_engine_too(engine: MemoryEngine) -> None:
    before = await log_size(engine)
    for content in ("", "   ", "\u200b\x00", [{"type": "text", "text": "\u2060"}]):
        with pytest.raises(InvalidInput, match="content must have a visible character"):
            await engine.store(content, "alice")  # type: ignore[arg-type]
    assert await log_size(engine) == before


async def test_a_lone_surrogate_is_refused_naming_where_it_is(engine: MemoryEngine) -> None:
    before = await log_size(engine)
    with pytest.raises(InvalidInput, match=r"surrogates not allowed - at \$\.content$"):
        await engine.store("a\ud800b", "alice")
    with pytest.raises(InvalidInput, match=r"- at \$\.metadata"):
        await engine.store("fine", "alice", metadata={"k": ["x", "\udc00"]})
    assert await log_size(engine) == before


async def test_content_that_shows_something_is_stored(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """An image block needs no text; visible text between control characters counts."""
    image = [{"type": "image_url", "image_url": {"url": "https://example.org/cat.png"}}]
    for content in (image, "\x1b[31mred\x1b[0m", [{"type": "text", "text": "\u200bhi"}]):
        response = await http.post(
            "/v1/memories", json={"user_id": "alice", "content": content}, headers=ADMIN
        )
        assert response.status_code == 201, (content, response.text)


@pytest.mark.parametrize(
    ("fields", "named"),
    [({"top_k": 0}, "top_k"), ({"top_k": -3}, "top_k"), ({"token_budget": 0}, "token_budget")],
)
async def test_non_positive_retrieve_sizes_name_their_field(
    http: httpx.AsyncClient, engine: MemoryEngine, fields: dict[str, int], named: str
) -> None:
    response = await http.post(
        "/v1/retrieve", json={"user_id": "alice", "query": "x", **fields}, headers=ALICE
    )
    assert response.status_code == 400, response.text
    detail = response.json()["detail"]
    assert named in detail
    other = {"top_k", "token_budget"} - {named}
    assert not any(name in detail for name in other)
    with pytest.raises(InvalidInput, match=named):
        await engine.retrieve_request(RetrieveRequest(query="x", user_id="alice", **fields))


async def test_a_lone_surrogate_escape_is_reported_as_such(http: httpx.AsyncClient) -> None:
    body = b'{"user_id": "alice", "content": "\\ud800"}'
    response = await http.post(
        "/v1/memories", content=body, headers={**ALICE, "Content-Type": "application/json"}
    )
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert "surrogate" in detail and "truncated" not in detail


async def test_a_missing_body_is_reported_as_missing(http: httpx.AsyncClient) -> None:
    response = await http.post(
        "/v1/memories", headers={**ALICE, "Content-Type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["detail"] == "a JSON request body is required"


async def test_an_unsupported_method_is_405_with_allow(http: httpx.AsyncClient) -> None:
    for method, path, allowed in (
        ("TRACE", "/v1/health", {"GET"}),
        ("PUT", "/v1/memories", {"POST"}),
        ("TRACE", "/metrics", {"GET"}),
    ):
        response = await http.request(method, path, headers=ALICE)
        assert response.status_code == 405, (method, path)
        assert response.json()["error"] == "method_not_allowed"
        assert allowed <= {m.strip() for m in response.headers["allow"].split(",")}


async def test_health_and_ready_answer_head_like_get(http: httpx.AsyncClient) -> None:
    """From a new-user trial: HEAD /v1/health answered 405 (load balancers and uptime
    checks use HEAD)."""
    for path in ("/v1/health", "/v1/ready"):
        got, headed = await http.get(path), await http.head(path)
        assert headed.status_code == got.status_code, path
        assert headed.content == b""


# -- 6: the OpenAPI document describes the service -------------------------------------------


async def test_openapi_document_states_errors_and_constraints(http: httpx.AsyncClient) -> None:
    document = (await http.get("/schema/openapi.json")).json()
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorBody"]["required"]) == {"error", "detail"}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            open_routes = ("/v1/health", "/v1/ready", "/v1/status", "/v1/cluster")
            if path == "/v1/cluster/wait":  # node to node, by the cluster secret
                for status in ("400", "401", "413", "503", "504"):
                    assert status in responses, (method, path, status)
            elif path.startswith("/v1/") and path not in open_routes:
                for status in ("400", "401", "403", "404", "413", "503", "504"):
                    assert status in responses, (method, path, status)
            for status, response in responses.items():
                if status.startswith(("4", "5")) and (path, status) != ("/v1/ready", "503"):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorBody"), (method, path, status)
    store = schemas["StoreRequest"]
    assert store["additionalProperties"] is False
    assert store["properties"]["user_id"]["minLength"] == 1
    assert "pattern" in store["properties"]["user_id"]
    retrieve = schemas["RetrieveRequest"]
    assert retrieve["properties"]["top_k"]["minimum"] == 1
    assert retrieve["properties"]["token_budget"]["minimum"] == 1
    history = {p["name"]: p for p in document["paths"]["/v1/history"]["get"]["parameters"]}
    assert history["limit"]["schema"]["oneOf"][0].get("minimum") == 1 or (
        history["limit"]["schema"].get("minimum") == 1
    )
    assert "pattern" in str(history["after"]["schema"])


# -- found by schemathesis -------------------------------------------------------------------


async def test_every_credential_presented_must_hold(http: httpx.AsyncClient) -> None:
    params = {"user_id": "alice"}
    for headers in (
        {"Authorization": "", "X-API-Key": "key-alice"},
        {"Authorization": "Bearer key-alice", "X-API-Key": "nope"},
        {"Authorization": "Bearer key-alice", "X-API-Key": "key-admin"},
        {"X-API-Key": " "},
    ):
        response = await http.get("/v1/history", params=params, headers=headers)
        assert response.status_code == 401, (headers, response.text)
    same = {"Authorization": "Bearer key-alice", "X-API-Key": "key-alice"}
    assert (await http.get("/v1/history", params=params, headers=same)).status_code == 200
    twice = [("Authorization", "Bearer key-alice"), ("Authorization", "Bearer key-admin")]
    response = await http.get("/v1/history", params=params, headers=twice)
    assert response.status_code == 401
    assert (
        response.json()["detail"] == "the authorization header is sent twice, with different values"
    )


async def test_top_k_is_bounded_and_a_huge_history_limit_reads_everything(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    body = {"user_id": "alice", "query": "x", "top_k": 4398046511104}
    response = await http.post("/v1/retrieve", json=body, headers=ALICE)
    assert response.status_code == 400 and "$.top_k" in response.json()["detail"]
    with pytest.raises(InvalidInput, match="top_k"):
        await engine.retrieve_request(RetrieveRequest(query="x", user_id="alice", top_k=1001))
    await engine.store("one", "alice")
    params = {"user_id": "alice", "limit": str(2**70)}
    history = await http.get("/v1/history", params=params, headers=ALICE)
    assert history.status_code == 200 and [m["content"] for m in history.json()] == ["one"]


async def test_numbers_the_log_cannot_store_are_refused_naming_the_field(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    before = await log_size(engine)
    for body, named in (
        ({"metadata": {"n": 2**64}}, "$.metadata.n"),
        ({"fields": {"a": [1, -(2**63) - 1]}}, "$.fields.a[1]"),
        ({"tool_calls": [{"x": 1e300}], "content": ""}, "$.tool_calls[0].x"),
    ):
        response = await http.post(
            "/v1/memories", json={"user_id": "alice", "content": "c", **body}, headers=ALICE
        )
        assert response.status_code == 400, response.text
        assert named in response.json()["detail"]
    assert await log_size(engine) == before


async def test_a_write_of_more_records_than_the_limit_is_refused_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """The bound moved from ``append_items`` (which the bulk ingest now calls with larger
    batches) to ``append_records``, the write requests' path: it still holds there."""
    from prme.producers.local_log import LocalLogTransport
    from prme.schemas.config import LimitsSettings

    transport = LocalLogTransport(tmp_path / "log.sqlite3", 2)
    await transport.start()
    try:
        producer = Producer(transport, LimitsSettings(max_batch_records=3))
        records = [
            producer.build_message(MessageDraft(owner="alice", content=f"m{i}")) for i in range(4)
        ]
        with pytest.raises(
            InvalidInput, match="a write of 4 messages exceeds limits.max_batch_records=3"
        ):
            await producer.append_records(records)
        assert sum((await transport.end_offsets()).values()) == 0
        assert len(await producer.append_records(records[:3])) == 3
        # A replacement of 3 messages adds its clear marker: the caller sent 3 (a new-user
        # trial found a replace of exactly the limit refused as "1001 records").
        drafts = [MessageDraft(owner="alice", content=f"r{i}") for i in range(3)]
        replacement = producer.build_replacement("alice", "default", "default", drafts)
        assert len(replacement) == 4
        assert len(await producer.append_records(replacement)) == 4
    finally:
        await transport.close()


async def test_a_body_nested_too_deeply_is_400_and_writes_nothing(
    http: httpx.AsyncClient, engine: MemoryEngine
) -> None:
    """Found in this round's review: a deeply nested body answered 500 (RecursionError)."""
    before = await log_size(engine)
    nested = "[" * 5000 + "]" * 5000
    body = f'{{"user_id": "alice", "content": "x", "metadata": {{"m": {nested}}}}}'
    response = await http.post(
        "/v1/memories", content=body, headers={**ALICE, "Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert "nested too deeply" in response.json()["detail"]
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InvalidInput, match="nested too deeply"):
        await engine.store("x", "alice", metadata={"m": deep})
    assert await log_size(engine) == before


def test_empty_metadata_is_held_to_a_metadata_limit_under_its_two_bytes() -> None:
    """Found in this round's review: the fast path for ``{}`` skipped the size check."""
    from prme.producers.local_log import LocalLogTransport
    from prme.schemas.config import LimitsSettings

    producer = Producer(
        LocalLogTransport(Path("/nonexistent/log.sqlite3"), 1), LimitsSettings(max_metadata_bytes=1)
    )
    with pytest.raises(InvalidInput, match="metadata is 2 bytes, over the limit of 1"):
        producer.build_message(MessageDraft(owner="alice", content="x"))


def test_a_write_fingerprint_ignores_what_the_producer_stamps_and_key_order() -> None:
    producer = Producer(LocalLogTransport(":memory:", 1))
    draft = MessageDraft(owner="alice", content="x", request_id="r", metadata={"a": 1, "b": 2})
    first = log_item(producer.build_message(draft))
    reordered = msgspec.structs.replace(draft, metadata={"b": 2, "a": 1})
    again = log_item(producer.build_message(reordered))  # a new recorded_at
    assert first.fingerprint is not None and again.fingerprint == first.fingerprint
    for change in ({"content": "y"}, {"session_id": "s2"}, {"metadata": {"a": 1}}):
        other = log_item(producer.build_message(msgspec.structs.replace(draft, **change)))
        assert other.fingerprint != first.fingerprint
    assert (
        log_item(producer.build_message(MessageDraft(owner="a", content="x"))).fingerprint is None
    )


@pytest.mark.parametrize(
    ("owner", "request_id"), [("alice", "r1"), ("alice", "a\x1fb"), ("a\x1fx", "y"), ("o", "")]
)
def test_a_dedupe_key_splits_back_into_its_owner_and_request_id(
    owner: str, request_id: str
) -> None:
    assert split_dedupe_key(dedupe_key(owner, request_id)) == (owner, request_id)


async def test_a_conflict_names_the_request_id_as_sent(engine: MemoryEngine) -> None:
    """Found in review: a request id holding a unit separator was split at the wrong one.
    Such an id is refused now (no control characters in ids); one with a separator-like
    visible character is named as sent."""
    with pytest.raises(InvalidInput, match=r"an id without control characters.*request_id"):
        await engine.store("one", "alice", request_id="a\x1fb")
    await engine.store("one", "alice", request_id="a\u241fb")
    with pytest.raises(InvalidInput, match="request_id 'a\u241fb' of owner 'alice'"):
        await engine.store("two", "alice", request_id="a\u241fb")


async def test_a_replacement_changed_anywhere_is_a_new_replacement_not_a_conflict(
    engine: MemoryEngine,
) -> None:
    """Found in review: a replacement whose message without a request id changed only its
    time (or whose message with one changed its content) answered 409, naming a derived
    ``replace:<hash>:<i>`` id the caller never sent."""
    from datetime import UTC, datetime

    def drafts(day: int, first: str) -> list[MessageDraft]:
        return [
            MessageDraft(owner="alice", session_id="s1", content=first, request_id="m0"),
            MessageDraft(
                owner="alice",
                session_id="s1",
                content="yo",
                occurred_at=datetime(2024, 1, day, tzinfo=UTC),
            ),
        ]

    first = await engine.replace_history("alice", "s1", drafts(1, "hi"))
    assert [r.event_id for r in await engine.replace_history("alice", "s1", drafts(1, "hi"))] == [
        r.event_id for r in first
    ]
    for day, text in ((2, "hi"), (2, "hello")):
        again = await engine.replace_history("alice", "s1", drafts(day, text))
        history = await engine.history("alice", "s1", after=again[-1].token)
        assert [(m.content, m.occurred_at) for m in history] == [
            (text, None),
            ("yo", datetime(2024, 1, day, tzinfo=UTC)),
        ]
