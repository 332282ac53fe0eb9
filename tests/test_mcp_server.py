"""``prme mcp`` as an MCP client meets it: a subprocess over stdio or streamable HTTP, driven
by the official SDK's ``ClientSession``, on the real default embedding model."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import pytest
from mcp import ClientSession
from mcp.shared.exceptions import MCPError

from prme.cli import main
from prme.query.client import AsyncMemoryClient
from prme.query.http_types import RetrieveRequest, StoreRequest
from prme.schemas.errors import InvalidInput

from .mcp_harness import (
    clean_env,
    http_session,
    mcp_http,
    prme_serve,
    records_of,
    stdio_session,
)

pytestmark = pytest.mark.model

TOOLS = {"remember", "recall", "history", "forget_message", "archive_memory"}
BOUND_S = 300  # every test finishes well inside this, or fails
KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-admin": "*"}


def text_of(result: Any) -> str:
    return "\n".join(block.text for block in result.content if block.type == "text")


async def call_ok(session: ClientSession, tool: str, arguments: dict[str, Any]) -> Any:
    result = await session.call_tool(tool, arguments)
    assert not result.is_error, text_of(result)
    return result.structured_content


async def remember_then_recall(session: ClientSession, **owner: str) -> None:
    """The write is recalled at once (read-your-writes), and its receipt says how."""
    stored = await call_ok(
        session,
        "remember",
        {"content": "My sister Lena lives in Lisbon", "session_id": "trip", **owner},
    )
    recalled = await call_ok(
        session, "recall", {"query": "Where does my sister live?", "top_k": 3, **owner}
    )
    assert recalled["results"][0]["node_id"] == stored["node_ids"][0]
    assert "My sister Lena lives in Lisbon" in recalled["text"]
    receipt = await session.read_resource(recalled["receipt_uri"])
    body = json.loads(receipt.contents[0].text)
    assert body["request_id"] == recalled["receipt_id"]
    assert body["results"][0]["node_id"] == stored["node_ids"][0]
    assert {channel["name"] for channel in body["channels"]} >= {"vector", "lexical"}


async def test_stdio_tools_have_valid_schemas_from_the_http_types(tmp_path: Path) -> None:
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            "--data-dir", str(tmp_path), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
        ) as session:
            listed = {tool.name: tool for tool in (await session.list_tools()).tools}
    assert set(listed) == TOOLS
    for tool in listed.values():
        for schema in (tool.input_schema, tool.output_schema):
            jsonschema.Draft202012Validator.check_schema(schema)
            assert schema["type"] == "object" and "$ref" not in json.dumps(schema)
        assert tool.input_schema["additionalProperties"] is False
        # No --user-id and no key: the local user must name the owner.
        assert "user_id" in tool.input_schema["required"]
        assert tool.description
    # The same fields as the HTTP bodies, minus what a tool decides itself.
    store_fields = {f.name for f in msgspec.structs.fields(StoreRequest)}
    assert set(listed["remember"].input_schema["properties"]) == store_fields - {"wait", "fields"}
    retrieve_fields = {f.name for f in msgspec.structs.fields(RetrieveRequest)}
    assert set(listed["recall"].input_schema["properties"]) == retrieve_fields - {"after"}
    validator = jsonschema.Draft202012Validator(listed["recall"].input_schema)
    assert validator.is_valid({"query": "x", "user_id": "a", "top_k": 3, "fusion": "rrf"})
    assert not validator.is_valid({"query": "x", "user_id": "a", "top_k": "3"})
    assert not validator.is_valid({"query": "x", "user_id": "a", "colour": "red"})
    # Each says what it writes.
    assert "Writes nothing" in listed["recall"].description
    assert "Writes nothing" in listed["history"].description
    assert "`message` record" in listed["remember"].description
    assert "`message_deleted`" in listed["forget_message"].description
    assert "`node_archived`" in listed["archive_memory"].description
    assert listed["recall"].annotations.read_only_hint is True
    assert listed["forget_message"].annotations.destructive_hint is True


async def test_stdio_reads_its_writes_and_serves_history_and_receipts(tmp_path: Path) -> None:
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            "--data-dir", str(tmp_path), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
        ) as session:
            await remember_then_recall(session, user_id="alice")
            said = await call_ok(
                session,
                "remember",
                {"user_id": "alice", "session_id": "trip", "content": "Book the 9:40 train"},
            )
            history = await call_ok(session, "history", {"user_id": "alice", "session_id": "trip"})
            assert [m["content"] for m in history["messages"]] == [
                "My sister Lena lives in Lisbon",
                "Book the 9:40 train",
            ]
            resource = await session.read_resource("prme://history/alice/trip")
            assert [m["content"] for m in json.loads(resource.contents[0].text)] == [
                "My sister Lena lives in Lisbon",
                "Book the 9:40 train",
            ]
            templates = (await session.list_resource_templates()).resource_templates
            assert {t.uri_template for t in templates} == {
                "prme://history/{user_id}/{session_id}{?scope}",
                "prme://receipts/{request_id}",
            }

            await call_ok(
                session, "forget_message", {"user_id": "alice", "event_id": said["event_id"]}
            )
            history = await call_ok(session, "history", {"user_id": "alice", "session_id": "trip"})
            assert [m["content"] for m in history["messages"]] == ["My sister Lena lives in Lisbon"]
            # Forgetting the message leaves its memory recallable until it is archived.
            query = {"user_id": "alice", "query": "which train to book", "top_k": 5}
            found = await call_ok(session, "recall", query)
            assert said["node_ids"][0] in [r["node_id"] for r in found["results"]]
            await call_ok(
                session,
                "archive_memory",
                {"user_id": "alice", "node_id": said["node_ids"][0], "reason": "cancelled"},
            )
            found = await call_ok(session, "recall", query)
            assert said["node_ids"][0] not in [r["node_id"] for r in found["results"]]


async def assert_refused(
    session: ClientSession, cases: list[tuple[str, dict[str, Any], str]], kinds: set[str]
) -> None:
    """Each ``(tool, arguments, field)`` is a tool error of one of ``kinds`` naming
    ``field``."""
    for tool, arguments, field in cases:
        result = await session.call_tool(tool, arguments)
        assert result.is_error, (tool, arguments, text_of(result))
        assert result.structured_content["error"] in kinds, text_of(result)
        assert field in text_of(result), (tool, arguments, text_of(result))


async def test_stdio_bad_arguments_name_the_field_and_write_nothing(tmp_path: Path) -> None:
    cases = [
        ("remember", {"user_id": "alice", "content": 42}, "$.content"),
        ("remember", {"user_id": "alice", "content": "x", "role": "robot"}, "$.role"),
        ("remember", {"user_id": "alice", "content": "x", "colour": "red"}, "colour"),
        ("remember", {"user_id": "alice", "content": "x", "wait": False}, "$.wait"),
        ("remember", {"user_id": "alice"}, "content"),
        ("remember", {"content": "no owner"}, "user_id"),
        ("remember", {"user_id": 7, "content": "x"}, "$.user_id"),
        ("recall", {"user_id": "alice", "query": "x", "top_k": "3"}, "$.top_k"),
        ("recall", {"user_id": "alice", "query": "x", "fusion": "best"}, "$.fusion"),
        ("history", {"user_id": "alice", "limit": 0}, "$.limit"),
        ("archive_memory", {"user_id": "alice"}, "node_id"),
        ("forget_message", {"user_id": "alice", "event_id": "nope"}, "nope"),
    ]
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            "--data-dir", str(tmp_path), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
        ) as session:
            await assert_refused(session, cases, {"invalid_input", "not_found"})
            history = await call_ok(session, "history", {"user_id": "alice"})
            assert history["messages"] == []
    assert await records_of(tmp_path, "alice") == []


async def test_stdio_user_id_option_pins_the_owner(tmp_path: Path) -> None:
    pack = ["--data-dir", str(tmp_path)]
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            *pack, "--user-id", "alice", errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
        ) as session:
            tools = (await session.list_tools()).tools
            assert all("user_id" not in t.input_schema.get("required", []) for t in tools)
            await remember_then_recall(session)
            refused = await session.call_tool("recall", {"query": "sister", "user_id": "bob"})
            assert refused.is_error and refused.structured_content["error"] == "forbidden"
            assert "alice" in text_of(refused) and "results" not in refused.structured_content
            with pytest.raises(MCPError, match="forbidden"):
                await session.read_resource("prme://history/bob/trip")
    assert [row.record.owner for row in await records_of(tmp_path, "alice")] == ["alice"]
    assert await records_of(tmp_path, "bob") == []


async def test_http_keys_bind_each_caller_to_its_owner(tmp_path: Path) -> None:
    env = clean_env(PRME_SERVICE__API_KEYS=json.dumps(KEYS))
    async with asyncio.timeout(BOUND_S):
        with mcp_http(tmp_path, env=env) as url:
            # No key, or an unknown one: 401 before any MCP message is read.
            # Or a credential header sent twice (which one would be the caller?).
            twice = [("Authorization", "Bearer sk-alice"), ("Authorization", "Bearer sk-bob")]
            for headers in ({}, {"Authorization": "Bearer sk-nobody"}, twice):
                response = httpx.post(url, json={}, headers=headers, timeout=30)
                assert response.status_code == 401
                assert response.json()["error"] == "unauthenticated"

            async with http_session(url, "sk-bob") as bob:
                await call_ok(bob, "remember", {"content": "The vault code is 4512"})
                bob_recall = await call_ok(bob, "recall", {"query": "vault code"})

            async with http_session(url, "sk-alice") as alice:
                tools = (await alice.list_tools()).tools
                assert {t.name for t in tools} == TOOLS
                for tool in tools:
                    jsonschema.Draft202012Validator.check_schema(tool.input_schema)
                    assert "user_id" not in tool.input_schema.get("required", [])
                await remember_then_recall(alice)
                for tool, arguments, field in [
                    ("remember", {"content": 42}, "$.content"),
                    ("recall", {"query": "x", "top_k": "3"}, "$.top_k"),
                ]:
                    bad = await alice.call_tool(tool, arguments)
                    assert bad.is_error and bad.structured_content["error"] == "invalid_input"
                    assert field in text_of(bad)
                own = await call_ok(alice, "recall", {"query": "vault code"})
                assert "4512" not in own["text"]
                assert all(r["owner"] == "alice" for r in own["results"])
                for tool, arguments in [
                    ("recall", {"query": "vault code", "user_id": "bob"}),
                    ("remember", {"content": "planted", "user_id": "bob"}),
                    ("history", {"user_id": "bob"}),
                ]:
                    refused = await alice.call_tool(tool, arguments)
                    assert refused.is_error, tool
                    assert refused.structured_content["error"] == "forbidden"
                    assert "4512" not in text_of(refused)
                with pytest.raises(MCPError, match="forbidden"):
                    await alice.read_resource("prme://history/bob/default")
                # Another owner's receipt is answered as an unknown one: not_found, no owner.
                with pytest.raises(MCPError, match="not_found") as theirs:
                    await alice.read_resource(bob_recall["receipt_uri"])
                with pytest.raises(MCPError, match="not_found") as unknown:
                    await alice.read_resource("prme://receipts/no-such-receipt")
                assert "bob" not in str(theirs.value)
                assert str(theirs.value).replace(bob_recall["receipt_id"], "?") == str(
                    unknown.value
                ).replace("no-such-receipt", "?")
                listed = (await alice.list_resources()).resources
                assert bob_recall["receipt_uri"] not in [str(r.uri) for r in listed]

            async with http_session(url, "sk-admin") as admin:
                tools = (await admin.list_tools()).tools
                assert all("user_id" in t.input_schema["required"] for t in tools)
                seen = await call_ok(admin, "recall", {"query": "vault code", "user_id": "bob"})
                assert "4512" in seen["text"]
    assert [row.record.content for row in await records_of(tmp_path, "bob")] == [
        "The vault code is 4512"
    ]
    assert [row.record.content for row in await records_of(tmp_path, "alice")] == [
        "My sister Lena lives in Lisbon"
    ]


async def test_http_without_keys_reads_its_writes_on_loopback(tmp_path: Path) -> None:
    async with asyncio.timeout(BOUND_S):
        with mcp_http(tmp_path, "--user-id", "alice", env=clean_env()) as url:
            async with http_session(url, None) as session:
                await remember_then_recall(session)


def test_http_refuses_to_listen_beyond_loopback_without_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PRME_SERVICE__API_KEYS", raising=False)
    code = main(["mcp", "--http", "--host", "0.0.0.0", "--data-dir", str(tmp_path / "pack")])
    assert code == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in capsys.readouterr().err
    assert not (tmp_path / "pack").exists()


def test_http_on_a_taken_port_or_with_a_bad_user_id_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both printed a traceback (a taken port) or started and refused every call (a
    ``--user-id`` that is no owner id)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        code = main(["mcp", "--http", "--port", port, "--data-dir", str(tmp_path / "pack")])
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    for bad in (" me ", ""):
        assert main(["mcp", "--user-id", bad, "--data-dir", str(tmp_path / "pack")]) == 2
        err = capsys.readouterr().err
        assert "mcp.user_id (--user-id)" in err and "Traceback" not in err
    assert not (tmp_path / "pack").exists()


async def test_in_front_of_a_running_service(tmp_path: Path) -> None:
    service_env = clean_env(PRME_SERVICE__API_KEYS=json.dumps({"sk-svc-alice": "alice"}))
    async with asyncio.timeout(BOUND_S):
        with prme_serve(tmp_path / "pack", service_env) as service:
            env = clean_env(PRME_MCP__API_KEY="sk-svc-alice")
            front = ["--url", service, "--user-id", "alice"]
            async with stdio_session(
                *front, env=env, errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
            ) as session:
                await remember_then_recall(session)
                refused = await session.call_tool("recall", {"query": "x", "user_id": "bob"})
                assert refused.is_error and refused.structured_content["error"] == "forbidden"
            # The memory is the service's: its own client reads it back.
            async with AsyncMemoryClient(url=service, api_key="sk-svc-alice") as client:
                history = await client.history("alice", "trip")
            assert [m.content for m in history] == ["My sister Lena lives in Lisbon"]
            # An MCP server pinned to bob with alice's service key: the service refuses.
            wrong = ["--url", service, "--user-id", "bob"]
            async with stdio_session(
                *wrong, env=env, errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
            ) as session:
                refused = await session.call_tool("remember", {"content": "x"})
                assert refused.is_error and refused.structured_content["error"] == "forbidden"


async def test_a_pack_held_by_another_server_fails_at_start_with_advice(tmp_path: Path) -> None:
    async with asyncio.timeout(BOUND_S):
        with mcp_http(tmp_path, "--user-id", "alice", env=clean_env()) as url:
            async with http_session(url, None) as session:
                await call_ok(session, "remember", {"content": "the pack now has shards"})
            second = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "prme.cli", "mcp", "--data-dir", str(tmp_path)],
                env=clean_env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=120,
            )
    assert second.returncode == 2
    assert second.stdout == ""  # nothing but MCP messages ever goes to stdout
    assert "open in another process" in second.stderr
    assert "prme mcp --url" in second.stderr
    assert "Traceback" not in second.stderr


def test_the_walk_through_example_runs_as_documented(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "mcp_client.py"
    run = subprocess.run(
        [sys.executable, str(example), str(tmp_path / "walk")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "tools: remember, recall, history, forget_message, archive_memory"
    assert "(user, trip) My sister Lena lives in Lisbon" in run.stdout
    assert "history: user: My sister Lena lives in Lisbon" in lines
    assert lines[-1] == "as bob: forbidden: this MCP server acts only for owner 'alice'"


async def test_an_argument_too_long_for_a_url_is_invalid_input_not_a_protocol_error(
    tmp_path: Path,
) -> None:
    """In front of a service a session id goes into a query string; one too long for a URL
    is refused as invalid input by the client, and by the tool as a tool error."""
    huge = "s" * 100_000
    async with asyncio.timeout(BOUND_S):
        with prme_serve(tmp_path / "pack", clean_env()) as service:
            async with AsyncMemoryClient(url=service) as client:
                with pytest.raises(InvalidInput, match="too long"):
                    await client.history("mo", huge)
            front = ["--url", service, "--user-id", "mo"]
            async with stdio_session(
                *front, env=clean_env(), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
            ) as session:
                result = await session.call_tool("history", {"session_id": huge})
                assert result.is_error and result.structured_content["error"] == "invalid_input"


async def test_tool_arguments_are_checked_as_the_http_api_checks_them(tmp_path: Path) -> None:
    """The HTTP API's field rules (docs/HTTP.md "Validation") hold for every tool and the
    history resource: a bad id is invalid_input naming the field, never an empty answer."""
    long = "s" * 5000
    cases = [
        ("history", {"user_id": ""}, "$.user_id"),
        ("history", {"user_id": " x "}, "$.user_id"),
        ("history", {"user_id": "mo", "session_id": long}, "$.session_id"),
        ("history", {"user_id": "mo", "session_id": ""}, "$.session_id"),
        ("history", {"user_id": "mo", "scope": ""}, "$.scope"),
        ("forget_message", {"user_id": "", "event_id": "x"}, "$.user_id"),
        ("forget_message", {"user_id": "mo", "event_id": ""}, "$.event_id"),
        ("archive_memory", {"user_id": "mo", "node_id": ""}, "$.node_id"),
    ]
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            "--data-dir", str(tmp_path), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
        ) as session:
            await assert_refused(session, cases, {"invalid_input"})
            with pytest.raises(MCPError, match=r"invalid_input.*\$\.session_id"):
                await session.read_resource(f"prme://history/mo/{long}")
            with pytest.raises(MCPError, match=r"invalid_input.*\$\.user_id"):
                await session.read_resource("prme://history/%20x%20/trip")
        async with stdio_session(
            "--data-dir",
            str(tmp_path),
            "--user-id",
            "me",
            errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr"),
        ) as pinned:
            result = await pinned.call_tool("history", {"session_id": ""})
            assert result.is_error and result.structured_content["error"] == "invalid_input"
            assert "$.session_id" in text_of(result)
    assert await records_of(tmp_path, "mo") == []


async def test_recall_says_how_many_matched_when_none_fit_the_token_budget(
    tmp_path: Path,
) -> None:
    async with asyncio.timeout(BOUND_S):
        async with stdio_session(
            "--data-dir",
            str(tmp_path),
            "--user-id",
            "mo",
            errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr"),
        ) as session:
            await call_ok(session, "remember", {"content": "My cat is called Miso"})
            result = await session.call_tool("recall", {"query": "cat", "token_budget": 1})
            assert not result.is_error, text_of(result)
            assert result.structured_content["omitted"]
            text = text_of(result)
            assert "No memories matched" not in text
            assert "1 memory matched" in text and "token_budget=1" in text, text


async def test_receipts_never_outlive_their_owner_in_front_of_a_service(tmp_path: Path) -> None:
    """A receipt holds its recall's query: resources/list never shows it, and once the owner
    is erased (here through the service) the receipt is not served any more."""
    query = "Who is Bob's therapist Kowalski?"
    async with asyncio.timeout(BOUND_S):
        with prme_serve(tmp_path / "pack", clean_env()) as service:
            front = ["--url", service, "--user-id", "bob"]
            async with stdio_session(
                *front, env=clean_env(), errlog=tmp_path.with_name(f"{tmp_path.name}-mcp.stderr")
            ) as session:
                await call_ok(session, "remember", {"content": "Dr Kowalski sees me on Fridays"})
                recalled = await call_ok(session, "recall", {"query": query})
                listed = (await session.list_resources()).resources
                assert [str(r.uri) for r in listed] == [recalled["receipt_uri"]]
                assert "Kowalski" not in json.dumps([r.model_dump() for r in listed])
                before = await session.read_resource(recalled["receipt_uri"])
                assert json.loads(before.contents[0].text)["query"] == query

                erased = httpx.delete(f"{service}/v1/owners", params={"user_id": "bob"}, timeout=60)
                assert erased.status_code == 200, erased.text

                with pytest.raises(MCPError, match="not_found") as refused:
                    await session.read_resource(recalled["receipt_uri"])
                assert "Kowalski" not in str(refused.value)
                listed = (await session.list_resources()).resources
                assert recalled["receipt_uri"] not in [str(r.uri) for r in listed]


def initialize_request(client: str) -> dict[str, Any]:
    """The JSON-RPC ``initialize`` request of a raw client named ``client``."""
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": client, "version": "0"},
        },
    }


def _initialize(url: str, key: str) -> str:
    """A new streamable-HTTP session opened with ``key``; its ``mcp-session-id``."""
    body = initialize_request("test")
    response = httpx.post(url, json=body, headers=_mcp_headers(key), timeout=60)
    assert response.status_code == 200, response.text
    session_id = response.headers["mcp-session-id"]
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    headers = _mcp_headers(key, session_id)
    assert httpx.post(url, json=initialized, headers=headers, timeout=60).status_code == 202
    return session_id


def _mcp_headers(key: str, session_id: str | None = None) -> dict[str, str]:
    headers = {
        "Authorization": f"Bearer {key}",
        "Accept": "application/json, text/event-stream",
        "Content-Type": "application/json",
    }
    if session_id is not None:
        headers["mcp-session-id"] = session_id
    return headers


async def test_http_sessions_belong_to_the_key_that_opened_them(tmp_path: Path) -> None:
    env = clean_env(PRME_SERVICE__API_KEYS=json.dumps(KEYS))
    list_tools = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    async with asyncio.timeout(BOUND_S):
        with mcp_http(tmp_path, env=env) as url:
            alice = await asyncio.to_thread(_initialize, url, "sk-alice")
            for key in ("sk-bob", "sk-admin"):
                headers = _mcp_headers(key, alice)
                used = httpx.post(url, json=list_tools, headers=headers, timeout=60)
                assert used.status_code == 404, (key, used.text)
                ended = httpx.delete(url, headers=headers, timeout=60)
                assert ended.status_code == 404, (key, ended.text)
                assert "Session not found" in ended.text
            # Refused as an unknown session would be, and still alice's.
            unknown = httpx.delete(url, headers=_mcp_headers("sk-bob", "0" * 32), timeout=60)
            assert unknown.status_code == 404 and unknown.text == ended.text
            mine = httpx.post(url, json=list_tools, headers=_mcp_headers("sk-alice", alice))
            assert mine.status_code == 200 and "recall" in mine.text
            ended = httpx.delete(url, headers=_mcp_headers("sk-alice", alice), timeout=60)
            assert ended.status_code == 200


async def test_stdio_answers_a_line_it_cannot_read_instead_of_dropping_it(tmp_path: Path) -> None:
    """The SDK drops a stdio line its parser refuses (a tool call nested 200 levels deep:
    it stops at 128), and the client waited for the answer forever. Each such line is now
    answered with a JSON-RPC error for its id, and the server goes on serving."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *("-m", "prme.cli", "mcp", "--data-dir", str(tmp_path / "pack"), "--user-id", "alice"),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=clean_env(),
    )
    assert process.stdin is not None and process.stdout is not None

    async def send(message: Any) -> None:
        assert process.stdin is not None
        line = message if isinstance(message, str) else json.dumps(message)
        process.stdin.write(line.encode() + b"\n")
        await process.stdin.drain()

    async def answer() -> dict[str, Any]:
        assert process.stdout is not None
        return dict(json.loads(await asyncio.wait_for(process.stdout.readline(), 60)))

    def call(request_id: int, arguments: dict[str, Any]) -> dict[str, Any]:
        params = {"name": "remember", "arguments": arguments}
        return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}

    try:
        async with asyncio.timeout(BOUND_S):
            await send(initialize_request("raw"))
            assert (await answer())["id"] == 1
            await send({"jsonrpc": "2.0", "method": "notifications/initialized"})
            deep: Any = {"a": 1}
            for _ in range(200):
                deep = [deep]
            await send(call(7, {"content": "too deep", "metadata": {"a": deep}}))
            too_deep = await answer()
            assert too_deep["id"] == 7 and too_deep["error"]["code"] == -32700
            assert "recursion limit" in too_deep["error"]["message"]
            await send('{"jsonrpc": "2.0", "id": 8, "method": ')
            broken = await answer()
            assert broken["id"] is None and broken["error"]["code"] == -32700
            await send({"jsonrpc": "2.0", "id": 9, "nothing": "of JSON-RPC"})
            assert (await answer())["error"]["code"] == -32600
            await send(call(10, {"content": "still served"}))
            served = await answer()
            assert served["id"] == 10 and not served["result"].get("isError"), served
    finally:
        process.stdin.close()
        await asyncio.wait_for(process.wait(), 60)
