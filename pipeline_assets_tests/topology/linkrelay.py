"""A userspace link emulator: a TCP relay that delays what it forwards and stalls it as TCP does on loss.

For kernels without ``sch_netem``: a process in a host's namespace listening there and forwarding each
connection to an upstream (``ADDR:PORT``). Per connection and direction, each chunk read is written on
``delay`` seconds after it arrived, in order; with probability ``loss`` it waits one retransmission
timeout (``rto``) more and the chunks behind it wait too (TCP's in-order delivery). It models latency
and loss-recovery stalls as the application sees them, not the congestion window, per-packet loss (a
chunk is one read) or the handshake (accepted at once). Either side's EOF, once what it sent is
delivered, closes both (no half-close). A queue bounds what it holds per direction (the reader waits).
On SIGTERM it prints one JSON line of counters (connections, chunks, stalls per direction) and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import time

READ_SIZE = 65536
QUEUE_CHUNKS = 256


class Relay:
    def __init__(self, upstream: tuple[str, int], delay: float, loss: float, rto: float, seed: int | None) -> None:
        self.upstream, self.delay, self.loss, self.rto = upstream, delay, loss, rto
        self.rng = random.Random(seed)
        self.stats = {
            "connections": 0,
            "chunks_up": 0,
            "chunks_down": 0,
            "stalls_up": 0,
            "stalls_down": 0,
            "bytes_up": 0,
            "bytes_down": 0,
        }

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.stats["connections"] += 1
        try:
            await self.relay(client_r, client_w)
        except asyncio.CancelledError:  # the relay is stopping: the connection just closes
            client_w.close()

    async def relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        pumps = [
            asyncio.create_task(self.pump(client_r, server_w, "up")),
            asyncio.create_task(self.pump(server_r, client_w, "down")),
        ]
        # Either side closing closes both (a half-open relay would hold the peer's connection).
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (client_w, server_w):
            w.close()
        await asyncio.gather(*pumps, return_exceptions=True)

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Forward one direction: a reader stamping each chunk's due time, a writer keeping order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        loop = asyncio.get_running_loop()

        async def read() -> None:
            last_due = 0.0
            with contextlib.suppress(OSError):  # a reset ends the direction as an EOF does
                while data := await reader.read(READ_SIZE):
                    due = loop.time() + self.delay
                    if self.rng.random() < self.loss:
                        due += self.rto
                        self.stats[f"stalls_{direction}"] += 1
                    last_due = max(due, last_due)  # in order: never before the chunk ahead of it
                    self.stats[f"chunks_{direction}"] += 1
                    self.stats[f"bytes_{direction}"] += len(data)
                    await queue.put((last_due, data))
            await queue.put((last_due, b""))

        async def write() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - loop.time()))
                if not data:
                    return
                writer.write(data)
                await writer.drain()

        tasks = [asyncio.create_task(read()), asyncio.create_task(write())]
        try:
            await tasks[1]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def serve(listen: tuple[str, int], relay: Relay) -> None:
    server = await asyncio.start_server(relay.handle, *listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(json.dumps({"listening": f"{listen[0]}:{listen[1]}", "at": time.time()}), flush=True)
    async with server:
        await stop.wait()
    print(json.dumps({"stats": relay.stats}), flush=True)


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_endpoint, required=True, help="ADDR:PORT to accept connections on")
    p.add_argument("--upstream", type=_endpoint, required=True, help="ADDR:PORT to forward them to")
    p.add_argument("--delay", type=float, default=0.05, help="one-way delay per chunk, seconds")
    p.add_argument("--loss", type=float, default=0.01, help="probability a chunk is 'lost' (stalls one rto)")
    p.add_argument("--rto", type=float, default=0.2, help="the stall of a loss, seconds (Linux's minimum RTO)")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.listen, Relay(args.upstream, args.delay, args.loss, args.rto, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
