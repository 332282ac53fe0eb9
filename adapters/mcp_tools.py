"""The PRME tools an MCP client sees: their schemas, who they act for, and what they do.

Arguments are decoded the way the HTTP service decodes bodies (strict JSON into the same
msgspec types, unknown fields refused), so a bad argument is an error naming its field
(``Expected `int`, got `str` - at `$.top_k```) and nothing is written. The owner comes
from the server (``--user-id``) or the caller's API key; a ``user_id`` argument may only
repeat it. An admin key or an open local server takes the owner from ``user_id``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mcp_types as types
import msgspec

from prme.query.auth import Caller
from prme.query.client import AsyncMemoryClient
from prme.query.http_errors import status_of
from prme.query.http_types import (
    PATTERN_WORDS,
    ArchiveRequest,
    Body,
    ErrorBody,
    IdField,
    Positive,
    RetrieveRequest,
    StoreRequest,
    UserIdField,
)
from prme.query.types import MemoryResult, Receipt, StoreResult
from prme.schemas.errors import InvalidInput, NotFound, PRMEError, patterns_in_words
from prme.schemas.records import Message

from .mcp_access import OwnerPolicy, Receipts
from .mcp_schema import object_schema

log = logging.getLogger(__name__)

RECEIPT_URI = "prme://receipts/{request_id}"
HISTORY_URI = "prme://history/{user_id}/{session_id}{?scope}"
ArgsT = TypeVar("ArgsT", bound=msgspec.Struct)


# -- argument types the HTTP API spells as path or query parameters -----------------------


# The HTTP API's field types, so a tool refuses what the API refuses (docs/HTTP.md,
# "Validation"). mypy sees prme.query.* through the package-dir mapping as untyped.
class HistoryArgs(Body, frozen=True, kw_only=True):  # type: ignore[call-arg]
    """``GET /v1/history``'s query parameters."""

    user_id: UserIdField
    session_id: IdField = "default"
    scope: IdField = "default"
    limit: Positive | None = None


class ForgetMessageArgs(Body, frozen=True, kw_only=True):  # type: ignore[call-arg]
    """``DELETE /v1/history/messages/{event_id}``'s parameters."""

    user_id: UserIdField
    event_id: IdField


class ArchiveMemoryArgs(ArchiveRequest, frozen=True, kw_only=True):  # type: ignore[call-arg]
    """``POST /v1/nodes/{node_id}/archive``: the body plus the node from the path."""

    node_id: IdField


# -- structured results ----------------------------------------------------------------------


class RecallReply(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    """The token-budgeted bundle, one line per memory, ready for a prompt."""
    results: list[MemoryResult]
    receipt_id: str
    receipt_uri: str
    """Read it as an MCP resource: how each result was found."""
    tokens_used: int
    token_budget: int
    omitted: list[str]


class HistoryReply(msgspec.Struct, frozen=True, kw_only=True):
    messages: list[Message]


class ToolFailure(Exception):
    """A call the tool refuses: becomes a tool result with ``isError`` (not a protocol error)."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.body = ErrorBody(error=kind, detail=detail)


def error_kind(error: PRMEError) -> str:
    """The same stable kind the HTTP service answers with (``forbidden``, ...)."""
    known = status_of(error)
    return known[1] if known is not None else "error"


# -- the tools -------------------------------------------------------------------------------

USER_ID = (
    "The owner whose memory this is. Leave it out when the server was started with "
    "--user-id or your API key is bound to an owner: those decide, and any other value is "
    "refused."
)
DESCRIPTIONS = {
    "user_id": USER_ID,
    "content": "The text to remember (or content blocks).",
    "session_id": "The conversation it belongs to (default 'default').",
    "scope": "A namespace inside the owner, matched exactly ('work' is not 'Work').",
    "role": "Who said it.",
    "name": "The speaker's name, when it is not just the role.",
    "occurred_at": "When it happened (RFC 3339 with a UTC offset, e.g. 2024-05-01T10:00:00Z), "
    "if not now.",
    "request_id": "An idempotency key: a retry with the same key and the same content writes "
    "nothing new; the same key with other content is refused.",
    "metadata": "Your own JSON object, stored with the message.",
    "query": "What to look for, in natural language.",
    "top_k": "How many memories at most (>= 1).",
    "token_budget": "The bundle text stays within this many tokens (>= 1).",
    "min_score": "Drop results whose semantic relevance is below this (inclusive).",
    "include_archived": "Also return archived memories.",
    "fusion": "How channel scores combine (default: the server's setting).",
    "limit": "Only the last N messages.",
    "event_id": "The message's event id, as returned by remember or history.",
    "node_id": "The memory node id, 'mem:<event id>', as returned by remember or recall.",
    "reason": "Why, kept on the log.",
}


@dataclass(frozen=True)
class Tool:
    name: str
    title: str
    description: str
    args: type[msgspec.Struct]
    output: type[msgspec.Struct]
    drop: tuple[str, ...] = ()
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    def input_schema(self, owner_required: bool) -> dict[str, Any]:
        return object_schema(
            self.args,
            drop=self.drop,
            optional=() if owner_required else ("user_id",),
            descriptions=DESCRIPTIONS,
            description="",
        )

    def output_schema(self) -> dict[str, Any]:
        return object_schema(self.output, description="")

    def listing(self, owner_required: bool) -> types.Tool:
        return types.Tool(
            name=self.name,
            title=self.title,
            description=self.description,
            input_schema=self.input_schema(owner_required),
            output_schema=self.output_schema(),
            annotations=types.ToolAnnotations(
                title=self.title,
                read_only_hint=self.read_only,
                destructive_hint=self.destructive,
                idempotent_hint=self.idempotent,
                open_world_hint=False,
            ),
        )


TOOLS: tuple[Tool, ...] = (
    Tool(
        "remember",
        "Remember",
        "Store a memory or a chat message for the owner. Writes one `message` record to the "
        "owner's append-only log; before this returns it is searchable by `recall` and part "
        "of the chat history of (session_id, scope). Returns its event id and memory node id.",
        StoreRequest,
        StoreResult,
        drop=("wait", "fields"),
    ),
    Tool(
        "recall",
        "Recall",
        "Search the owner's memories (vector, lexical and time cues fused). Writes nothing. "
        "Returns the best memories as a token-budgeted bundle of text, the structured "
        "results, and a receipt id; the receipt (how each result was found) is the resource "
        "prme://receipts/{receipt_id}.",
        RetrieveRequest,
        RecallReply,
        drop=("after",),
        read_only=True,
        idempotent=True,
    ),
    Tool(
        "history",
        "Chat history",
        "Read the messages of one chat session (owner, session_id, scope) in order, with "
        "clears and deletions applied. Writes nothing. The same history is the resource "
        "prme://history/{user_id}/{session_id}.",
        HistoryArgs,
        HistoryReply,
        read_only=True,
        idempotent=True,
    ),
    Tool(
        "forget_message",
        "Forget a message",
        "Remove one message from its chat history. Appends a `message_deleted` record; the "
        "original stays on the log for audit, and the memory made from it is still recalled "
        "until you archive its node (mem:<event_id>) with `archive_memory`.",
        ForgetMessageArgs,
        StoreResult,
        destructive=True,
        idempotent=True,
    ),
    Tool(
        "archive_memory",
        "Archive a memory",
        "Stop one memory node from being recalled. Appends a `node_archived` record (with "
        "your reason); the message stays in the chat history and on the log, and the node "
        "can be restored through the PRME API.",
        ArchiveMemoryArgs,
        StoreResult,
        drop=("wait",),
        destructive=True,
        idempotent=True,
    ),
)
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}


class MemoryTools:
    """Runs the tools against one client for callers resolved by the transport."""

    def __init__(self, client: AsyncMemoryClient, policy: OwnerPolicy, receipts: Receipts) -> None:
        self.client = client
        self.policy = policy
        self.receipts = receipts
        self._run: dict[str, Callable[[Any], Awaitable[tuple[str, msgspec.Struct]]]] = {
            "remember": self._remember,
            "recall": self._recall,
            "history": self._history,
            "forget_message": self._forget_message,
            "archive_memory": self._archive_memory,
        }

    def listing(self, caller: Caller) -> list[types.Tool]:
        owner_required = self.policy.implied(caller) is None
        return [tool.listing(owner_required) for tool in TOOLS]

    async def call(
        self, name: str, arguments: dict[str, Any] | None, caller: Caller
    ) -> types.CallToolResult:
        tool = TOOLS_BY_NAME.get(name)
        if tool is None:
            return _failure(ToolFailure("unknown_tool", f"no tool named {name!r}"))
        try:
            args = self.decode(tool, arguments or {}, caller)
            text, reply = await self._run[name](args)
        except ToolFailure as failure:
            return _failure(failure)
        except PRMEError as error:
            return _failure(ToolFailure(error_kind(error), str(error)))
        except Exception as error:  # not PRME's own: still a tool result, never a protocol error
            log.exception("tool %s failed", name)
            return _failure(ToolFailure("internal", f"internal error: {type(error).__name__}"))
        return types.CallToolResult(
            content=[types.TextContent(text=text)],
            structured_content=msgspec.to_builtins(reply),
        )

    async def receipt(self, request_id: str, caller: Caller) -> Receipt:
        """The receipt of a recall, unless its owner was erased since (NotFound).

        A receipt holds its query text. Its first result's event is gone once the owner is
        erased (through this server or any other), so reading it back is the check: one
        read, and the owner's receipts are dropped when it fails. A recall that found
        nothing leaves no event to check: its receipt stays until it expires."""
        receipt = self.receipts.get(request_id, caller, self.policy)
        if receipt.results:
            try:
                await self.client.get_event(receipt.results[0].event_id, receipt.owner)
            except NotFound:
                self.receipts.drop_owner(receipt.owner)
                raise self.receipts.unknown(request_id) from None
        return receipt

    def decode(self, tool: Tool, arguments: dict[str, Any], caller: Caller) -> Any:
        """The arguments as ``tool.args``, the owner resolved and authorized."""
        if not isinstance(arguments, dict):
            raise ToolFailure("invalid_input", "arguments must be a JSON object")
        for field in arguments:
            if field in tool.drop:
                raise ToolFailure(
                    "invalid_input", f"Object contains unknown field `{field}` - at `$.{field}`"
                )
        body = dict(arguments)
        implied = self.policy.implied(caller)
        if "user_id" not in body and implied is not None:
            body["user_id"] = implied
        if "wait" in {f.name for f in msgspec.structs.fields(tool.args)}:
            body["wait"] = True
        args: Any = decode_as(tool.args, body)
        self.policy.check(caller, args.user_id)
        return args

    async def _remember(self, args: StoreRequest) -> tuple[str, msgspec.Struct]:
        (result,) = await self.client.store_many([args.draft()], wait=True)
        node = f" (memory node {result.node_ids[0]})" if result.node_ids else ""
        return f"Stored event {result.event_id}{node} for {args.user_id}.", result

    async def _recall(self, args: RetrieveRequest) -> tuple[str, msgspec.Struct]:
        response = await self.client.retrieve_request(args)  # ``after`` is not a tool field
        receipt = response.receipt
        self.receipts.add(receipt)
        text = response.bundle.render()
        reply = RecallReply(
            text=text,
            results=response.results,
            receipt_id=receipt.request_id,
            receipt_uri=RECEIPT_URI.format(request_id=receipt.request_id),
            tokens_used=response.bundle.tokens_used,
            token_budget=response.bundle.token_budget,
            omitted=response.bundle.omitted,
        )
        return f"{recall_text(reply)}\n\n(receipt: {reply.receipt_uri})", reply

    async def _history(self, args: HistoryArgs) -> tuple[str, msgspec.Struct]:
        messages = await self.client.history(
            args.user_id, args.session_id, scope=args.scope, limit=args.limit
        )
        return render_history(messages), HistoryReply(messages=messages)

    async def _forget_message(self, args: ForgetMessageArgs) -> tuple[str, msgspec.Struct]:
        result = await self.client.delete_message(args.user_id, args.event_id, wait=True)
        return f"Removed message {args.event_id} from its chat history.", result

    async def _archive_memory(self, args: ArchiveMemoryArgs) -> tuple[str, msgspec.Struct]:
        result = await self.client.archive(
            args.node_id, args.user_id, reason=args.reason, wait=True
        )
        return f"Archived {args.node_id}: recall no longer returns it.", result


def decode_as(kind: type[ArgsT], body: dict[str, Any]) -> ArgsT:
    """``body`` as ``kind``, decoded as the HTTP service decodes a request: strict JSON,
    InvalidInput naming the field (``... - at `$.session_id```) and saying what a pattern
    means."""
    try:
        return msgspec.json.decode(msgspec.json.encode(body), type=kind)
    except msgspec.ValidationError as error:
        raise InvalidInput(patterns_in_words(str(error), PATTERN_WORDS)) from None


def recall_text(reply: RecallReply) -> str:
    """The bundle, and what did not fit in it: an empty bundle is not "nothing matched"."""
    if not reply.results:
        return "No memories matched."
    left_out = len(reply.omitted)
    if not reply.text:
        return (
            f"{_memories(len(reply.results))} matched, but none fit "
            f"token_budget={reply.token_budget}: raise it to see them."
        )
    if left_out:
        return (
            f"{reply.text}\n\n({_memories(left_out)} more matched but did not fit "
            f"token_budget={reply.token_budget}.)"
        )
    return reply.text


def _memories(count: int) -> str:
    return f"{count} memory" if count == 1 else f"{count} memories"


def render_history(messages: list[Message]) -> str:
    if not messages:
        return "No messages in this session."
    lines = []
    for message in messages:
        content = message.content
        text = content if isinstance(content, str) else msgspec.json.encode(content).decode()
        speaker = f"{message.role} ({message.name})" if message.name else message.role
        lines.append(f"[{message.event_id}] {speaker}: {text}")
    return "\n".join(lines)


def _failure(failure: ToolFailure) -> types.CallToolResult:
    return types.CallToolResult(
        content=[types.TextContent(text=str(failure))],
        structured_content=msgspec.to_builtins(failure.body),
        is_error=True,
    )


__all__ = [
    "HISTORY_URI",
    "RECEIPT_URI",
    "TOOLS",
    "MemoryTools",
    "ToolFailure",
]
