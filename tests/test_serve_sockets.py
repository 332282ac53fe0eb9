"""Sockets handed to run_server get Nagle turned off on their connections."""

from __future__ import annotations

import socket

from prme.query.serve import _tcp_sockets, describe_log
from prme.schemas.config import Settings


def test_a_plain_listener_is_handed_on_as_a_tcp_socket_so_asyncio_sets_nodelay() -> None:
    # asyncio sets TCP_NODELAY only when sock.proto is IPPROTO_TCP; socket.socket() says 0,
    # and then every response on a reused connection waited ~40 ms for a delayed ACK.
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen()
    try:
        (handed,) = _tcp_sockets([plain])
        try:
            assert plain.proto == 0
            assert handed.proto == socket.IPPROTO_TCP
            assert handed.getsockname() == plain.getsockname()
        finally:
            handed.close()
        assert plain.fileno() != -1  # the caller's socket stays open and theirs
    finally:
        plain.close()


def test_a_node_says_which_log_it_reads() -> None:
    """From a new-user trial: a node started with a misspelt PRME_LOG_TRANSPORT ran on the
    embedded log, and nothing it logged said so."""
    kafka = Settings(data_dir="/d").replace(
        log={"transport": "kafka", "bootstrap": "127.0.0.1:9092", "topic": "t"},
        cluster={"group": "g"},
    )
    assert describe_log(kafka) == "log: Kafka at 127.0.0.1:9092, topic t, group g; data dir /d"
    embedded = Settings(data_dir="/d").replace(log={"partitions": 6})
    assert describe_log(embedded) == "log: embedded, 6 partitions in /d"
