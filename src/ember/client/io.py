"""The one background I/O thread per process: an asyncio loop (uvloop when installed) serving every session."""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Coroutine, TypeVar

from ..errors import ConnectError
from ..transport.loop import new_event_loop

T = TypeVar("T")

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The process's I/O loop, started on first use."""
    global _loop, _thread
    if _loop is not None and _thread is not None and _thread.is_alive():
        return _loop
    with _lock:
        if _loop is None or _thread is None or not _thread.is_alive():
            loop = new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            _thread = threading.Thread(target=run, name="ember-io", daemon=True)
            _thread.start()
            ready.wait(10)
            _loop = loop
    return _loop


def run_sync(coro: Coroutine[Any, Any, T], timeout: float, what: str = "operation") -> T:
    """Run ``coro`` on the I/O loop from a user thread, with a deadline."""
    loop = get_loop()
    if threading.current_thread() is _thread:
        raise RuntimeError("run_sync called from the ember I/O thread")
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result(timeout)
    except FutureTimeout:
        fut.cancel()
        raise ConnectError(f"{what} did not finish within {timeout:g} s") from None


def _shutdown() -> None:
    """At exit: close sessions (the peers free their tensors), then stop the loop cleanly."""
    from .session import close_all
    close_all()
    loop = _loop
    if loop is None or _thread is None or not _thread.is_alive():
        return

    async def drain() -> None:
        await asyncio.sleep(0.05)  # let Close frames go out
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=1.0) if tasks else None

    try:
        asyncio.run_coroutine_threadsafe(drain(), loop).result(2.0)
        loop.call_soon_threadsafe(loop.stop)
        _thread.join(2.0)
    except Exception:
        pass


atexit.register(_shutdown)


def _after_fork_in_child() -> None:
    """A forked child has no I/O thread, and its parent's sessions are not its own (their streams, and an embedded
    peer's threads, stay with the parent): each of them is lost here, with the reason, so using one raises
    ``SessionLost`` instead of waiting forever; new work connects afresh from the child."""
    global _lock, _loop, _thread
    _lock, _loop, _thread = threading.Lock(), None, None
    from ..errors import SessionLost
    from . import session
    err = SessionLost("this process was forked from the one that opened this session; a session (and an embedded "
                      "peer) belongs to the process that made it",
                      hint="in the child, make new tensors (new work connects afresh), or start child processes "
                           "with the 'spawn' method and move data as CPU tensors")
    for s in list(session._sessions):
        if s.lost is None:
            s.lost = err
    session._sessions.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
