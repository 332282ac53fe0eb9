"""Routing in a cluster: which node answers an owner, and how a request gets there.

Kafka Streams calls this interactive queries. The consumer group decides who owns each
partition (``producers/kafka_membership.py``); every node keeps the map, serves the
partitions it owns, forwards a read for any other owner to that owner's node, and forwards
the *wait* of a write it appended itself (read-your-writes). During a rebalance a request
waits for the new owner, bounded by ``query.consistency_timeout_s``, then answers 503 with
``Retry-After``. A forwarded request carries the cluster secret and the caller the entry
node authenticated; the owner's node checks the secret and authorizes that caller again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import Mapping

import httpx
import msgspec

from prme.producers.transport import LogTransport
from prme.projectors.runner import ProjectorRunner
from prme.schemas.cluster import ClusterMap, other_topic_refusal, static_map
from prme.schemas.config import Settings
from prme.schemas.errors import (
    ConsistencyTimeout,
    Forbidden,
    ShardUnavailable,
    TransportError,
    Unauthenticated,
)
from prme.schemas.metrics import Metrics

from .http_client import error_from_response
from .http_types import (
    CALLER_HEADER,
    NOT_OWNER_HEADER,
    OPEN_ENTRY_HEADER,
    SECRET_HEADER,
    STARTING_HEADER,
    WaitRequest,
)
from .pooled_http import ResendingPool
from .routes import is_repeatable

MAP_POLL_S = 0.5
"""How often a serve-only node re-reads the map while a request waits on a rebalance."""
MAP_REFRESH_S = 5.0
"""How often a serve-only node re-reads the map otherwise."""
_log = logging.getLogger("prme.cluster")
OWNER_ANSWER_MARGIN_S = 2.0
"""How long past its consistency timeout an owner may take to send the answer it then gives."""
UNREACHABLE_LOG_EVERY_S = 10.0
"""A peer that cannot be reached is logged at most this often (each waiting request retried
it every ``MAP_POLL_S``, a line each)."""
REFUSAL_LOG_EVERY_S = 60.0
"""A hop refused for the cluster secret is logged at most this often per peer."""


class NotOwner(ShardUnavailable):
    """This node does not own the partition; the map is changing (503, Retry-After)."""


class ServedByWorker(NotOwner):
    """The partition's owner is a ``prme project`` worker, which serves no requests: a
    misconfigured group, not a slow one (503 at once)."""


class NodeRefused(NotOwner):
    """The group gave this node nothing, and the partition's owner advertises this node's
    own URL: nothing here can serve or confirm it (503 at once, a write not appended)."""


class HopBroken(NotOwner):
    """The connection to the owner broke after a write was sent: the owner may have
    applied it, so it is neither sent again nor appended here (504
    ``append_unconfirmed``: retry with the same request id)."""


class OwnerUnreachable(NotOwner):
    """A write's owner did not take the connection: nothing was sent (the entry node may
    append it itself)."""


class HopRefused(NotOwner):
    """The partition's owner refused this node's cluster secret: a misconfigured cluster,
    not a slow one (503)."""


class ClusterRouter:
    """The map this node routes with, and the forwarding it does."""

    def __init__(
        self,
        settings: Settings,
        runner: ProjectorRunner,
        transport: LogTransport,
        metrics: Metrics,
        *,
        url: str,
    ) -> None:
        self.settings = settings
        self.url = url
        self.runner = runner
        self.transport = transport
        self.metrics = metrics
        self._secret = settings.cluster.secret
        self._last_logged: dict[tuple[str, str], float] = {}
        """(what, peer) -> when a line about it was last logged (``_log_at_most``)."""
        self._polled: ClusterMap | None = None
        self._changed = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._urgent = asyncio.Event()
        timeout = httpx.Timeout(
            settings.cluster.forward_timeout_s, connect=min(settings.cluster.forward_timeout_s, 5.0)
        )
        self._http = ResendingPool(timeout=timeout, max_connections=256)

    async def start(self) -> None:
        if not self._secret and self.settings.log.transport == "kafka":
            _log.warning(
                "PRME_CLUSTER__SECRET is not set: this node can neither forward requests to "
                "the other nodes of its group nor answer theirs (give every node one secret)"
            )
        members = list(self.settings.cluster.static_members)
        if members:
            self._polled = static_map(members, self.transport.partitions)
        elif hasattr(self.transport, "cluster_map"):
            if self.settings.cluster.project:
                # A member whose projector fails leaves the group (no more maps come with
                # assignments): from then on it routes like a serve-only node.
                self._poller = asyncio.create_task(
                    self._poll_after_leaving(), name="prme-cluster-map"
                )
            else:
                await self._poll_once()
                self._poller = asyncio.create_task(self._poll(), name="prme-cluster-map")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
        await self._http.aclose()

    # -- the map -----------------------------------------------------------------------

    @property
    def cluster_map(self) -> ClusterMap | None:
        """The newest map this node knows: its own (a member) or the group's (serve-only)."""
        own = self.runner.cluster_map
        if self._polled is None:
            return own
        if own is None or self._polled.generation > own.generation:
            return self._polled
        return own

    def refused_for(self, partition: int) -> NodeRefused | None:
        """Why this node can do nothing for ``partition``: the group refused it, and the
        map names its own URL (another member's) as the owner. None otherwise."""
        refusal = self.runner.refusal
        cluster_map = self.cluster_map
        if refusal is None or cluster_map is None or cluster_map.owner(partition) != self.url:
            return None
        return NodeRefused(f"this node serves no partition: {refusal}")

    def append_refusal(self) -> str | None:
        """Why this node must append nothing: it reads another topic than its group's (a
        member the group gave no partitions, or a serve-only node routing for a group of
        another topic), so what it appended would never be served; or it has no API keys
        while the group's nodes have (it would write any owner for anyone). None
        otherwise."""
        cluster_map = self.cluster_map
        if cluster_map is None:
            return None
        topic = self.settings.log.topic
        if cluster_map.topic and cluster_map.topic != topic:
            return other_topic_refusal(topic, cluster_map)
        if not self.settings.service.api_keys and any(m.keyed for m in cluster_map.members):
            return (
                "it has no API keys and the nodes of its group have (give every node the "
                "same PRME_SERVICE__API_KEYS)"
            )
        return None

    def partition_of(self, owner: str) -> int:
        return self.transport.partition_for(owner.encode("utf-8", "surrogatepass"))

    def owns(self, partition: int) -> bool:
        return partition in self.runner.shards

    async def _poll_once(self) -> None:
        try:
            found = await self.transport.cluster_map(self.settings.cluster.group)  # type: ignore[attr-defined]
        except (TransportError, OSError) as error:
            _log.warning("cluster map unavailable: %s", error)
            return
        if found is not None and (self._polled is None or found != self._polled):
            self._polled = found
            self._changed.set()

    async def _poll_after_leaving(self) -> None:
        await self.runner.left_group.wait()
        await self._poll_once()
        await self._poll()

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), MAP_REFRESH_S)
            self._urgent.clear()
            try:
                await self._poll_once()
            except Exception:  # a malformed description: keep the last map, try again
                _log.exception("reading the cluster map failed")

    async def _await_change(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the map or this node's assignment to change."""
        if timeout_s <= 0:
            return
        self._changed.clear()
        self._urgent.set()
        waiters = [
            asyncio.ensure_future(self.runner.wait_changed(timeout_s)),
            asyncio.ensure_future(self._changed.wait()),
        ]
        try:
            await asyncio.wait(waiters, timeout=min(timeout_s, MAP_POLL_S))
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def resolve(self, partition: int, timeout_s: float) -> str | None:
        """None when ``partition`` is served here (waiting until it has caught up), else
        the URL of the node that owns it; NotOwner once ``timeout_s`` passes."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            remaining = deadline - loop.time()
            if self.owns(partition):
                if await self.runner.wait_serving(partition, remaining):
                    return None
                if not self.owns(partition):
                    continue
                raise NotOwner(
                    f"partition {partition} is being restored on this node and did not catch "
                    f"up within {timeout_s:.1f}s"
                )
            cluster_map = self.cluster_map
            owner = None if cluster_map is None else cluster_map.owner(partition)
            if owner and owner != self.url:
                return owner
            if (refused := self.refused_for(partition)) is not None:
                raise refused
            if owner == "":  # a settled map: waiting for a change would only wait it out
                raise ServedByWorker(
                    f"partition {partition} is projected by a `prme project` worker, which "
                    "serves no requests: run the workers in a group of their own, or serve "
                    "the partitions with `prme serve`"
                )
            if remaining <= 0:
                if (failure := self.runner.failure) is not None:
                    # This node left the group: "rebalancing" promised a wait that ends.
                    raise NotOwner(
                        f"no node serves partition {partition}: this node's projector "
                        f"stopped ({failure!r}) and no other member has taken it over; "
                        f"waited {timeout_s:.1f}s"
                    )
                raise NotOwner(
                    f"no node serves partition {partition} yet (the group is rebalancing); "
                    f"waited {timeout_s:.1f}s"
                )
            await self._await_change(remaining)

    # -- forwarding --------------------------------------------------------------------

    def check_forwarded(self, headers: Mapping[str, str]) -> str | None:
        """The caller a forwarded request names, after checking its cluster secret
        (Unauthenticated without a valid one; Forbidden when a node with API keys gets it
        from a node without: an open node lets anyone in as ``*``); None for a request
        from a client."""
        caller = headers.get(CALLER_HEADER)
        presented = headers.get(SECRET_HEADER)
        if caller is None and presented is None:
            return None
        if not self._secret or presented is None:
            refused = "a forwarded request needs the cluster secret (PRME_CLUSTER__SECRET)"
            self._note_refusal("in", f"refused a forwarded request: {refused}")
            raise Unauthenticated(refused)
        if not hmac.compare_digest(presented.encode(), self._secret.encode()):
            self._note_refusal(
                "in",
                "refused a forwarded request with another cluster secret: a node of this "
                "group has a different PRME_CLUSTER__SECRET",
            )
            raise Unauthenticated("wrong cluster secret on a forwarded request")
        if caller is None:
            raise Unauthenticated("a forwarded request must name its caller")
        if headers.get(OPEN_ENTRY_HEADER) and self.settings.service.api_keys:
            refused = (
                "the node this request entered has no API keys, and this node does not act "
                "on what an open node let in (give every node of the cluster the same "
                "PRME_SERVICE__API_KEYS)"
            )
            self._note_refusal("in", f"refused a forwarded request: {refused}")
            raise Forbidden(refused)  # 403: the entry node relays it (a 401 names the secret)
        return caller

    def _note_refusal(self, peer: str, message: str) -> None:
        """Count a hop refused for the cluster secret (either way) and log it, once a
        minute per peer: a serve-only node is not a member of the group, which refuses
        projecting nodes with another secret, so only its hops show it."""
        self.metrics.cluster_forwards.labels("refused").inc()
        self._log_at_most(REFUSAL_LOG_EVERY_S, "refused", peer, logging.WARNING, message)

    def _log_at_most(self, every_s: float, what: str, peer: str, level: int, message: str) -> None:
        """Log ``message`` unless a line of the kind ``what`` about ``peer`` was logged
        within ``every_s``."""
        now = time.monotonic()
        if now - self._last_logged.get((what, peer), -every_s) >= every_s:
            self._last_logged[(what, peer)] = now
            _log.log(level, "%s", message)

    def _hop_headers(self, caller: str) -> dict[str, str]:
        if not self._secret:
            raise NotOwner(
                "this node would forward the request to the partition's owner, but "
                "PRME_CLUSTER__SECRET is not set (the nodes of a cluster share one)"
            )
        headers = {SECRET_HEADER: self._secret, CALLER_HEADER: caller}
        if not self.settings.service.api_keys:  # every caller is admin here: say so
            headers[OPEN_ENTRY_HEADER] = "1"
        return headers

    async def forward(
        self,
        partition: int,
        method: str,
        target: str,
        *,
        caller: str,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
        resendable: bool = False,
        wait_for_unreachable: bool = True,
    ) -> httpx.Response | None:
        """Send the request to ``partition``'s owner and return its answer; None when this
        node owns the partition (serve it here). Retries, until ``timeout_s``, while the
        owner is unreachable or answers that it does not own the partition; a write
        (not repeatable) whose owner refuses the connection raises ``OwnerUnreachable``
        at once, and so does a read with ``wait_for_unreachable=False``. An answer is awaited as long as the owner may take to give it: a read's,
        the owner's consistency timeout (its wait for a token or for the partition); a
        write's, its wait for the partition, the append and the wait to apply it.
        ``resendable``: a write whose request ids make it harmless to send twice (the
        owner answers a repeat with the first write); see :meth:`_hop`."""
        loop = asyncio.get_running_loop()
        repeatable = is_repeatable(method, target)
        consistency_s = self.settings.query.consistency_timeout_s
        # The owner may take its own consistency timeout to answer a read (a token to wait
        # for, a partition still catching up) and then answers 504 itself: wait for that.
        answer_s = (
            consistency_s + OWNER_ANSWER_MARGIN_S
            if repeatable
            else 2 * consistency_s + self.settings.log.request_timeout_s
        )
        deadline = loop.time() + timeout_s
        while True:
            url = await self.resolve(partition, deadline - loop.time())
            if url is None:
                return None
            sent = {k: v for k, v in headers.items() if k in ("content-type", "accept")}
            sent.update(self._hop_headers(caller))
            left = max(0.1, deadline - loop.time())
            try:
                response = await self._hop(
                    method,
                    url.rstrip("/") + target,
                    body=body,
                    headers=sent,
                    timeout_s=left + answer_s,
                    resendable=repeatable or resendable,
                )
                if response.status_code == 503 and response.headers.get(STARTING_HEADER):
                    # It answers this before it serves: no request reached its app.
                    raise httpx.ConnectError(f"{url} is starting")
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:  # nothing was sent
                self.metrics.cluster_forwards.labels("unreachable").inc()
                if not repeatable or not wait_for_unreachable:
                    raise OwnerUnreachable(
                        f"partition {partition}: its owner {url} is unreachable ({error!r})"
                    ) from error
                self._log_at_most(
                    UNREACHABLE_LOG_EVERY_S,
                    "unreachable",
                    url,
                    logging.INFO,
                    f"forward to {url} failed ({error}); waiting for the map",
                )
            except httpx.HTTPError as error:
                if not repeatable:  # the owner may have applied it
                    raise HopBroken(
                        f"partition {partition}: the connection to its owner {url} broke "
                        f"({error!r}) after the request was sent; it may have been applied"
                    ) from error
                self.metrics.cluster_forwards.labels("unreachable").inc()
            else:
                if response.status_code == 401:  # the hop, not the client: it was checked
                    refused = HopRefused(
                        f"partition {partition}: its owner {url} refused this node's cluster "
                        "secret; every node of a cluster needs the same PRME_CLUSTER__SECRET"
                    )
                    self._note_refusal(
                        url,
                        f"a hop to {url} was refused: the node there has another cluster "
                        "secret (every node needs the same PRME_CLUSTER__SECRET)",
                    )
                    raise refused
                if not response.headers.get(NOT_OWNER_HEADER):
                    self.metrics.cluster_forwards.labels("forwarded").inc()
                    return response
                self.metrics.cluster_forwards.labels("not_owner").inc()
            if loop.time() >= deadline:
                raise NotOwner(
                    f"partition {partition}: its owner {url} did not answer within {timeout_s:.1f}s"
                )
            await self._await_change(deadline - loop.time())

    async def peer_view(self, url: str, timeout_s: float) -> httpx.Response:
        """``GET /v1/cluster`` of the node at ``url`` (what it owns and serves), for a
        status; no secret is sent: the route needs none."""
        return await self._http.get(url.rstrip("/") + "/v1/cluster", timeout_s=timeout_s)

    async def _hop(
        self,
        method: str,
        url: str,
        *,
        body: bytes,
        headers: Mapping[str, str],
        timeout_s: float,
        resendable: bool,
    ) -> httpx.Response:
        """One request to another node, within ``timeout_s``; a ``resendable`` one whose
        pooled connection broke before any answer is sent once more (``pooled_http``)."""

        def resent(error: BaseException) -> None:
            _log.info("a pooled connection to %s broke (%r); sending it again", url, error)
            self.metrics.cluster_forwards.labels("resent").inc()

        return await self._http.request(
            method,
            url,
            content=body,
            headers=headers,
            timeout_s=timeout_s,
            resendable=resendable,
            on_resend=resent,
        )

    async def wait_applied(self, partition: int, offset: int, timeout_s: float) -> None:
        """Read-your-writes across nodes: wait until ``partition``'s owner, wherever it is,
        has applied ``offset``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        body = msgspec.json.encode(
            WaitRequest(partition=partition, offset=offset, timeout_s=timeout_s)
        )
        while True:
            remaining = deadline - loop.time()
            if self.owns(partition):
                await self.runner.wait_applied(partition, offset, max(0.0, remaining))
                return
            try:
                response = await self.forward(
                    partition,
                    "POST",
                    "/v1/cluster/wait",
                    caller="*",
                    body=body,
                    headers={"content-type": "application/json"},
                    timeout_s=max(0.0, remaining),
                )
            except (HopRefused, ServedByWorker):
                raise
            except NotOwner as error:
                waited = timeout_s - max(0.0, deadline - loop.time())
                raise ConsistencyTimeout(
                    f"partition {partition} has not applied offset {offset} after "
                    f"{waited:.1f}s (of {timeout_s:.1f}s): {error}"
                ) from error
            if response is None:
                continue  # became ours meanwhile
            if response.status_code == 200:
                return
            raise error_from_response(response)
