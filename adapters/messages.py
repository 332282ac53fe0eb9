"""Framework message <-> PRME message conversion (LangChain and LlamaIndex).

A framework message is stored as a ``message`` record whose first-class fields (role,
content, name, tool identity, id) serve retrieval and other clients, while ``fields``
keeps the framework's serialized form, so the framework's own deserializer rebuilds an
equal message. The form leaves out the content where the record's ``content`` holds it as
it is (it is put back on reading): ``fields`` has the metadata's size limit
(``limits.max_metadata_bytes``), the content its own, larger one. Messages written without that form (by another framework or
``MemoryClient.store``) are rebuilt from the first-class fields.

The framework modules are imported inside the functions that need them: importing this
module never requires LangChain or LlamaIndex.
"""

from __future__ import annotations

from typing import Any

from prme.producers.producer import MessageDraft
from prme.schemas.records import ROLES, Message, message_text

LANGCHAIN_FIELD = "langchain"
LLAMAINDEX_FIELD = "llamaindex"

_LANGCHAIN_ROLES = {
    "human": "user",
    "ai": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "function",
}
_LLAMAINDEX_ROLES = {"chatbot": "assistant", "model": "assistant"}
FALLBACK_ROLE = "user"
"""The PRME role of a framework role PRME does not have (the framework role is kept)."""


# -- LangChain ---------------------------------------------------------------------------


def langchain_role(serialized: dict[str, Any]) -> str:
    """The PRME role of a serialized LangChain message (``message_to_dict`` output)."""
    kind = str(serialized["type"]).removesuffix("MessageChunk").lower()
    if kind == "chat":
        role = serialized["data"].get("role")
        return role if role in ROLES else FALLBACK_ROLE
    return _LANGCHAIN_ROLES.get(kind, FALLBACK_ROLE)


def langchain_to_draft(
    message: Any, owner: str, session_id: str, scope: str, metadata: dict[str, Any] | None = None
) -> MessageDraft:
    """The draft of a LangChain ``BaseMessage``; ``fields["langchain"]`` keeps all of it."""
    from langchain_core.messages import message_to_dict

    serialized = message_to_dict(message)
    data = serialized["data"]
    content = data.get("content", "")
    blocks = _content_blocks(content)
    if "content" in data and blocks == content:  # the record keeps it: no second copy
        serialized = {**serialized, "data": {k: v for k, v in data.items() if k != "content"}}
    fields: dict[str, Any] = {LANGCHAIN_FIELD: serialized}
    return MessageDraft(
        owner=owner,
        session_id=session_id,
        scope=scope,
        role=langchain_role(serialized),
        content=blocks,
        name=_str_or_none(data.get("name")),
        tool_call_id=_str_or_none(data.get("tool_call_id")),
        tool_calls=list(data.get("tool_calls") or []),
        message_id=_str_or_none(data.get("id")),
        fields=fields,
        metadata=metadata or {},
    )


def message_to_langchain(message: Message) -> Any:
    """The LangChain message of a stored message (exact when LangChain wrote it)."""
    from langchain_core.messages import (
        AIMessage,
        ChatMessage,
        FunctionMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
        messages_from_dict,
    )

    serialized = message.fields.get(LANGCHAIN_FIELD)
    if isinstance(serialized, dict):
        data = serialized.get("data")
        if isinstance(data, dict) and "content" not in data:
            serialized = {**serialized, "data": {**data, "content": message.content}}
        return messages_from_dict([serialized])[0]
    common: dict[str, Any] = {"content": message.content, "id": message.message_id}
    if message.name is not None:
        common["name"] = message.name
    match message.role:
        case "user":
            return HumanMessage(**common)
        case "assistant":
            return AIMessage(**common, tool_calls=_langchain_tool_calls(message.tool_calls))
        case "system":
            return SystemMessage(**common)
        case "tool":
            return ToolMessage(**common, tool_call_id=message.tool_call_id or "")
        case "function":
            return FunctionMessage(**{**common, "name": message.name or ""})
        case _:
            return ChatMessage(**common, role=message.role)


def _langchain_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": c.get("name", ""), "args": c.get("args") or {}, "id": c.get("id")}
        for c in calls
        if isinstance(c, dict)
    ]


def _content_blocks(content: Any) -> str | list[dict[str, Any]]:
    """PRME content: a string, or blocks (bare strings in a block list become text blocks;
    the exact original stays in the framework's serialized form)."""
    if isinstance(content, str):
        return content
    return [
        block if isinstance(block, dict) else {"type": "text", "text": str(block)}
        for block in content
    ]


# -- LlamaIndex --------------------------------------------------------------------------


def llamaindex_role(role: str) -> str:
    mapped = _LLAMAINDEX_ROLES.get(role, role)
    return mapped if mapped in ROLES else FALLBACK_ROLE


def llamaindex_to_draft(
    message: Any, owner: str, session_id: str, scope: str, metadata: dict[str, Any] | None = None
) -> MessageDraft:
    """The draft of a LlamaIndex ``ChatMessage``; ``fields["llamaindex"]`` keeps all of it."""
    serialized = message.model_dump(mode="json")
    extra = serialized.get("additional_kwargs") or {}
    role = str(serialized["role"])
    content = message.content or ""
    if serialized.get("blocks") == _llamaindex_text_blocks(content):  # the record keeps it
        serialized = {k: v for k, v in serialized.items() if k != "blocks"}
    return MessageDraft(
        owner=owner,
        session_id=session_id,
        scope=scope,
        role=llamaindex_role(role),
        content=content,
        name=_str_or_none(extra.get("name")),
        tool_call_id=_str_or_none(extra.get("tool_call_id")),
        tool_calls=[c for c in extra.get("tool_calls") or [] if isinstance(c, dict)],
        fields={LLAMAINDEX_FIELD: serialized},
        metadata=metadata or {},
    )


def message_to_llamaindex(message: Message) -> Any:
    """The LlamaIndex ``ChatMessage`` of a stored message (exact when LlamaIndex wrote it)."""
    from llama_index.core.llms import ChatMessage

    serialized = message.fields.get(LLAMAINDEX_FIELD)
    if isinstance(serialized, dict):
        if "blocks" not in serialized and isinstance(message.content, str):
            serialized = {**serialized, "blocks": _llamaindex_text_blocks(message.content)}
        return ChatMessage.model_validate(serialized)
    extra: dict[str, Any] = {}
    if message.name is not None:
        extra["name"] = message.name
    if message.tool_call_id is not None:
        extra["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        extra["tool_calls"] = message.tool_calls
    return ChatMessage(
        role=message.role, content=message_text(message.content), additional_kwargs=extra
    )


def _llamaindex_text_blocks(text: str) -> list[dict[str, Any]]:
    """The ``blocks`` a ``ChatMessage`` of one text dumps (``model_dump(mode="json")``)."""
    return [{"block_type": "text", "text": text}]


def _str_or_none(value: Any) -> str | None:
    """A name or id as a draft takes it: a framework's empty one (``""``) is none (the
    producer refuses an empty name, tool_call_id or message_id; the framework's own form,
    kept in ``fields``, round-trips it as it was)."""
    return value if isinstance(value, str) and value else None
