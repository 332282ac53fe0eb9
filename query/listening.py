"""The listening sockets ``prme serve`` binds before it opens anything (a taken port is
refused before the pack is opened or the node joins its group)."""

from __future__ import annotations

import socket

from prme.schemas.errors import ConfigurationError


def listen(host: str, port: int, *, any_if_taken: bool = False) -> socket.socket:
    """A listening socket as uvicorn would bind it; with ``any_if_taken``, a taken
    ``port`` gives any free one. ConfigurationError saying why not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        if any_if_taken and port:
            return listen(host, 0)
        raise ConfigurationError(
            f"cannot listen on {host}:{port}: {error.strerror or error}"
        ) from error
    return sock
