"""API-key authentication and owner authorization for the HTTP service.

Keys come from ``ServiceSettings.api_keys`` (key -> owner; owner ``*`` is an admin key).
With no keys configured the service is open, which is only allowed on a loopback host.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Iterable, Mapping

import msgspec

from prme.schemas.config import ServiceSettings
from prme.schemas.errors import ConfigurationError, Forbidden, Unauthenticated

from .http_types import CALLER_HEADER, OPEN_ENTRY_HEADER, SECRET_HEADER

ADMIN = "*"

AUTHENTICATING_HEADERS = frozenset(
    {"authorization", "x-api-key", SECRET_HEADER, CALLER_HEADER, OPEN_ENTRY_HEADER}
)
"""The headers that say who a request comes from (lower-case)."""

__all__ = [
    "ADMIN",
    "AUTHENTICATING_HEADERS",
    "ApiKeys",
    "Caller",
    "Unauthenticated",
    "check_bind_safety",
    "is_loopback",
    "refuse_repeated_credentials",
]


def refuse_repeated_credentials(raw_headers: Iterable[tuple[bytes, bytes]]) -> None:
    """``Unauthenticated`` when a request sends one of :data:`AUTHENTICATING_HEADERS`
    twice with different values: the layers that read it (forwarding took the last, the
    app the first) would each see another caller. (An open service has no callers to tell
    apart: its call sites skip this.)"""
    seen: dict[str, bytes] = {}
    for raw_name, value in raw_headers:
        name = raw_name.decode("latin-1").lower()
        value = value.strip()
        if name in AUTHENTICATING_HEADERS and seen.setdefault(name, value) != value:
            raise Unauthenticated(f"the {name} header is sent twice, with different values")


class Caller(msgspec.Struct, frozen=True):
    """Who is calling: the owner their key is bound to, or ``*`` (admin, or an open service)."""

    owner: str
    acted_for: list[str] = msgspec.field(default_factory=list)
    """Owners :meth:`authorize` let this caller act for (the access log hashes them)."""
    key_id: str | None = None
    """Which configured key authenticated the caller (a SHA-256 of it, never the key);
    None on an open service or for a caller forwarded by another node."""

    @property
    def is_admin(self) -> bool:
        return self.owner == ADMIN

    def authorize(self, user_id: str) -> None:
        """Forbidden unless this caller may act for ``user_id``. Compared as UTF-8 bytes:
        ``compare_digest`` refuses ``str`` with non-ASCII characters (a TypeError)."""
        if not self.is_admin and not _same_owner(self.owner, user_id):
            raise Forbidden(f"this API key may not act for owner {user_id!r}")
        self.acted_for.append(user_id)

    def authorize_all(self, user_ids: Iterable[str]) -> None:
        for user_id in user_ids:
            self.authorize(user_id)


def _same_owner(bound: str, user_id: str) -> bool:
    # surrogatepass: a lone surrogate cannot reach here from JSON, but must not raise either.
    return hmac.compare_digest(
        bound.encode("utf-8", "surrogatepass"), user_id.encode("utf-8", "surrogatepass")
    )


class ApiKeys:
    """Resolves the key of a request to a :class:`Caller`."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys = [(key.encode(), owner) for key, owner in keys.items()]

    @property
    def open(self) -> bool:
        """No keys configured: every caller acts as admin."""
        return not self._keys

    def authenticate(self, authorization: str | None, api_key: str | None) -> Caller:
        """The caller of ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""
        if self.open:
            return Caller(ADMIN)
        # Every credential presented must hold: a bad one is never skipped for the other.
        keys: set[str] = set()
        if authorization is not None:
            scheme, _, credentials = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not credentials.strip():
                raise Unauthenticated("the Authorization header must be 'Bearer <API key>'")
            keys.add(credentials.strip())
        if api_key is not None:
            if not api_key.strip():
                raise Unauthenticated("the X-API-Key header is empty")
            keys.add(api_key.strip())
        if not keys:
            raise Unauthenticated(
                "an API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key'"
            )
        if len(keys) > 1:
            raise Unauthenticated("Authorization and X-API-Key name different keys")
        presented = keys.pop().encode()
        owner: str | None = None
        # Compare against every key so the time taken does not tell which one matched.
        for known, bound in self._keys:
            if hmac.compare_digest(known, presented):
                owner = bound
        if owner is None:
            raise Unauthenticated("unknown API key")
        return Caller(owner, key_id=hashlib.sha256(presented).hexdigest())


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind_safety(service: ServiceSettings, sockets: Iterable[socket.socket] = ()) -> None:
    """Refuse to serve without API keys on anything but a loopback address."""
    if service.api_keys:
        return
    hosts = [str(s.getsockname()[0]) for s in sockets] or [service.host]
    exposed = [host for host in hosts if not is_loopback(host)]
    if exposed:
        raise ConfigurationError(
            f"refusing to serve on {exposed[0]} without API keys: anyone who can reach it "
            "could read and erase every owner's memories. Configure PRME_SERVICE__API_KEYS "
            '(e.g. \'{"<key>": "<owner>", "<admin key>": "*"}\') or bind to 127.0.0.1'
        )
