"""A TCP proxy that can stop forwarding while keeping both sockets open: a hung server, a
paused VM or a half-open path behind a NAT, as the client sees it (its socket stays open and
nothing answers). Runs on the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib

_CHUNK_BYTES = 65536


class StallingProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``; ``stall()`` stops
    forwarding both ways on every connection, new ones included (accepted, never answered),
    until ``resume()``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def start(self) -> StallingProxy:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.upstream_port), 5
            )
        except (OSError, TimeoutError):
            writer.close()
            return
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await source.read(_CHUNK_BYTES)
                if not data:
                    break
                await self._flowing.wait()  # read just before a stall: held, not forwarded
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        for writer in list(self._writers):
            writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._pipes, return_exceptions=True), 5)
