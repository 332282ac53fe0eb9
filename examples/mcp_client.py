"""Drive ``prme mcp`` the way an MCP client (a desktop app, an IDE, an agent runtime) does:
start it over stdio, list its tools, remember, recall, read the receipt and the history.

    python examples/mcp_client.py ./memory

The walk-through of docs/MCP.md; it needs ``pip install "prme-memory[mcp]"``.
"""

from __future__ import annotations

import asyncio
import json
import sys

from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client


async def walk_through(directory: str) -> None:
    server = StdioServerParameters(
        command=sys.executable,  # the interpreter prme is installed in; `prme` works too
        args=["-m", "prme.cli", "mcp", "--data-dir", directory, "--user-id", "alice"],
    )
    async with (
        stdio_client(server) as (read, write),
        ClientSession(read, write, read_timeout_seconds=120) as session,
    ):
        await session.initialize()
        tools = (await session.list_tools()).tools
        print("tools:", ", ".join(tool.name for tool in tools))

        stored = await session.call_tool(
            "remember", {"content": "My sister Lena lives in Lisbon", "session_id": "trip"}
        )
        print(stored.content[0].text)

        recalled = await session.call_tool(
            "recall", {"query": "Where does my sister live?", "top_k": 3}
        )
        print(recalled.content[0].text)

        receipt_uri = recalled.structured_content["receipt_uri"]
        receipt = json.loads((await session.read_resource(receipt_uri)).contents[0].text)
        channels = ", ".join(f"{c['name']} {c['ms']:.1f} ms" for c in receipt["channels"])
        print(f"receipt {receipt['request_id']}: {channels}")

        history = await session.read_resource("prme://history/alice/trip")
        for message in json.loads(history.contents[0].text):
            print(f"history: {message['role']}: {message['content']}")

        refused = await session.call_tool("recall", {"query": "anything", "user_id": "bob"})
        print("as bob:", refused.content[0].text)


def main(directory: str) -> None:
    asyncio.run(walk_through(directory))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "./memory")
