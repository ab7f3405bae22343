"""A userspace link shaper: a loopback TCP proxy that adds a one-way delay and a rate limit per direction.

`tc netem` is not available everywhere we benchmark, so a slow WAN link between two processes is made by
pointing one at a `ShapedLink` in front of the other:

    with ShaperThread() as shaper:
        port = shaper.link("127.0.0.1:50051", delay_s=0.020, rate_bps=100e6)
        # connect to 127.0.0.1:<port> instead of 127.0.0.1:50051

Each direction of each connection is its own link: a token bucket (GCRA) decides when each chunk has
been serialised at `rate_bps`, and the chunk is delivered `delay_s` later, in order (the timing rule,
`LinkPlan`, is pure: arceus/swarm/link.py). What has been read but not delivered is bounded
(`max_buffer_bytes`); past it the proxy stops reading, so TCP pushes back on the sender. How late each chunk
was delivered against that rule (the loop's wake-ups, the writes: what the shaper adds beyond the delay and the
rate) is kept (`ShaperThread.take_lateness`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
from dataclasses import dataclass

from arceus.swarm.link import BURST_BYTES, LinkPlan

CHUNK_BYTES = BURST_BYTES  # a read: one burst of an idle link


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """A bench's --delay-ms and --rate-mbit: its shaped links, by default a home uplink's 20 ms one way and
    100 Mbit/s per direction (the issue's WAN)."""
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of a shaped link")
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="rate of a shaped link, per direction")


def link_shape(args: argparse.Namespace) -> dict[str, float]:
    """`ShaperThread.link`'s delay_s and rate_bps from add_link_arguments' options."""
    return {"delay_s": args.delay_ms / 1000, "rate_bps": args.rate_mbit * 1e6}


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    plan: LinkPlan,
    max_buffer_bytes: int,
    late: list[float],
) -> None:
    """Copy one direction through `plan`: a reader task fills a bounded queue, this task delivers, appending to
    `late` how many seconds after its planned arrival each chunk was written. A reset read travels like data and then
    raises here, so the connection ends (`_serve_connection`)."""
    queue: asyncio.Queue[tuple[float, bytes | ConnectionError]] = asyncio.Queue(
        maxsize=max(1, max_buffer_bytes // CHUNK_BYTES)
    )
    loop = asyncio.get_running_loop()

    async def read() -> None:
        try:
            while data := await reader.read(CHUNK_BYTES):
                await queue.put((plan.arrival(loop.time(), len(data)), data))
        except ConnectionError as exc:  # the sender reset (a killed process with bytes unread): after what came before
            await queue.put((plan.arrival(loop.time(), 0), exc))
            return
        await queue.put((plan.arrival(loop.time(), 0), b""))  # EOF, after everything before it

    reading = asyncio.create_task(read())
    try:
        while True:
            at, data = await queue.get()
            if (wait := at - loop.time()) > 0:
                await asyncio.sleep(wait)
            if isinstance(data, ConnectionError):
                raise data
            late.append(loop.time() - at)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()  # half-close: the other direction may still be talking
                return
            writer.write(data)
            await writer.drain()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await reading


@dataclass(frozen=True)
class LinkSpec:
    target_host: str
    target_port: int
    delay_s: float
    rate_bps: float
    burst_bytes: int = CHUNK_BYTES
    max_buffer_bytes: int = 4 * 1024 * 1024  # above 100 Mbit/s x 40 ms, so the rate, not the buffer, limits


async def _serve_connection(
    spec: LinkSpec, late: list[float], client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
) -> None:
    try:
        server_r, server_w = await asyncio.open_connection(spec.target_host, spec.target_port)
    except OSError:
        client_w.close()
        return
    pumps = [
        asyncio.create_task(
            _pump(r, w, LinkPlan(spec.delay_s, spec.rate_bps, spec.burst_bytes), spec.max_buffer_bytes, late)
        )
        for r, w in ((client_r, server_w), (server_r, client_w))
    ]
    reset = False
    try:
        # Both directions end with EOF; a reset on either side (read, or a write that found the peer gone) ends the
        # connection: the other side is reset too, as it would be without the shaper between.
        done, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
        reset = any(not task.cancelled() and isinstance(task.exception(), ConnectionError) for task in done)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
    except asyncio.CancelledError:
        # The shaper is closing. This is the connection's top-level task: asyncio's stream callback
        # reads its exception() and would log a cancelled task as an error.
        for task in pumps:
            task.cancel()
    finally:
        for w in (client_w, server_w):
            if reset:
                w.transport.abort()
            else:
                w.close()
            with contextlib.suppress(ConnectionError, OSError):
                await w.wait_closed()


class ShaperThread:
    """Shaped links served by an asyncio loop on a thread of their own, for synchronous callers (tests,
    benchmarks). Links listen on 127.0.0.1 only."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-shaper", daemon=True)
        self._servers: list[asyncio.Server] = []
        self._late: list[float] = []  # every link's chunks, appended only by the loop's thread

    def __enter__(self) -> ShaperThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def link(self, target: str, *, delay_s: float, rate_bps: float, **options: int) -> int:
        """Start a shaped link to `target` ("host:port"); returns the loopback port to connect to."""
        host, _, port = target.rpartition(":")
        spec = LinkSpec(host.strip("[]"), int(port), delay_s, rate_bps, **options)

        async def start() -> asyncio.Server:
            return await asyncio.start_server(lambda r, w: _serve_connection(spec, self._late, r, w), "127.0.0.1", 0)

        server = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=10)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    def address(self, target: str, *, delay_s: float, rate_bps: float) -> str:
        """A shaped link to `target` ("host:port"), as the address to dial instead ("127.0.0.1:<port>")."""
        return f"127.0.0.1:{self.link(target, delay_s=delay_s, rate_bps=rate_bps)}"

    def take_lateness(self) -> list[float]:
        """Seconds each chunk every link delivered since the last call was written after its planned arrival (the
        link's delay and rate, `LinkPlan`): what the shaper itself added."""

        async def take() -> list[float]:
            taken, self._late[:] = list(self._late), []
            return taken

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=10)

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            for server in self._servers:
                server.close()
            current = asyncio.current_task()
            tasks = [t for t in asyncio.all_tasks() if t is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()
