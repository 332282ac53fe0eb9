"""The MCP server's owner rules (docs/MCP.md, "Who a call acts for") and its schema
derivation, without a subprocess."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import jsonschema
import pytest

import prme.adapters
from prme.adapters.mcp_access import OwnerPolicy, Receipts
from prme.adapters.mcp_schema import object_schema
from prme.adapters.mcp_tools import MemoryTools
from prme.cli import main
from prme.query.auth import ADMIN, Caller
from prme.query.http_types import RetrieveRequest
from prme.query.types import EmbeddingInfo, Receipt
from prme.schemas.errors import Forbidden, NotFound


@pytest.mark.parametrize(
    ("pinned", "caller", "implied", "allowed", "refused"),
    [
        ("alice", ADMIN, "alice", "alice", "bob"),  # --user-id, stdio or open HTTP
        (None, "alice", "alice", "alice", "bob"),  # a key bound to alice
        (None, ADMIN, None, "bob", None),  # admin key, or stdio without --user-id
        ("alice", "bob", "alice", None, "alice"),  # bob's key on a server pinned to alice
    ],
)
def test_the_owner_comes_from_the_server_or_the_key_never_the_model_alone(
    pinned: str | None, caller: str, implied: str | None, allowed: str | None, refused: str | None
) -> None:
    policy, who = OwnerPolicy(pinned), Caller(caller)
    assert policy.implied(who) == implied
    if allowed is not None:
        policy.check(who, allowed)
    if refused is not None:
        with pytest.raises(Forbidden):
            policy.check(who, refused)


def test_tool_schemas_inline_the_http_types_and_drop_what_the_tool_decides() -> None:
    schema = object_schema(RetrieveRequest, drop=("fusion",), optional=("user_id",))
    jsonschema.Draft202012Validator.check_schema(schema)
    assert "$ref" not in str(schema) and "$defs" not in schema
    assert schema["required"] == ["query"] and "fusion" not in schema["properties"]
    # The consistency token's own Struct is inlined where it is used.
    token = schema["properties"]["after"]["anyOf"][0]
    assert token["required"] == ["partition", "offset"]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid({"query": "x", "after": {"partition": 1, "offset": 2}})
    assert not validator.is_valid({"query": "x", "after": {"partition": "1", "offset": 2}})
    assert not validator.is_valid({"query": "x", "fusion": "rrf"})


def test_prme_mcp_without_the_sdk_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # As on an install without the [mcp] extra: the SDK's modules cannot be imported.
    for name in [n for n in sys.modules if n.partition(".")[0] in ("mcp", "mcp_types")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "prme.adapters.mcp_server", raising=False)
    # `from prme.adapters import mcp_server` finds a module imported earlier as the
    # package's attribute, whatever sys.modules says.
    monkeypatch.delattr(prme.adapters, "mcp_server", raising=False)
    monkeypatch.setitem(sys.modules, "mcp_types", None)
    monkeypatch.setitem(sys.modules, "mcp", None)
    assert main(["mcp", "--data-dir", str(tmp_path / "pack")]) == 2
    assert 'pip install "prme-memory[mcp]"' in capsys.readouterr().err
    assert not (tmp_path / "pack").exists()


def _receipt(request_id: str, owner: str) -> Receipt:
    return Receipt(
        request_id=request_id,
        owner=owner,
        query="Who is Bob's therapist?",
        scope=None,
        fusion="rrf",
        top_k=10,
        min_score=None,
        min_score_skipped=False,
        channels=[],
        results=[],
        embedding=EmbeddingInfo(
            model_name="m", model_version="1", dimension=3, embed_query_used=True
        ),
        analysis={},
        elapsed_ms=1.0,
    )


def test_another_owners_receipt_is_answered_as_an_unknown_one() -> None:
    receipts, policy = Receipts(8, ttl_s=60.0), OwnerPolicy(None)
    receipts.add(_receipt("r1", "bob"))
    with pytest.raises(NotFound) as theirs:
        receipts.get("r1", Caller("alice"), policy)
    with pytest.raises(NotFound) as unknown:
        receipts.get("r9", Caller("alice"), policy)
    assert str(theirs.value).replace("r1", "?") == str(unknown.value).replace("r9", "?")
    assert "bob" not in str(theirs.value)
    assert receipts.get("r1", Caller("bob"), policy).owner == "bob"


def test_receipts_are_kept_for_a_bounded_time_and_count() -> None:
    now = [1000.0]
    receipts, policy = Receipts(2, ttl_s=60.0, clock=lambda: now[0]), OwnerPolicy(None)
    for name in ("r1", "r2", "r3"):
        receipts.add(_receipt(name, "bob"))
    bob = Caller("bob")
    assert [r.request_id for r in receipts.visible(bob, policy)] == ["r3", "r2"]
    with pytest.raises(NotFound):
        receipts.get("r1", bob, policy)  # pushed out by count
    now[0] += 59.0
    assert receipts.get("r2", bob, policy).request_id == "r2"
    now[0] += 2.0
    with pytest.raises(NotFound):
        receipts.get("r2", bob, policy)  # expired
    assert receipts.visible(bob, policy) == []


def test_an_owners_receipts_can_be_dropped() -> None:
    receipts, policy = Receipts(8, ttl_s=60.0), OwnerPolicy(None)
    receipts.add(_receipt("r-bob", "bob"))
    receipts.add(_receipt("r-alice", "alice"))
    receipts.drop_owner("bob")
    with pytest.raises(NotFound):
        receipts.get("r-bob", Caller(ADMIN), policy)
    assert [r.request_id for r in receipts.visible(Caller(ADMIN), policy)] == ["r-alice"]


class _BrokenClient:
    """A client whose every call fails with an error that is not PRME's own."""

    async def history(self, *args: object, **kwargs: object) -> None:
        raise httpx.InvalidURL("URL component 'query' too long")


async def test_an_unexpected_client_error_is_a_tool_error_not_a_protocol_error() -> None:
    tools = MemoryTools(_BrokenClient(), OwnerPolicy("mo"), Receipts(8, ttl_s=60.0))  # type: ignore[arg-type]
    result = await tools.call("history", {}, Caller(ADMIN))
    assert result.is_error
    assert result.structured_content == {
        "error": "internal",
        "detail": "internal error: InvalidURL",
    }
