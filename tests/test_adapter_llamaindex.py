"""The LlamaIndex adapters: retriever (NodeWithScore) and chat store (BaseChatStore
behaviours: keys, set/get/add, delete all/by index/last, async variants)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.llms import ChatMessage, MessageRole, TextBlock  # noqa: E402
from llama_index.core.retrievers import BaseRetriever  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.core.storage.chat_store.base import BaseChatStore  # noqa: E402

from prme import MemoryClient, MessageDraft  # noqa: E402
from prme.adapters.llamaindex import parse_key  # noqa: E402
from prme.integrations.llamaindex import PRMEChatStore, PRMERetriever  # noqa: E402
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider  # noqa: E402
from prme.schemas.errors import ConfigurationError  # noqa: E402

FACTS = [
    "Alice prefers dark mode in every editor.",
    "Alice prefers tea over coffee.",
    "Alice decided to move the launch to March.",
]


@pytest.fixture
def store(client: MemoryClient) -> Iterator[PRMEChatStore]:
    chat = PRMEChatStore(client=client)
    yield chat
    chat.close()


def _user(text: str, **extra: object) -> ChatMessage:
    return ChatMessage(role=MessageRole.USER, content=text, additional_kwargs=dict(extra))


def _assistant(text: str) -> ChatMessage:
    return ChatMessage(role=MessageRole.ASSISTANT, content=text)


# -- retriever -------------------------------------------------------------------------


def test_retriever_returns_text_nodes_keyed_by_memory_node(client: MemoryClient) -> None:
    for fact in FACTS:
        client.store(fact, "alice")
    retriever = PRMERetriever(client=client, user_id="alice", top_k=2)
    assert isinstance(retriever, BaseRetriever)
    nodes = retriever.retrieve("What does Alice prefer in her editor?")
    assert len(nodes) == 2
    top = nodes[0]
    assert isinstance(top, NodeWithScore) and isinstance(top.node, TextNode)
    assert top.node.text == "Alice prefers dark mode in every editor."
    meta = top.node.metadata
    assert top.node.node_id == meta["node_id"] == f"mem:{meta['event_id']}"
    assert top.score == meta["score"] and nodes[0].score >= nodes[1].score
    assert 0 < meta["semantic_relevance"] <= 1
    assert set(meta["scores"]) >= {"vector", "lexical"}
    # The retrieval metadata stays out of what an LLM or an embedder sees.
    assert top.node.get_content(MetadataMode.LLM) == top.node.text
    assert top.node.get_content(MetadataMode.EMBED) == top.node.text


async def test_retriever_async_and_min_score(client: MemoryClient) -> None:
    for fact in FACTS:
        client.store(fact, "alice")
    retriever = PRMERetriever(client=client, user_id="alice", top_k=3)
    nodes = await retriever.aretrieve("Alice prefers tea")
    assert [n.node.node_id for n in nodes] == [
        n.node.node_id for n in retriever.retrieve("Alice prefers tea")
    ]
    best = max(n.node.metadata["semantic_relevance"] for n in nodes)
    floored = PRMERetriever(client=client, user_id="alice", min_score=best).retrieve(
        "Alice prefers tea"
    )
    assert [n.node.metadata["semantic_relevance"] for n in floored] == [best]


def test_retriever_floor_skipped_is_in_node_metadata(tmp_path: Path) -> None:
    directory = tmp_path / "memory"
    with MemoryClient(directory, embedding_provider=HashedBagOfWordsProvider()) as first:
        first.store("Alice prefers tea over coffee.", "alice")
    retriever = PRMERetriever(
        directory,
        user_id="alice",
        min_score=0.9,
        embedding_provider=HashedBagOfWordsProvider(model_name="prme/changed"),
    )
    try:
        nodes = retriever.retrieve("tea")
    finally:
        retriever.close()
    assert nodes and all(n.node.metadata["min_score_skipped"] is True for n in nodes)


def test_retriever_scope_and_owner(client: MemoryClient) -> None:
    client.store("Alice prefers tea.", "alice", scope="home")
    client.store("Bob prefers tea.", "bob", scope="home")
    assert PRMERetriever(client=client, user_id="alice", scope="work").retrieve("tea") == []
    nodes = PRMERetriever(client=client, user_id="alice", scope="home").retrieve("tea")
    assert [n.node.text for n in nodes] == ["Alice prefers tea."]


# -- chat store ------------------------------------------------------------------------


def test_keys_split_at_the_first_colon_and_default_the_session() -> None:
    assert parse_key("alice:support-42") == ("alice", "support-42")
    assert parse_key("alice") == ("alice", "default")
    assert parse_key("alice:a:b") == ("alice", "a:b")


def test_key_without_colon_uses_default_session(store: PRMEChatStore, client: MemoryClient) -> None:
    store.add_message("alice", _user("hello"))
    assert [m.content for m in client.history("alice", "default")] == ["hello"]
    assert store.get_messages("alice:default") == [_user("hello")]


def test_set_get_round_trip_with_additional_kwargs(store: PRMEChatStore) -> None:
    assert isinstance(store, BaseChatStore)
    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        _user("Use dark mode.", name="alice", tags=["ui", 1, 2.5, None]),
        ChatMessage(
            role=MessageRole.ASSISTANT,
            content="Calling",
            additional_kwargs={"tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
        ),
        ChatMessage(role=MessageRole.TOOL, content="22", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role=MessageRole.CHATBOT, content="hi"),
        ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="a"), TextBlock(text="b")]),
    ]
    store.set_messages("alice:s", messages)
    assert store.get_messages("alice:s") == messages
    assert store.get_messages("alice:other") == []


def test_a_long_message_is_stored_once_and_round_trips(
    store: PRMEChatStore, client: MemoryClient
) -> None:
    """The serialized form in ``fields`` leaves one text's blocks to the record's content:
    a 20 KB message (over the 16 KB ``fields`` limit) was refused."""
    text = "word " * 4000
    messages = [
        ChatMessage(role=MessageRole.USER, content=text),
        ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="a"), TextBlock(text="b")]),
    ]
    store.add_message("alice:s", messages[0])
    store.add_message("alice:s", messages[1])
    assert store.get_messages("alice:s") == messages
    stored = client.history("alice", "s")
    assert "blocks" not in stored[0].fields["llamaindex"]
    assert "blocks" in stored[1].fields["llamaindex"]  # two blocks: kept as they were


def test_prme_fields_of_stored_messages(store: PRMEChatStore, client: MemoryClient) -> None:
    store.set_messages(
        "alice:s",
        [
            _user("hi", name="al"),
            ChatMessage(role="tool", content="22", additional_kwargs={"tool_call_id": "c1"}),
            ChatMessage(role=MessageRole.CHATBOT, content="yo"),
        ],
    )
    stored = client.history("alice", "s")
    assert [(m.role, m.content, m.name, m.tool_call_id) for m in stored] == [
        ("user", "hi", "al", None),
        ("tool", "22", None, "c1"),
        ("assistant", "yo", None, None),
    ]
    assert stored[2].fields["llamaindex"]["role"] == "chatbot"


def test_messages_written_without_llamaindex_are_read_by_role(
    store: PRMEChatStore, client: MemoryClient
) -> None:
    client.add_messages(
        "alice",
        "s",
        [
            MessageDraft(owner="alice", session_id="s", content="hi", name="al"),
            MessageDraft(
                owner="alice",
                session_id="s",
                role="tool",
                content=[{"type": "text", "text": "22"}],
                tool_call_id="c1",
            ),
        ],
    )
    assert store.get_messages("alice:s") == [
        ChatMessage(role="user", content="hi", additional_kwargs={"name": "al"}),
        ChatMessage(role="tool", content="22", additional_kwargs={"tool_call_id": "c1"}),
    ]


def test_empty_messages_are_kept(store: PRMEChatStore) -> None:
    """From a new-user trial: ``ChatMessage(role="assistant", content=None)`` (or "") was
    refused ("content must have a visible character")."""
    messages = [
        _user("hello"),
        ChatMessage(role=MessageRole.ASSISTANT, content=None),
        _assistant(""),
        ChatMessage(role=MessageRole.TOOL, content="", additional_kwargs={"tool_call_id": "c"}),
    ]
    for message in messages:
        store.add_message("alice:s", message)
    assert store.get_messages("alice:s") == messages


def test_set_messages_replaces_the_history(store: PRMEChatStore) -> None:
    store.set_messages("alice:s", [_user("one"), _assistant("two")])
    store.set_messages("alice:s", [_user("three")])
    assert store.get_messages("alice:s") == [_user("three")]
    store.set_messages("alice:s", [])
    assert store.get_messages("alice:s") == []


def test_set_messages_that_extend_the_history_append_only_the_new_ones(
    store: PRMEChatStore, client: MemoryClient
) -> None:
    """From a new-user trial: ``set_messages(key, get_messages(key) + [new])`` (what
    ``ChatMemoryBuffer.set`` does) wrote every message again, and the retriever found "My
    dog is called Rex" four times."""
    store.set_messages("erin:a", [_user("My dog is called Rex"), _user("I work at Acme")])
    for turn in range(3):
        store.set_messages("erin:a", [*store.get_messages("erin:a"), _user(f"turn {turn}")])
        store.set_messages("erin:a", store.get_messages("erin:a"))  # unchanged: no write
    store.add_message("erin:a", _assistant("the end"), idx=5)  # at the end: an append
    expected = ["My dog is called Rex", "I work at Acme", "turn 0", "turn 1", "turn 2"]
    assert [m.content for m in store.get_messages("erin:a")] == [*expected, "the end"]
    texts = [r.text for r in client.retrieve("dog Rex Acme turn", user_id="erin", top_k=20).results]
    assert sorted(texts) == sorted([*expected, "the end"])
    # A change before the end is still one atomic replacement.
    store.add_message("erin:a", _assistant("inserted"), idx=1)
    assert [m.content for m in store.get_messages("erin:a")][:3] == [
        "My dog is called Rex",
        "inserted",
        "I work at Acme",
    ]


def test_add_message_appends_or_inserts_at_index(store: PRMEChatStore) -> None:
    store.add_message("alice:s", _user("one"))
    store.add_message("alice:s", _user("three"))
    store.add_message("alice:s", _assistant("two"), idx=1)
    assert [m.content for m in store.get_messages("alice:s")] == ["one", "two", "three"]


def test_delete_messages_returns_them_and_clears(store: PRMEChatStore) -> None:
    assert store.delete_messages("alice:s") is None
    store.set_messages("alice:s", [_user("one"), _assistant("two")])
    assert store.delete_messages("alice:s") == [_user("one"), _assistant("two")]
    assert store.get_messages("alice:s") == []
    assert store.delete_messages("alice:s") is None
    assert "alice:s" not in store.get_keys()


def test_delete_message_by_index(store: PRMEChatStore) -> None:
    store.set_messages("alice:s", [_user("one"), _assistant("two"), _user("three")])
    assert store.delete_message("alice:s", 1) == _assistant("two")
    assert [m.content for m in store.get_messages("alice:s")] == ["one", "three"]
    assert store.delete_message("alice:s", 5) is None
    assert store.delete_message("alice:s", -1) == _user("three")
    assert store.delete_message("alice:nobody", 0) is None
    assert store.get_messages("alice:s") == [_user("one")]


def test_delete_last_message(store: PRMEChatStore) -> None:
    assert store.delete_last_message("alice:s") is None
    store.set_messages("alice:s", [_user("one"), _assistant("two")])
    assert store.delete_last_message("alice:s") == _assistant("two")
    assert store.delete_last_message("alice:s") == _user("one")
    assert store.delete_last_message("alice:s") is None
    assert store.get_messages("alice:s") == []


def test_get_keys_reports_keys_written_through_this_instance(
    store: PRMEChatStore, client: MemoryClient
) -> None:
    assert store.get_keys() == []
    store.set_messages("alice:a", [_user("one")])
    store.add_message("bob:b", _user("two"))
    store.add_message("carol", _user("three"))
    assert store.get_keys() == ["alice:a", "bob:b", "carol"]
    other = PRMEChatStore(client=client)
    assert other.get_keys() == []
    assert other.get_messages("alice:a") == [_user("one")]


async def test_async_variants(store: PRMEChatStore) -> None:
    await store.aset_messages("alice:s", [_user("one"), _assistant("two")])
    await store.async_add_message("alice:s", _user("three"))
    assert [m.content for m in await store.aget_messages("alice:s")] == ["one", "two", "three"]
    assert await store.adelete_message("alice:s", 0) == _user("one")
    assert await store.adelete_last_message("alice:s") == _user("three")
    assert await store.aget_keys() == ["alice:s"]
    assert await store.adelete_messages("alice:s") == [_assistant("two")]
    assert await store.aget_messages("alice:s") == []


def test_chat_store_scope_isolates_histories(client: MemoryClient) -> None:
    work = PRMEChatStore(client=client, scope="work")
    default = PRMEChatStore(client=client)
    work.set_messages("alice:s", [_user("work talk")])
    assert default.get_messages("alice:s") == []
    assert [m.content for m in client.history("alice", "s", scope="work")] == ["work talk"]


def test_chat_store_directory_mode_and_close(tmp_path: Path) -> None:
    provider = HashedBagOfWordsProvider()
    chat = PRMEChatStore(tmp_path / "memory", embedding_provider=provider)
    chat.set_messages("alice:s", [_user("kept")])
    chat.close()
    with pytest.raises(ConfigurationError):
        chat.get_messages("alice:s")
    with MemoryClient(tmp_path / "memory", embedding_provider=HashedBagOfWordsProvider()) as c:
        assert [m.content for m in c.history("alice", "s")] == ["kept"]
    with pytest.raises(ConfigurationError):
        PRMEChatStore()
