"""The contract of ``MemoryBackend``: every public method, errors included.

``tests/test_backends_contract.py`` runs it against the embedded ``MemoryEngine`` and
against ``HttpMemoryBackend`` talking to the service over ASGI: the same calls must give
the same results and raise the same exceptions."""

from __future__ import annotations

import math

import pytest

from prme.producers.producer import MessageDraft
from prme.query.backend import MemoryBackend
from prme.query.http_types import RetrieveRequest
from prme.schemas.errors import InvalidInput, NotFound, RequestIdConflict
from prme.schemas.records import Message

UNKNOWN_EVENT = "01900000-0000-7000-8000-000000000000"


async def found_ids(backend: MemoryBackend, query: str, include_archived: bool = False) -> set[str]:
    response = await backend.retrieve(query, "alice", include_archived=include_archived)
    return {r.node_id for r in response.results}


class MemoryBackendContract:
    """Subclasses provide a ``backend`` fixture: a MemoryBackend that may act for any owner."""

    async def test_a_stored_memory_is_retrievable_with_its_token(
        self, backend: MemoryBackend
    ) -> None:
        stored = await backend.store("I adopted a cat named Miso", "alice", session_id="s1")
        assert stored.node_ids == [f"mem:{stored.event_id}"]
        found = await backend.retrieve("cat Miso", "alice", after=stored.token)
        assert [r.event_id for r in found.results] == [stored.event_id]
        assert "Miso" in found.bundle.render()
        assert found.receipt.owner == "alice"
        again = await backend.retrieve_request(RetrieveRequest(query="cat Miso", user_id="alice"))
        assert [r.event_id for r in again.results] == [stored.event_id]

    async def test_retrieval_keeps_owners_apart(self, backend: MemoryBackend) -> None:
        await backend.store("bob keeps bees", "bob")
        assert (await backend.retrieve("bees", "alice")).results == []

    async def test_bad_retrieve_parameters_are_invalid_input(self, backend: MemoryBackend) -> None:
        with pytest.raises(InvalidInput, match="query"):
            await backend.retrieve("   ", "alice")
        with pytest.raises(InvalidInput, match="query"):
            await backend.retrieve("\u200b\u3164", "alice")
        with pytest.raises(InvalidInput, match="top_k"):
            await backend.retrieve("cat", "alice", top_k=0)
        with pytest.raises(InvalidInput, match="top_k"):
            await backend.retrieve("cat", "alice", top_k="5")  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="token_budget"):
            await backend.retrieve("cat", "alice", token_budget=None)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="max_query_bytes"):
            await backend.retrieve("cat " * 5000, "alice")

    async def test_nan_and_infinities_are_invalid_input_and_write_nothing(
        self, backend: MemoryBackend
    ) -> None:
        """JSON has no NaN or Infinity: over HTTP the encoder wrote ``null`` in their place,
        so a floor of ``inf`` was no floor at all and metadata stored ``None``."""
        stored = await backend.store("the coffee here is strong", "alice")
        for floor in (math.inf, -math.inf, math.nan):
            with pytest.raises(InvalidInput, match=r"finite.*min_score"):
                await backend.retrieve("coffee", "alice", min_score=floor, after=stored.token)
        for metadata in ({"x": math.inf}, {"y": [1.5, {"z": math.nan}]}):
            with pytest.raises(InvalidInput, match=r"not finite .* - at \$\.metadata\."):
                await backend.store("a measurement", "alice", metadata=metadata)
        with pytest.raises(InvalidInput, match="not finite"):
            await backend.store_many(
                [MessageDraft(owner="alice", content="m", metadata={"w": -math.inf})]
            )
        # From a review: these raised TypeError over HTTP and AttributeError in-process.
        with pytest.raises(InvalidInput):
            await backend.store("a measurement", "alice", metadata={"k": object()})
        for content in ([5], [None], [{"type": "text", "text": "hi"}, 5]):
            with pytest.raises(InvalidInput):
                await backend.store(content, "alice")  # type: ignore[arg-type]
        found = await backend.retrieve("measurement coffee m", "alice", min_score=-1.0)
        assert [r.text for r in found.results] == ["the coffee here is strong"]

    async def test_bad_owner_session_scope_and_event_ids_are_invalid_input(
        self, backend: MemoryBackend
    ) -> None:
        """Found by a new-user trial: embedded, ``history(user_id="")`` and a blank session
        answered ``[]`` and ``None`` raised AttributeError or TypeError, where the service
        answered 400; an empty event or node id was a 404 or 405 over HTTP."""
        stored = await backend.store("Miso is a cat", "alice", session_id="s1")
        node = stored.node_ids[0]
        calls = {
            "user_id": [
                lambda bad: backend.store("x", bad),
                lambda bad: backend.history(bad),
                lambda bad: backend.add_messages(bad, "s1", []),
                lambda bad: backend.clear_history(bad, "s1"),
                lambda bad: backend.replace_history(bad, "s1", []),
                lambda bad: backend.delete_message(bad, stored.event_id),
                lambda bad: backend.get_event(stored.event_id, bad),
                lambda bad: backend.get_event_nodes(stored.event_id, bad),
                lambda bad: backend.archive(node, bad),
                lambda bad: backend.restore(node, bad),
                lambda bad: backend.supersede(node, node, bad),
                lambda bad: backend.erase_owner(bad),
                lambda bad: backend.retrieve("cat", bad),
            ],
            "session_id": [
                lambda bad: backend.store("x", "alice", session_id=bad),
                lambda bad: backend.history("alice", bad),
                lambda bad: backend.add_messages("alice", bad, []),
                lambda bad: backend.clear_history("alice", bad),
                lambda bad: backend.replace_history("alice", bad, []),
            ],
            "scope": [
                lambda bad: backend.store("x", "alice", scope=bad),
                lambda bad: backend.history("alice", "s1", scope=bad),
                lambda bad: backend.add_messages("alice", "s1", [], scope=bad),
                lambda bad: backend.clear_history("alice", "s1", scope=bad),
                lambda bad: backend.replace_history("alice", "s1", [], scope=bad),
            ],
            "event_id": [
                lambda bad: backend.get_event(bad, "alice"),
                lambda bad: backend.get_event_nodes(bad, "alice"),
                lambda bad: backend.delete_message("alice", bad),
            ],
            "node_id": [
                lambda bad: backend.archive(bad, "alice"),
                lambda bad: backend.restore(bad, "alice"),
                lambda bad: backend.supersede(bad, node, "alice"),
                lambda bad: backend.supersede(node, bad, "alice"),
            ],
        }
        bad_values: dict[str, list[object]] = {"user_id": ["", " alice ", "a\x00b", "*", None]}
        erase = calls["user_id"][11]
        for name, makes in calls.items():
            for bad in bad_values.get(name, ["", "x" * 257, None]):
                for index, make in enumerate(makes):
                    if bad == "*" and make is erase:
                        continue  # `*` is every owner only where API keys are: over HTTP

                    with pytest.raises(InvalidInput, match=name) as caught:
                        await make(bad)
                    assert type(caught.value) is InvalidInput, (name, bad, index)
        assert [m.content for m in await backend.history("alice", "s1")] == ["Miso is a cat"]

    async def test_a_batch_is_atomic_and_a_bad_draft_writes_nothing(
        self, backend: MemoryBackend
    ) -> None:
        batch = await backend.store_many(
            [MessageDraft(owner="alice", content=f"fact {i}") for i in range(3)]
        )
        assert len({r.event_id for r in batch}) == 3
        bad = [MessageDraft(owner="alice", content="kept out"), MessageDraft(owner="", content="x")]
        with pytest.raises(InvalidInput):
            await backend.store_many(bad)
        texts = [r.text for r in (await backend.retrieve("kept out", "alice")).results]
        assert "kept out" not in texts and len(texts) == 3

    async def test_a_request_id_reused_for_other_content_is_refused_and_writes_nothing(
        self, backend: MemoryBackend
    ) -> None:
        first = await backend.store("Pay the invoice.", "alice", request_id="req-9")
        retry = await backend.store("Pay the invoice.", "alice", request_id="req-9")
        assert retry.event_id == first.event_id
        with pytest.raises(RequestIdConflict, match="'req-9' of owner 'alice' was already used"):
            await backend.store("Pay the rent.", "alice", request_id="req-9")
        with pytest.raises(RequestIdConflict):
            await backend.store_many(
                [
                    MessageDraft(owner="alice", content="Water the plants."),
                    MessageDraft(owner="alice", content="Pay it twice.", request_id="req-9"),
                ]
            )
        found = await backend.retrieve("pay rent plants invoice", "alice", after=first.token)
        assert [r.text for r in found.results] == ["Pay the invoice."]

    async def test_chat_history_add_delete_replace_clear(self, backend: MemoryBackend) -> None:
        drafts = [
            MessageDraft(owner="alice", session_id="s1", content="hello", role="user"),
            MessageDraft(owner="alice", session_id="s1", content="hi!", role="assistant"),
        ]
        added = await backend.add_messages("alice", "s1", drafts)
        history = await backend.history("alice", "s1", after=added[-1].token)
        assert all(isinstance(m, Message) for m in history)
        assert [m.content for m in history] == ["hello", "hi!"]
        assert [m.content for m in await backend.history("alice", "s1", limit=1)] == ["hi!"]
        await backend.delete_message("alice", added[0].event_id)
        assert [m.content for m in await backend.history("alice", "s1")] == ["hi!"]
        fresh = [MessageDraft(owner="alice", session_id="s1", content="fresh start")]
        replaced = await backend.replace_history("alice", "s1", fresh)
        assert len(replaced) == 2 and replaced[0].node_ids == []
        assert [m.content for m in await backend.history("alice", "s1")] == ["fresh start"]
        await backend.clear_history("alice", "s1")
        assert await backend.history("alice", "s1") == []

    async def test_history_writes_of_another_history_are_refused(
        self, backend: MemoryBackend
    ) -> None:
        stray = [MessageDraft(owner="alice", session_id="other", content="x")]
        with pytest.raises(InvalidInput, match="belong to the history"):
            await backend.add_messages("alice", "s1", stray)
        with pytest.raises(InvalidInput, match="replacement messages"):
            await backend.replace_history("alice", "s1", stray)
        assert await backend.history("alice", "s1") == []

    async def test_events_and_their_nodes(self, backend: MemoryBackend) -> None:
        stored = await backend.store("Aurora ships on Friday", "alice")
        event = await backend.get_event(stored.event_id, "alice")
        assert event.kind == "message" and isinstance(event.record, Message)
        assert event.record.content == "Aurora ships on Friday"
        assert await backend.get_event_nodes(stored.event_id, "alice") == stored.node_ids
        with pytest.raises(NotFound):
            await backend.get_event(UNKNOWN_EVENT, "alice")
        with pytest.raises(NotFound):
            await backend.get_event_nodes(UNKNOWN_EVENT, "alice")
        with pytest.raises(NotFound):  # another owner's: as if unknown, nothing disclosed
            await backend.get_event(stored.event_id, "bob")

    async def test_deleting_a_control_event_is_invalid_input(self, backend: MemoryBackend) -> None:
        cleared = await backend.clear_history("alice", "s1")
        with pytest.raises(InvalidInput, match="not a message"):
            await backend.delete_message("alice", cleared.event_id)

    async def test_archive_restore_supersede(self, backend: MemoryBackend) -> None:
        old = await backend.store("Miso is a cat", "alice")
        node = old.node_ids[0]
        await backend.archive(node, "alice", reason="outdated")
        assert node not in await found_ids(backend, "Miso cat")
        assert node in await found_ids(backend, "Miso cat", include_archived=True)
        await backend.restore(node, "alice")
        assert node in await found_ids(backend, "Miso cat")
        newer = await backend.store("Miso the cat is now called Mochi", "alice")
        await backend.supersede(node, newer.node_ids[0], "alice")
        current = await found_ids(backend, "Miso cat")
        assert node not in current and newer.node_ids[0] in current

    async def test_a_supersede_cycle_and_an_overlong_reason_are_refused(
        self, backend: MemoryBackend
    ) -> None:
        """Found by a new-user trial: A superseded by B, then B by A, took both out of
        retrieval; an archive reason had no size bound."""
        first = (await backend.store("the boat is blue", "alice")).node_ids[0]
        second = (await backend.store("the boat is green now", "alice")).node_ids[0]
        await backend.supersede(first, second, "alice")
        with pytest.raises(InvalidInput, match="superseded"):
            await backend.supersede(second, first, "alice")
        with pytest.raises(InvalidInput, match="reason"):
            await backend.archive(second, "alice", reason="x" * 1025)
        assert await found_ids(backend, "boat") == {second}  # nothing was written
        await backend.archive(second, "alice", reason="x" * 1024)
        assert await found_ids(backend, "boat") == set()

    async def test_lifecycle_of_an_unknown_or_foreign_node_is_refused(
        self, backend: MemoryBackend
    ) -> None:
        unknown = f"mem:{UNKNOWN_EVENT}"
        for node_id in (unknown, "nope"):  # one wording, whatever the id looks like
            with pytest.raises(NotFound, match=f"^no node {node_id} for owner alice"):
                await backend.archive(node_id, "alice")
        with pytest.raises(NotFound):
            await backend.restore(unknown, "alice")
        bobs = await backend.store("bob keeps bees", "bob")
        with pytest.raises(NotFound):
            await backend.supersede(bobs.node_ids[0], bobs.node_ids[0], "alice")

    async def test_an_event_or_node_id_with_a_slash_is_invalid_input_both_ways(
        self, backend: MemoryBackend
    ) -> None:
        """A trial: over --url, MCP answered an id with a ``/`` as HTTP's bare "Not Found"
        (no route matched), in-process "no event a/b for owner alice"."""
        calls = (
            lambda: backend.get_event("a/b", "alice"),
            lambda: backend.get_event_nodes("a/b", "alice"),
            lambda: backend.delete_message("alice", "a/b"),
            lambda: backend.archive("mem:a/b", "alice"),
            lambda: backend.supersede("mem:x", "mem:a/b", "alice"),
        )
        for call in calls:
            with pytest.raises(InvalidInput, match="no `/`"):
                await call()

    async def test_erase_owner_removes_that_owner_only(self, backend: MemoryBackend) -> None:
        await backend.store("alice likes tea", "alice", session_id="s1")
        await backend.store("bob likes tea", "bob", session_id="s1")
        await backend.erase_owner("alice")
        assert await backend.history("alice", "s1") == []
        assert (await backend.retrieve("tea", "alice")).results == []
        assert [r.text for r in (await backend.retrieve("tea", "bob")).results] == ["bob likes tea"]
