"""Append-only history through the adapters: clear, replacement and deletion append
versioned control events; originals stay readable; control events never become nodes or
retrieval results; history is isolated by owner, session and exact scope."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from llama_index.core.llms import ChatMessage  # noqa: E402

from prme import MemoryClient, MessageDraft  # noqa: E402
from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever  # noqa: E402
from prme.integrations.llamaindex import PRMEChatStore  # noqa: E402
from prme.schemas.records import SCHEMA_VERSION, HistoryReplaced  # noqa: E402


def _history(client: MemoryClient, session: str = "s", **options: str) -> PRMEChatMessageHistory:
    return PRMEChatMessageHistory(client=client, user_id="alice", session_id=session, **options)


def _retrieved_event_ids(client: MemoryClient, query: str) -> list[str]:
    return [
        d.metadata["event_id"] for d in PRMERetriever(client=client, user_id="alice").invoke(query)
    ]


def _draft(text: str) -> MessageDraft:
    return MessageDraft(owner="alice", session_id="s", content=text)


def test_clear_keeps_originals_readable_and_retrievable(client: MemoryClient) -> None:
    history = _history(client)
    history.add_messages([HumanMessage("Alice owns a red kayak."), AIMessage("Noted.")])
    originals = client.history("alice", "s")
    history.clear()
    assert history.messages == []
    for message in originals:
        event = client.get_event(message.event_id, "alice")
        assert event.kind == "message" and event.record.content == message.content
        assert client.get_event_nodes(message.event_id, "alice") == [f"mem:{message.event_id}"]
    # The memory derived from a cleared message is still found; no control event is.
    found = _retrieved_event_ids(client, "red kayak")
    assert found[0] == originals[0].event_id
    assert {client.get_event(e, "alice").kind for e in found} == {"message"}


def test_clear_is_a_versioned_control_event_without_nodes(client: MemoryClient) -> None:
    _history(client).add_messages([HumanMessage("Alice owns a red kayak.")])
    cleared = client.clear_history("alice", "s")
    assert cleared.node_ids == []
    event = client.get_event(cleared.event_id, "alice")
    assert (event.kind, event.node_ids, event.record.v) == ("history_cleared", [], SCHEMA_VERSION)
    assert (event.session_id, event.scope) == ("s", "default")
    assert cleared.event_id not in _retrieved_event_ids(client, "red kayak history cleared")


def test_replacement_appends_a_marker_and_keeps_the_replaced(client: MemoryClient) -> None:
    store = PRMEChatStore(client=client)
    store.set_messages("alice:s", [ChatMessage(role="user", content="Alice sails on Sundays.")])
    replaced = client.history("alice", "s")[0]
    store.set_messages("alice:s", [ChatMessage(role="user", content="Alice rows on Mondays.")])
    assert [m.content for m in store.get_messages("alice:s")] == ["Alice rows on Mondays."]
    assert client.get_event(replaced.event_id, "alice").record.content == replaced.content
    assert replaced.event_id in _retrieved_event_ids(client, "sails Sundays")

    results = client.replace_history("alice", "s", [_draft("Alice swims.")])
    marker = client.get_event(results[0].event_id, "alice")
    assert marker.kind == "history_replaced" and marker.node_ids == []
    assert isinstance(marker.record, HistoryReplaced) and marker.record.message_count == 1
    assert marker.record.v == SCHEMA_VERSION
    assert results[1].node_ids == [f"mem:{results[1].event_id}"]
    assert results[0].event_id not in _retrieved_event_ids(client, "Alice swims")


def test_deletion_does_not_archive_until_the_explicit_lifecycle_path(
    client: MemoryClient,
) -> None:
    store = PRMEChatStore(client=client)
    store.set_messages(
        "alice:s",
        [
            ChatMessage(role="user", content="My locker code is 4312."),
            ChatMessage(role="assistant", content="Saved."),
        ],
    )
    secret = client.history("alice", "s")[0]
    assert store.delete_message("alice:s", 0) is not None
    assert [m.content for m in store.get_messages("alice:s")] == ["Saved."]
    # Deletion changes the chat history only: the message and its memory remain.
    assert client.get_event(secret.event_id, "alice").record.content == secret.content
    assert secret.event_id in _retrieved_event_ids(client, "locker code")

    deleted = client.delete_message("alice", secret.event_id)
    marker = client.get_event(deleted.event_id, "alice")
    assert (marker.kind, marker.node_ids) == ("message_deleted", [])
    assert marker.record.target_event_id == secret.event_id

    # The application removes the memory from retrieval explicitly.
    for node_id in client.get_event_nodes(secret.event_id, "alice"):
        client.archive(node_id, "alice", reason="user deleted the message")
    assert secret.event_id not in _retrieved_event_ids(client, "locker code")
    assert client.get_event(secret.event_id, "alice").kind == "message"


def test_history_is_isolated_by_owner_session_and_exact_scope(client: MemoryClient) -> None:
    base = _history(client)
    others = {
        "other owner": PRMEChatMessageHistory(client=client, user_id="bob", session_id="s"),
        "other session": _history(client, session="t"),
        "other scope": _history(client, scope="work"),
        "scope differing in case": _history(client, scope="Default"),
    }
    base.add_messages([HumanMessage("in the base history")])
    for name, history in others.items():
        history.add_messages([HumanMessage(name)])
    assert base.messages == [HumanMessage("in the base history")]
    for name, history in others.items():
        assert history.messages == [HumanMessage(name)]
    others["other scope"].clear()
    assert others["other scope"].messages == []
    assert base.messages == [HumanMessage("in the base history")]
    assert others["scope differing in case"].messages == [HumanMessage("scope differing in case")]
