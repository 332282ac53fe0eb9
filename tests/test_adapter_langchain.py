"""The LangChain adapters: retriever (incl. langchain-tests' standard suite) and chat
history (exact round-trip of every message class, langchain-core's history behaviours)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("langchain_core")

import langchain_core.messages as lc_messages  # noqa: E402
from langchain_core.chat_history import BaseChatMessageHistory  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import (  # noqa: E402
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ChatMessageChunk,
    FunctionMessage,
    FunctionMessageChunk,
    HumanMessage,
    HumanMessageChunk,
    SystemMessage,
    SystemMessageChunk,
    ToolMessage,
    ToolMessageChunk,
)
from langchain_core.retrievers import BaseRetriever  # noqa: E402
from langchain_tests.integration_tests import RetrieversIntegrationTests  # noqa: E402

from prme import MemoryClient  # noqa: E402
from prme.integrations.langchain import PRMEChatMessageHistory, PRMERetriever  # noqa: E402
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider  # noqa: E402
from prme.schemas.errors import ConfigurationError  # noqa: E402

FACTS = [
    "Alice decided to move the launch to March.",
    "Alice decided the budget stays at ten thousand.",
    "Alice prefers dark mode in every editor.",
    "Alice decided to hire two more engineers.",
]


def _seed(client: MemoryClient, owner: str = "alice", scope: str = "default") -> None:
    for fact in FACTS:
        client.store(fact, owner, scope=scope, session_id="notes")


# -- retriever -------------------------------------------------------------------------


class TestStandardRetriever(RetrieversIntegrationTests):
    """langchain-tests' own retriever suite (k in the constructor and in invoke, sync and
    async invoke), run against a real embedded pack."""

    @pytest.fixture(autouse=True)
    def _pack(self, client: MemoryClient) -> None:
        _seed(client)
        self._client = client

    @property
    def retriever_constructor(self) -> type[BaseRetriever]:
        return PRMERetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"client": self._client, "user_id": "alice"}

    @property
    def retriever_query_example(self) -> str:
        return "What has Alice decided?"


def test_documents_carry_memory_text_and_retrieval_metadata(client: MemoryClient) -> None:
    _seed(client)
    retriever = PRMERetriever(client=client, user_id="alice", top_k=2, token_budget=4096)
    documents = retriever.invoke("dark mode editor")
    assert len(documents) == 2
    top = documents[0]
    assert isinstance(top, Document)
    assert top.page_content == "Alice prefers dark mode in every editor."
    meta = top.metadata
    assert top.id == meta["node_id"] == f"mem:{meta['event_id']}"
    assert client.get_event(meta["event_id"], "alice").kind == "message"
    assert meta["score"] > 0
    assert 0 < meta["semantic_relevance"] <= 1
    assert meta["scores"]["vector"] == pytest.approx(meta["semantic_relevance"])
    assert "lexical" in meta["scores"] and meta["ranks"]["lexical"] == 1
    assert "min_score_skipped" not in meta
    assert documents[0].metadata["score"] >= documents[1].metadata["score"]


def test_top_k_alias_k_and_invoke_options(client: MemoryClient) -> None:
    _seed(client)
    assert PRMERetriever(client=client, user_id="alice", k=2).top_k == 2
    retriever = PRMERetriever(client=client, user_id="alice", top_k=4)
    assert len(retriever.invoke("Alice decided")) == 4
    assert len(retriever.invoke("Alice decided", k=1)) == 1
    assert len(retriever.invoke("Alice decided", top_k=2)) == 2


def test_min_score_is_an_inclusive_floor_on_semantic_relevance(client: MemoryClient) -> None:
    _seed(client)
    unfiltered = PRMERetriever(client=client, user_id="alice").invoke("dark mode editor")
    best = max(d.metadata["semantic_relevance"] for d in unfiltered)
    floored = PRMERetriever(client=client, user_id="alice", min_score=best).invoke(
        "dark mode editor"
    )
    assert [d.metadata["semantic_relevance"] for d in floored] == [best]
    assert PRMERetriever(client=client, user_id="alice", min_score=1.01).invoke("dark mode") == []


def test_floor_skipped_after_model_change_is_reported_per_document(tmp_path: Path) -> None:
    directory = tmp_path / "memory"
    with MemoryClient(directory, embedding_provider=HashedBagOfWordsProvider()) as first:
        _seed(first)
    changed = HashedBagOfWordsProvider(model_name="prme/another-model")
    retriever = PRMERetriever(
        directory=directory, user_id="alice", min_score=0.99, embedding_provider=changed
    )
    try:
        documents = retriever.invoke("Alice decided launch")
    finally:
        retriever.close()
    assert documents, "the floor is skipped instead of returning nothing"
    for document in documents:
        assert document.metadata["min_score_skipped"] is True
        assert document.metadata["semantic_relevance"] is None


def test_retriever_is_filtered_by_owner_and_scope(client: MemoryClient) -> None:
    _seed(client, owner="alice", scope="work")
    client.store("Bob decided to sell the boat.", "bob")
    alice = PRMERetriever(client=client, user_id="alice").invoke("decided")
    assert alice and all(d.metadata["owner"] == "alice" for d in alice)
    assert PRMERetriever(client=client, user_id="alice", scope="home").invoke("decided") == []
    work = PRMERetriever(client=client, user_id="alice", scope="work").invoke("decided")
    assert {d.metadata["scope"] for d in work} == {"work"}


async def test_retriever_async_invoke_matches_sync(client: MemoryClient) -> None:
    _seed(client)
    retriever = PRMERetriever(client=client, user_id="alice", top_k=3)
    sync_ids = [d.id for d in retriever.invoke("Alice decided budget")]
    async_ids = [d.id for d in await retriever.ainvoke("Alice decided budget")]
    assert sync_ids == async_ids and len(sync_ids) == 3


def test_adapter_needs_exactly_one_connection(client: MemoryClient, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError):
        PRMERetriever(user_id="alice")
    with pytest.raises(ConfigurationError):
        PRMERetriever(directory=tmp_path / "other", client=client, user_id="alice")
    with pytest.raises(ConfigurationError):
        PRMEChatMessageHistory(user_id="alice", session_id="s")


def test_close_releases_the_pack_but_not_a_given_client(tmp_path: Path) -> None:
    directory = tmp_path / "memory"
    provider = HashedBagOfWordsProvider()
    retriever = PRMERetriever(directory=directory, user_id="alice", embedding_provider=provider)
    history = PRMEChatMessageHistory(
        directory, user_id="alice", session_id="s", embedding_provider=provider
    )
    history.add_messages([HumanMessage("Use dark mode.")])
    other = HashedBagOfWordsProvider()
    with pytest.raises(ConfigurationError):
        MemoryClient(directory, embedding_provider=other)  # still open with `provider`
    retriever.close()
    history.close()
    history.close()  # idempotent
    with MemoryClient(directory, embedding_provider=other) as reopened:
        assert [m.content for m in reopened.history("alice", "s")] == ["Use dark mode."]
        given = PRMEChatMessageHistory(client=reopened, user_id="alice", session_id="s")
        given.close()
        assert len(reopened.history("alice", "s")) == 1
    with pytest.raises(ConfigurationError):
        _ = history.messages


# -- chat history ----------------------------------------------------------------------

TOOL_CALL = {"name": "lookup", "args": {"city": "Paris", "days": [1, 2]}, "id": "call-1"}
USAGE = {
    "input_tokens": 10,
    "output_tokens": 4,
    "total_tokens": 14,
    "input_token_details": {"cache_read": 3},
}
BLOCKS = [
    {"type": "text", "text": "Look at this."},
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
]
EXTRAS: dict[str, Any] = {
    "additional_kwargs": {"refusal": None, "custom": {"nested": [1, 2.5, True]}},
    "response_metadata": {"model_name": "m-1", "finish_reason": "stop"},
}


def _every_message() -> list[BaseMessage]:
    return [
        HumanMessage("Use dark mode."),
        HumanMessage(content=BLOCKS, name="alice", id="h-1", **EXTRAS),
        HumanMessage(content=["a bare string block", {"type": "text", "text": "and a dict"}]),
        HumanMessageChunk(content="partial", id="hc-1", **EXTRAS),
        AIMessage(
            content="",
            tool_calls=[TOOL_CALL],
            invalid_tool_calls=[
                {
                    "type": "invalid_tool_call",
                    "name": "bad",
                    "args": "{oops",
                    "id": "c2",
                    "error": "e",
                }
            ],
            usage_metadata=USAGE,
            name="assistant-1",
            id="ai-1",
            **EXTRAS,
        ),
        AIMessage(content=BLOCKS, id="ai-2"),
        AIMessageChunk(
            content="Checking",
            tool_call_chunks=[
                {"name": "lookup", "args": '{"city": "Paris"}', "id": "call-1", "index": 0}
            ],
            usage_metadata=USAGE,
            id="aic-1",
            chunk_position="last",
        ),
        SystemMessage("You are terse.", id="s-1", **EXTRAS),
        SystemMessageChunk(content="You are", name="sys"),
        ToolMessage(
            content="22 degrees",
            tool_call_id="call-1",
            status="error",
            artifact={"raw": [1, 2, 3], "source": "api"},
            name="lookup",
            id="t-1",
            **EXTRAS,
        ),
        ToolMessage(content=[{"type": "text", "text": "ok"}], tool_call_id="call-2"),
        ToolMessageChunk(content="22", tool_call_id="call-1", artifact=[1], status="success"),
        FunctionMessage(name="lookup", content='{"temp": 22}', id="f-1", **EXTRAS),
        FunctionMessageChunk(name="lookup", content='{"te'),
        ChatMessage(role="critic", content="Too long.", id="c-1", **EXTRAS),
        ChatMessage(role="developer", content="Be brief."),
        ChatMessageChunk(role="assistant", content="Sure"),
    ]


def _message_classes() -> set[type]:
    classes = {getattr(lc_messages, name) for name in lc_messages.__all__}
    return {
        cls
        for cls in classes
        if isinstance(cls, type)
        and issubclass(cls, BaseMessage)
        and cls not in (BaseMessage, lc_messages.BaseMessageChunk, lc_messages.RemoveMessage)
    }


def test_samples_cover_every_langchain_message_class() -> None:
    assert {type(m) for m in _every_message()} == _message_classes()


def test_every_message_class_round_trips_exactly(client: MemoryClient) -> None:
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    originals = _every_message()
    history.add_messages(originals)
    restored = history.messages
    assert len(restored) == len(originals)
    for original, back in zip(originals, restored, strict=True):
        assert type(back) is type(original)
        assert back == original
        assert back.model_dump() == original.model_dump()


def test_empty_messages_round_trip_with_the_turn_they_are_in(client: MemoryClient) -> None:
    """From a new-user trial: an empty reply (or tool result, or human message) was refused
    ("content must have a visible character"), which RunnableWithMessageHistory only logs,
    so the whole turn, the user's message included, was silently not stored."""
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    turn: list[BaseMessage] = [
        HumanMessage("say nothing"),
        AIMessage(""),
        HumanMessage(""),
        ToolMessage("", tool_call_id="call-9"),
        AIMessage(
            "",
            invalid_tool_calls=[
                {"type": "invalid_tool_call", "name": "x", "args": "{", "id": "c", "error": "e"}
            ],
        ),
        AIMessage(content=[]),
    ]
    history.add_messages(turn)
    assert history.messages == turn
    # Empty turns are kept in the history but are no memory: retrieval finds the text.
    results = client.retrieve("say nothing", user_id="alice").results
    assert [r.text for r in results] == ["say nothing"]


def test_a_long_message_is_stored_once_and_round_trips(client: MemoryClient) -> None:
    """The serialized form in ``fields`` leaves the content to the record: a 20 KB message
    (over the 16 KB ``fields`` limit, under the 64 KB content limit) was refused."""
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    text = "word " * 4000
    history.add_user_message(text)
    history.add_message(AIMessage(content=[{"type": "text", "text": text}], id="a-1"))
    assert [m.content for m in history.messages] == [text, [{"type": "text", "text": text}]]
    stored = client.history("alice", "s")
    assert all("content" not in m.fields["langchain"]["data"] for m in stored)


def test_roles_identity_and_extras_map_to_prme_fields(client: MemoryClient) -> None:
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    originals = _every_message()
    history.add_messages(originals)
    stored = client.history("alice", "s")
    roles = [m.role for m in stored]
    assert roles == [
        "user", "user", "user", "user",
        "assistant", "assistant", "assistant",
        "system", "system",
        "tool", "tool", "tool",
        "function", "function",
        "user", "developer", "assistant",
    ]  # fmt: skip
    tool = stored[9]
    assert (tool.tool_call_id, tool.name, tool.message_id) == ("call-1", "lookup", "t-1")
    assert tool.fields["langchain"]["data"]["artifact"] == {"raw": [1, 2, 3], "source": "api"}
    assert tool.fields["langchain"]["data"]["status"] == "error"
    ai = stored[4]
    assert ai.tool_calls[0]["args"] == TOOL_CALL["args"]
    assert ai.fields["langchain"]["data"]["usage_metadata"] == USAGE
    assert stored[1].content == BLOCKS
    assert stored[14].fields["langchain"]["data"]["role"] == "critic"


def test_messages_written_without_langchain_are_read_by_role(client: MemoryClient) -> None:
    from prme import MessageDraft

    drafts = [
        MessageDraft(owner="alice", session_id="s", content="hi", role="user", name="al"),
        MessageDraft(
            owner="alice",
            session_id="s",
            content="",
            role="assistant",
            tool_calls=[TOOL_CALL],
            message_id="a-9",
        ),
        MessageDraft(owner="alice", session_id="s", content="22", role="tool", tool_call_id="c1"),
        MessageDraft(owner="alice", session_id="s", content="be nice", role="system"),
        MessageDraft(owner="alice", session_id="s", content="{}", role="function", name="f"),
        MessageDraft(owner="alice", session_id="s", content="dev", role="developer"),
    ]
    client.add_messages("alice", "s", drafts)
    messages = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s").messages
    assert messages == [
        HumanMessage("hi", name="al"),
        AIMessage("", id="a-9", tool_calls=[TOOL_CALL]),
        ToolMessage("22", tool_call_id="c1"),
        SystemMessage("be nice"),
        FunctionMessage(name="f", content="{}"),
        ChatMessage(role="developer", content="dev"),
    ]


def test_langchain_core_history_behaviours(client: MemoryClient) -> None:
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    assert isinstance(history, BaseChatMessageHistory)
    assert history.messages == []
    history.add_message(HumanMessage("one"))
    history.add_user_message("two")
    history.add_ai_message("three")
    history.add_messages([HumanMessage("four"), AIMessage("five")])
    history.add_messages([])
    assert [m.content for m in history.messages] == ["one", "two", "three", "four", "five"]
    assert [type(m) for m in history.messages[1:3]] == [HumanMessage, AIMessage]
    assert "Human: one" in str(history)
    history.clear()
    assert history.messages == []
    history.add_message(AIMessage("after clear"))
    assert history.messages == [AIMessage("after clear")]


async def test_langchain_core_async_history_behaviours(client: MemoryClient) -> None:
    history = PRMEChatMessageHistory(client=client, user_id="alice", session_id="s")
    assert await history.aget_messages() == []
    await history.aadd_messages([HumanMessage("one"), AIMessage("two")])
    await history.aadd_messages([ToolMessage("three", tool_call_id="c")])
    assert await history.aget_messages() == [
        HumanMessage("one"),
        AIMessage("two"),
        ToolMessage("three", tool_call_id="c"),
    ]
    await history.aclear()
    assert await history.aget_messages() == []


def test_two_histories_on_one_directory_see_each_others_writes(tmp_path: Path) -> None:
    provider = HashedBagOfWordsProvider()
    directory = tmp_path / "memory"
    writer = PRMEChatMessageHistory(
        directory, user_id="alice", session_id="s", embedding_provider=provider
    )
    reader = PRMEChatMessageHistory(
        directory=directory, user_id="alice", session_id="s", embedding_provider=provider
    )
    try:
        writer.add_messages([HumanMessage("written by one")])
        assert reader.messages == [HumanMessage("written by one")]
        reader.clear()
        assert writer.messages == []
    finally:
        writer.close()
        reader.close()
