"""A writer the contract suite kills mid-batch: prints ``appending`` then appends one large
atomic batch for owner ``crash-owner``."""

from __future__ import annotations

import asyncio
import os
import sys

import msgspec

from prme.producers.factory import open_transport
from prme.producers.transport import LogItem
from prme.schemas.config import Settings


async def main(count: int) -> None:
    settings = msgspec.json.decode(os.environ["PRME_TEST_SETTINGS"], type=Settings)
    transport = open_transport(settings)
    await transport.start()
    payload = b"x" * 1000
    items = [LogItem(b"crash-owner", b"batch-%d-" % i + payload) for i in range(count)]
    print("appending", flush=True)
    await transport.append_many(items)
    print("done", flush=True)
    await transport.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
