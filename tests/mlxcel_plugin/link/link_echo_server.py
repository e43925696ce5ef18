"""Echo server for the two-process link test: prints its port, echoes every frame.

Usage: python link_echo_server.py SECRET_HEX [--no-bulk]. Exits when stdin closes,
so the test's process can never outlive it by more than a moment.
"""

from __future__ import annotations

import asyncio
import sys

from mlxcel_plugin.link import LinkConfig, serve_links


async def echo(link) -> None:
    async for frame in link:
        await link.send(frame)


async def main(secret: bytes, bulk: bool) -> None:
    server = await serve_links("127.0.0.1:0", secret, "decode", "echo-decode",
                               {"prefill", "router"}, echo, config=LinkConfig(bulk=bulk))
    print(server.port, flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # returns at EOF: the test is done
    await server.close()


if __name__ == "__main__":
    asyncio.run(main(bytes.fromhex(sys.argv[1]), "--no-bulk" not in sys.argv))
