"""The socket side of the TCP transport (``transport.tcp``): a plain non-blocking socket read with
``recv_into`` and written with ``sendmsg`` (:class:`SocketIO`), or asyncio streams over TLS
(:class:`StreamIO`)."""

from __future__ import annotations

import asyncio
import socket
from contextlib import suppress
from typing import Any


def tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    with suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class SocketIO:
    """Plain TCP: ``recv_into`` and ``sendmsg`` on a non-blocking socket.

    ``watch`` (a server's connections): the socket stays registered with the loop between reads
    and the loop's callback reads into the waiting view, and a read that drained the socket does
    not try again before waiting: a request costs one ``recv`` and no ``epoll_ctl`` (asyncio's
    ``sock_recv_into`` costs two failed reads and two ``epoll_ctl`` calls per wait)."""

    def __init__(self, sock: socket.socket, watch: bool = False) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.watch = watch
        self._want: tuple[memoryview, asyncio.Future] | None = None
        self._watching = False
        self._drained = False  # the last read took less than it could: the socket is empty

    async def recv_into(self, view: memoryview) -> int:
        if not self.watch:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                return await self.loop.sock_recv_into(self.sock, view)
        if not self._drained:
            try:
                n = self.sock.recv_into(view)
                self._drained = n < len(view)
                return n
            except (BlockingIOError, InterruptedError):
                pass
        fut = self.loop.create_future()
        self._want = (view, fut)
        if not self._watching:
            self.loop.add_reader(self.sock.fileno(), self._readable)
            self._watching = True
        try:
            n = await fut
        finally:
            self._want = None
        self._drained = n < len(view)
        return n

    def _readable(self) -> None:
        want = self._want
        if want is None or want[1].done():  # nobody reads now: stop watching until someone does
            self._unwatch()
            return
        view, fut = want
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._want = None
            fut.set_exception(e)
            return
        self._want = None
        fut.set_result(n)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            with suppress(Exception):
                self.loop.remove_reader(self.sock.fileno())

    async def write(self, parts: list[Any]) -> None:
        sock = self.sock
        if len(parts) == 1:
            data = parts[0]
            try:
                sent = sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == len(data):
                return
            parts = [memoryview(data)[sent:]]
        while True:
            try:
                sent = sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            while parts and sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            if not parts:
                return
            if sent:
                parts[0] = memoryview(parts[0])[sent:]
            fut = self.loop.create_future()
            self.loop.add_writer(sock.fileno(), wake, fut)
            try:
                await fut
            finally:
                self.loop.remove_writer(sock.fileno())

    def shutdown(self) -> None:
        with suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._unwatch()
        want = self._want
        if want is not None and not want[1].done():  # a reader waits (a pulling consumer): it meets the end
            want[1].set_result(0)
        with suppress(OSError):
            self.sock.close()


class StreamIO:
    """TLS: asyncio streams (the ``ssl`` module copies the bytes anyway)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def recv_into(self, view: memoryview) -> int:
        data = await self.reader.read(len(view))
        view[:len(data)] = data
        return len(data)

    async def write(self, parts: list[Any]) -> None:
        for p in parts:
            self.writer.write(p)  # copied into the TLS buffer: nothing of ours is kept
        await self.writer.drain()

    def shutdown(self) -> None:
        with suppress(Exception):
            if self.writer.can_write_eof():
                self.writer.write_eof()

    def close(self) -> None:
        with suppress(Exception):
            self.writer.close()


__all__ = ["SocketIO", "StreamIO", "tune", "wake"]
