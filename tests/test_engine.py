"""The embedded engine end to end: writes, retrieval, lifecycle, isolation, control events."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from prme import MemoryEngine, MessageDraft
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.schemas.config import Settings
from prme.schemas.errors import InvalidInput, NotFound


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    yield engine
    await engine.close()


def texts(response: Any) -> list[str]:
    return [r.text for r in response.results]


async def test_a_stored_memory_is_retrievable_at_once(engine: MemoryEngine) -> None:
    await engine.store("Aurora needs approval before deployment.", "alice")
    response = await engine.retrieve("Aurora deployment approval", "alice")
    assert texts(response)[0] == "Aurora needs approval before deployment."
    assert "Aurora needs approval before deployment." in response.bundle.render()


async def test_retrieval_never_returns_another_owners_memories(engine: MemoryEngine) -> None:
    await engine.store("Alice's secret is the blue door.", "alice")
    await engine.store("Bob's secret is the blue door too.", "bob")
    assert texts(await engine.retrieve("secret blue door", "alice")) == [
        "Alice's secret is the blue door."
    ]


async def test_scope_limits_retrieval_to_that_scope(engine: MemoryEngine) -> None:
    await engine.store("Work laptop is a ThinkPad.", "alice", scope="work")
    await engine.store("Home laptop is a MacBook.", "alice", scope="home")
    assert texts(await engine.retrieve("laptop", "alice", scope="work")) == [
        "Work laptop is a ThinkPad."
    ]
    assert len((await engine.retrieve("laptop", "alice")).results) == 2


async def test_receipt_says_how_each_result_was_found(engine: MemoryEngine) -> None:
    await engine.store("Caroline went to the LGBTQ support group on 7 May.", "alice")
    response = await engine.retrieve("Caroline support group", "alice")
    receipt = response.receipt
    assert receipt.owner == "alice" and receipt.query == "Caroline support group"
    expected = {"vector", "lexical"} | ({"graph"} if engine.settings.scoring.graph else set())
    assert {c.name for c in receipt.channels} == expected
    assert all(c.used and c.error is None and c.ms >= 0 for c in receipt.channels)
    first = receipt.results[0]
    assert set(first.ranks) == expected
    assert first.ranks["lexical"] == 1 and first.scores["lexical"] > 0
    assert first.in_bundle and first.tokens > 0
    assert first.semantic_relevance == pytest.approx(response.results[0].semantic_relevance)
    assert receipt.embedding.model_name == engine.provider.model_name
    assert receipt.embedding.dimension == engine.provider.dimension
    assert receipt.embedding.embed_query_used is False
    assert receipt.embedding.query_precision is None  # the hashed provider does not say
    assert receipt.request_id and receipt.elapsed_ms > 0


async def test_an_unwrapped_provider_embeds_queries_on_its_interactive_path(
    local_settings: Settings,
) -> None:
    class Interactive(HashedBagOfWordsProvider):
        def __init__(self) -> None:
            super().__init__(dimension=16)
            self.interactive: list[list[str]] = []

        async def embed_interactive(self, texts: list[str]) -> list[list[float]]:
            self.interactive.append(list(texts))
            return await self.embed(texts)

    provider = Interactive()
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=provider)
    try:
        await engine.store("green tea every morning", "alice")
        response = await engine.retrieve("green tea", "alice")
    finally:
        await engine.close()
    assert provider.interactive == [["green tea"]]
    assert texts(response) == ["green tea every morning"]
    assert response.results[0].semantic_relevance is not None


async def test_min_score_is_an_inclusive_floor_on_semantic_relevance(engine: MemoryEngine) -> None:
    await engine.store("green tea every morning", "alice")
    await engine.store("green tea", "alice")
    await engine.store("the train leaves at noon", "alice")
    everything = await engine.retrieve("green tea", "alice")
    cosines = {r.text: r.semantic_relevance for r in everything.results}
    assert all(c is not None for c in cosines.values())
    floor = cosines["green tea every morning"]
    kept = await engine.retrieve("green tea", "alice", min_score=floor)
    assert set(texts(kept)) == {t for t, c in cosines.items() if c is not None and c >= floor}
    assert "green tea every morning" in texts(kept)
    assert not kept.receipt.min_score_skipped
    assert all("min_score_skipped" not in r.metadata for r in kept.results)


async def test_min_score_under_weighted_fusion_floors_the_composite(engine: MemoryEngine) -> None:
    await engine.store("green tea every morning", "alice")
    await engine.store("the train leaves at noon", "alice")
    everything = await engine.retrieve("green tea", "alice", fusion="weighted")
    best = everything.results[0]
    kept = await engine.retrieve("green tea", "alice", fusion="weighted", min_score=best.score)
    assert [r.node_id for r in kept.results] == [best.node_id]


async def test_archived_memories_leave_retrieval_until_restored(engine: MemoryEngine) -> None:
    stored = await engine.store("The Aurora launch is on Friday.", "alice")
    node_id = stored.node_ids[0]
    await engine.archive(node_id, "alice")
    assert texts(await engine.retrieve("Aurora launch", "alice")) == []
    assert texts(await engine.retrieve("Aurora launch", "alice", include_archived=True)) == [
        "The Aurora launch is on Friday."
    ]
    await engine.restore(node_id, "alice")
    assert texts(await engine.retrieve("Aurora launch", "alice")) == [
        "The Aurora launch is on Friday."
    ]


async def test_superseded_memory_gives_way_to_its_replacement(engine: MemoryEngine) -> None:
    old = await engine.store("The Aurora launch is on Friday.", "alice")
    new = await engine.store("The Aurora launch moved to Monday.", "alice")
    await engine.supersede(old.node_ids[0], new.node_ids[0], "alice")
    assert texts(await engine.retrieve("Aurora launch", "alice")) == [
        "The Aurora launch moved to Monday."
    ]


async def test_a_question_about_yesterday_prefers_what_happened_yesterday(
    engine: MemoryEngine,
) -> None:
    """Dates relative to the time asked are read too; a memory stored without occurred_at
    is dated by when it was recorded."""
    now = datetime.now(UTC)
    yesterday = await engine.store(
        "I went hiking with Ana.", "alice", occurred_at=now - timedelta(days=1)
    )
    weeks_ago = await engine.store(
        "I went hiking with Ana.", "alice", occurred_at=now - timedelta(days=30)
    )
    response = await engine.retrieve("Where did I go hiking yesterday?", "alice")
    assert [r.event_id for r in response.results] == [yesterday.event_id, weeks_ago.event_id]
    assert [d["text"] for d in response.receipt.analysis["dates"]] == ["yesterday"]
    assert set(response.receipt.analysis["boosts"]) == set(yesterday.node_ids)
    recorded_now = await engine.store("I went hiking with Ana.", "alice")
    # No slack after a relative span (a review: "last week" boosted this week's memories too).
    last_week = await engine.retrieve("Where did I go hiking last week?", "alice")
    assert not set(last_week.receipt.analysis["boosts"]) & set(recorded_now.node_ids)
    today = await engine.retrieve("Where did I go hiking today?", "alice")
    assert today.results[0].event_id == recorded_now.event_id
    assert set(today.receipt.analysis["boosts"]) >= set(recorded_now.node_ids)
    assert not set(today.receipt.analysis["boosts"]) & set(weeks_ago.node_ids)


async def test_another_owners_event_or_node_is_as_good_as_unknown(engine: MemoryEngine) -> None:
    stored = await engine.store("Alice's plan.", "alice", request_id="plan-1")
    await engine.store("Bob's plan.", "bob")
    with pytest.raises(NotFound) as refused:
        await engine.get_event(stored.event_id, "bob")
    with pytest.raises(NotFound) as unknown:
        await engine.get_event("01a22b27-0000-7000-8000-000000000000", "bob")
    # The same answer: bob cannot tell whether alice sent request "plan-1".
    assert str(refused.value).replace(stored.event_id, "X") == str(unknown.value).replace(
        "01a22b27-0000-7000-8000-000000000000", "X"
    )
    with pytest.raises(NotFound):
        await engine.archive(stored.node_ids[0], "bob")
    with pytest.raises(NotFound):
        await engine.get_event("01a22b27-0000-7000-8000-000000000000", "alice")
    assert texts(await engine.retrieve("plan", "alice")) == ["Alice's plan."]


async def test_event_provenance_names_the_derived_node(engine: MemoryEngine) -> None:
    stored = await engine.store("Use dark mode.", "alice", session_id="s1")
    event = await engine.get_event(stored.event_id, "alice")
    assert event.kind == "message" and event.record.content == "Use dark mode."
    assert await engine.get_event_nodes(stored.event_id, "alice") == stored.node_ids


async def test_clearing_history_keeps_memories_retrievable(engine: MemoryEngine) -> None:
    await engine.store("I prefer window seats.", "alice", session_id="s1")
    cleared = await engine.clear_history("alice", "s1")
    assert await engine.history("alice", "s1") == []
    assert texts(await engine.retrieve("window seats", "alice")) == ["I prefer window seats."]
    control = await engine.get_event(cleared.event_id, "alice")
    assert control.kind == "history_cleared" and control.node_ids == []


async def test_control_events_never_become_documents(engine: MemoryEngine) -> None:
    first = await engine.store("one", "alice", session_id="s1")
    await engine.store("two", "alice", session_id="s1")
    await engine.delete_message("alice", first.event_id)
    await engine.clear_history("alice", "s1")
    await engine.replace_history(
        "alice", "s1", [MessageDraft(owner="alice", session_id="s1", content="three")]
    )
    shard = await engine.runner.shard_for("alice")
    vector, lexical, graph = (shard.models[n] for n in ("vector", "lexical", "graph"))
    assert vector.count("alice") == 3  # type: ignore[attr-defined]
    assert sorted(d.text for d in lexical.documents() if d.owner == "alice") == [
        "one",
        "three",
        "two",
    ]  # type: ignore[attr-defined]
    nodes = await engine.get_nodes([f"mem:{first.event_id}"], "alice")
    assert nodes[f"mem:{first.event_id}"].state == "active"
    assert [m.content for m in await engine.history("alice", "s1")] == ["three"]


async def test_erasing_an_owner_removes_every_trace_of_that_owner_only(
    engine: MemoryEngine,
) -> None:
    stored = await engine.store("Alice's diary entry.", "alice", session_id="s1")
    await engine.store("Bob's diary entry.", "bob", session_id="s1")
    await engine.erase_owner("alice")
    assert texts(await engine.retrieve("diary entry", "alice", include_archived=True)) == []
    assert await engine.history("alice", "s1") == []
    with pytest.raises(NotFound):
        await engine.get_event(stored.event_id, "alice")
    assert texts(await engine.retrieve("diary entry", "bob")) == ["Bob's diary entry."]


async def test_bad_input_raises_and_writes_nothing(engine: MemoryEngine) -> None:
    before = await engine.runner.transport.end_offsets()
    for content, owner, options in [
        ("x", "", {}),
        ("x", "alice", {"role": "robot"}),
        ("x" * 70_000, "alice", {}),
        ("x", "alice", {"metadata": {"when": object()}}),
    ]:
        with pytest.raises(InvalidInput):
            await engine.store(content, owner, **options)
    with pytest.raises(InvalidInput):
        await engine.retrieve("", "alice")
    assert await engine.runner.transport.end_offsets() == before


async def test_a_retried_write_with_the_same_request_id_is_stored_once(
    engine: MemoryEngine,
) -> None:
    first = await engine.store("Pay the invoice.", "alice", request_id="req-1")
    again = await engine.store("Pay the invoice.", "alice", request_id="req-1")
    assert again.token == first.token
    assert (again.event_id, again.node_ids) == (first.event_id, first.node_ids)
    assert texts(await engine.retrieve("invoice", "alice")) == ["Pay the invoice."]
    await engine.archive(again.node_ids[0], "alice")  # the ids the retry got are real
    assert texts(await engine.retrieve("invoice", "alice")) == []
    other = await engine.store("Pay the invoice.", "bob", request_id="req-1")
    assert other.event_id != first.event_id  # request ids are per owner


async def test_a_retried_replacement_whose_messages_have_request_ids_changes_nothing(
    engine: MemoryEngine,
) -> None:
    await engine.add_messages(
        "alice", "s1", [MessageDraft(owner="alice", session_id="s1", content="old")]
    )
    drafts = [
        MessageDraft(owner="alice", session_id="s1", content=f"new {i}", request_id=f"n{i}")
        for i in range(2)
    ]
    first = await engine.replace_history("alice", "s1", drafts)
    again = await engine.replace_history("alice", "s1", drafts)  # the marker too: one event
    assert [r.event_id for r in again] == [r.event_id for r in first]
    assert [m.content for m in await engine.history("alice", "s1")] == ["new 0", "new 1"]
    # A message without a request id in it: the retry is still the same events.
    mixed = [*drafts, MessageDraft(owner="alice", session_id="s1", content="no id")]
    for _ in range(2):
        await engine.replace_history("alice", "s1", mixed)
    assert [m.content for m in await engine.history("alice", "s1")] == ["new 0", "new 1", "no id"]
    # Another replacement repeating the request ids: its messages are written anew.
    grown = [
        *drafts,
        MessageDraft(owner="alice", session_id="s1", content="new 2", request_id="n2"),
    ]
    await engine.replace_history("alice", "s1", grown)
    assert [m.content for m in await engine.history("alice", "s1")] == ["new 0", "new 1", "new 2"]
    await engine.replace_history("alice", "s1", [])  # a clear: no request id, always applied
    assert await engine.history("alice", "s1") == []


async def test_bundle_packs_to_the_token_budget_edge(engine: MemoryEngine) -> None:
    await engine.store("alpha beta gamma delta", "alice")
    full = await engine.retrieve("alpha", "alice")
    cost = full.receipt.results[0].tokens
    exact = await engine.retrieve("alpha", "alice", token_budget=cost)
    assert [i.text for i in exact.bundle.items] == ["alpha beta gamma delta"]
    assert exact.bundle.tokens_used == cost
    short = await engine.retrieve("alpha", "alice", token_budget=cost - 1)
    assert short.bundle.items == [] and short.bundle.omitted == [full.results[0].node_id]
    assert short.receipt.results[0].in_bundle is False


async def test_the_callers_settings_are_not_modified(
    local_settings: Settings, hashed_provider: Any
) -> None:
    snapshot = local_settings.replace()
    async with await MemoryEngine.create(
        settings=local_settings, embedding_provider=hashed_provider
    ) as engine:
        assert engine.embedding_config.dimension == hashed_provider.dimension
    assert local_settings == snapshot


async def test_a_message_without_text_is_never_a_retrieved_memory(engine: MemoryEngine) -> None:
    """A tool-call-only turn or an image-only message is in the history, but a memory
    with no text answers no query: it used to fill unrelated recalls as a blank line."""
    await engine.store_many(
        [
            MessageDraft(
                owner="alice",
                session_id="s1",
                role="assistant",
                content="",
                tool_calls=[{"id": "c1", "name": "lookup", "args": {"q": "weather"}}],
            ),
            MessageDraft(
                owner="alice",
                session_id="s1",
                content=[{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}],
            ),
            MessageDraft(owner="alice", session_id="s1", content="The harbour opens at nine."),
        ]
    )
    assert len(await engine.history("alice", "s1")) == 3
    for query in ("harbour", "something unrelated entirely", "weather lookup"):
        found = await engine.retrieve(query, "alice", top_k=10)
        assert [r.text for r in found.results] == ["The harbour opens at nine."], query


async def test_an_unknown_node_is_named_as_a_node_not_an_event(engine: MemoryEngine) -> None:
    """Found by a new-user trial: archiving ``mem:nothing`` answered "no event nothing"."""
    for act in (engine.archive, engine.restore):
        with pytest.raises(NotFound) as missing:
            await act("mem:nothing", user_id="alice")
        assert str(missing.value) == "no node mem:nothing for owner alice"
