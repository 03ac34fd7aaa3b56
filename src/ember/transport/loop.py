"""The event loops Ember runs on: uvloop when it is installed (``pip install 'ember[fast]'``),
else asyncio's own. ``EMBER_UVLOOP=0`` keeps asyncio's loop (benchmarks compare the two)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from . import spin


def uvloop_module() -> Any:
    """The ``uvloop`` module when installed and not disabled by ``EMBER_UVLOOP=0``, else None."""
    if os.environ.get("EMBER_UVLOOP", "").strip() == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when available."""
    uv = uvloop_module()
    return uv.new_event_loop() if uv is not None else asyncio.new_event_loop()


def install_uvloop() -> bool:
    """Make ``asyncio.run`` use uvloop in this process (when available); True when it does."""
    uv = uvloop_module()
    if uv is None:
        return False
    asyncio.set_event_loop_policy(uv.EventLoopPolicy())
    return True


def hot_event_loop() -> asyncio.AbstractEventLoop:
    """A peer's own loop (``ember serve``): uvloop's when available, else asyncio's over a
    :class:`~ember.transport.spin.HotSelector`, whose ``keep_hot`` the session pump calls after a small
    inline answer (``loop.keep_hot``; see :mod:`ember.transport.spin`)."""
    if uvloop_module() is not None or not spin.SPIN:
        return new_event_loop()
    sel = spin.HotSelector()
    loop = asyncio.SelectorEventLoop(sel)
    loop.keep_hot, loop.cool = sel.keep_hot, sel.cool  # type: ignore[attr-defined]
    return loop


def run_loop(coro: Any, hot: bool = False) -> Any:
    """``asyncio.run(coro)`` on a new loop of :func:`new_event_loop` (uvloop's when available);
    ``hot``: of :func:`hot_event_loop` (a peer process's own loop, never one sharing its process with
    user code)."""
    runner = getattr(asyncio, "Runner", None)
    if runner is None:  # Python 3.10: asyncio's own loop
        return asyncio.run(coro)
    with runner(loop_factory=hot_event_loop if hot else new_event_loop) as r:
        return r.run(coro)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    loop = loop or asyncio.get_event_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


async def all_or_nothing(coros: Any) -> None:
    """Run ``coros`` side by side (several streams of one transfer); the first failure cancels the
    others and is raised once they have stopped."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        if tasks:
            await asyncio.wait(tasks)
