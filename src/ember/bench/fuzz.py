"""A structured protocol fuzzer against a live peer (``bench/bench_fuzz.py``, ``tests/test_fuzz.py``).

The peer runs in this process (WebSocket and offline iroh on loopback). The
fuzzer feeds it hostile input from :mod:`ember.bench.fuzz_cases` -- session
frames on a raw WebSocket session, first frames of new streams (Hello,
transfer requests, garbage), and raw iroh streams (header, length prefixes,
frames) -- while a *canary* client computes on its own session and checks
every result against NumPy. It reports:

* **crashes**: an error logged by the peer's code (a batch that raised, a
  handler that failed, an exception on the event loop) or a thread that died;
* **hangs**: a SYNC sent after a case that is neither answered nor followed by
  the server closing that session within ``hang_timeout`` seconds;
* the canary's checks and failures, and whether every budget returned to zero.

Hypothesis draws the cases (seeded: the same seed gives the same cases); no
shrinking, no example database: a finding is reported with the frames that
preceded it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import numpy as np

from ..protocol import codec
from ..protocol import messages as m

CASES_PER_EXAMPLE = 16


@dataclass
class Report:
    cases: int = 0
    seconds: float = 0.0
    crashes: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)
    sessions_ended_by_peer: int = 0
    canary_checks: int = 0
    canary_failures: list[str] = field(default_factory=list)
    budget_after: int = -1
    alive_after: bool = False

    @property
    def cases_per_s(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0

    def ok(self) -> bool:
        return not (self.crashes or self.hangs or self.canary_failures) and self.alive_after \
            and self.budget_after == 0

    def summary(self) -> str:
        return (f"{self.cases} cases in {self.seconds:.1f} s ({self.cases_per_s:.0f} cases/s): "
                f"{len(self.crashes)} crashes, {len(self.hangs)} hangs; sessions ended by the peer "
                f"{self.sessions_ended_by_peer}; canary {self.canary_checks} checks, "
                f"{len(self.canary_failures)} failures; peer alive after: {self.alive_after}; "
                f"budget after: {self.budget_after} bytes; cases by target {dict(self.kinds)}")


class _CrashLog(logging.Handler):
    """Errors the peer logs are crashes (its code caught something it should never see)."""

    def __init__(self, report: Report) -> None:
        super().__init__(logging.ERROR)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] in ("ember", "websockets", "asyncio"):
            text = self.format(record)
            if record.exc_info:
                import traceback
                text += "\n" + "".join(traceback.format_exception(*record.exc_info))[-3000:]
            self.report.crashes.append(text)


def fuzz_peer(**overrides: Any) -> Any:
    """The peer under test: NumPy, WebSocket + offline iroh on loopback, tight limits, short waits."""
    from ..server import Server
    opts: dict[str, Any] = dict(session_memory="64MiB", memory_limit="1GiB", max_wait=1.0, stall_timeout=1.0,
                                handshake_timeout=2.0, max_sessions_per_client=0)
    opts.update(overrides)
    srv = Server(["cpu"], **opts)
    srv.register_op("scale", lambda xp, x, *, factor=2.0: x * factor)
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_tcp("127.0.0.1", 0)
    srv.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    srv.start_in_thread()
    return srv


LIVE = {1: np.arange(4.0), 2: np.ones((3, 4), np.float32), 3: np.arange(24).reshape(2, 3, 4),
        4: np.array(True), 5: np.zeros(0), 6: np.eye(5, dtype=np.complex128), 7: np.array([True, False, True, True])}
GRAPH = [m.GRAPH, 424242, 2, [1.5], [["multiply", [0, 2], 1, None], ["add", [3, 1], 1, None]], [4], []]


def _setup_batch() -> list[list[Any]]:
    msgs = [[m.UPLOAD, i, a.dtype.name, list(a.shape), 0, a.tobytes(), a.nbytes] for i, a in LIVE.items()]
    return msgs + [GRAPH]


class RawSession:
    """A hand-driven WebSocket session (the fuzzer's own, not the ember client)."""

    def __init__(self, address: str, features: list[str] | None = None) -> None:
        self.address = address
        self.features = features  # None: every wire feature (data frames too)
        self.ws: Any = None
        self.reqs = itertools.count(1 << 62)

    def open(self) -> None:
        from websockets.sync.client import connect
        self.ws = connect(self.address, max_size=None, open_timeout=10, compression=None)
        self.ws.send(codec.encode_hello(session_id=os.urandom(16), device=0, features=self.features))
        reply = msgpack.unpackb(self.ws.recv(timeout=10))
        if reply.get("type") != "welcome":
            raise RuntimeError(f"fuzz session refused: {reply}")
        self.ws.send(codec.packb(_setup_batch()))

    def _send(self, frame: bytes) -> None:
        self.ws.send(frame)

    def _recv(self, timeout: float) -> bytes:
        return self.ws.recv(timeout=timeout)

    def _closed(self) -> tuple[type[BaseException], ...]:
        """What a send or receive raises once the peer has closed the session."""
        import websockets
        return (websockets.ConnectionClosed,)

    def send(self, frame: bytes) -> bool:
        """False when the peer has closed this session."""
        if self.ws is None:
            self.open()
        try:
            self._send(frame)
            return True
        except self._closed():
            self.close()
            return False

    def check(self, timeout: float) -> str:
        """'ok' (a SYNC answered), 'closed' (the peer ended the session) or 'hang'."""
        if self.ws is None:
            return "closed"
        req = next(self.reqs)
        deadline = time.monotonic() + timeout
        try:
            self._send(codec.packb([[m.SYNC, req]]))
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    return "hang"
                frame = self._recv(left)
                if codec.is_data(frame):
                    continue
                try:
                    answers = msgpack.unpackb(frame, raw=False, strict_map_key=False)
                except Exception:  # noqa: BLE001
                    continue
                if any(isinstance(a, list) and a and a[0] == req for a in answers):
                    return "ok"
        except TimeoutError:  # (before the socket's OSError: a socket timeout is one too)
            self.close()
            return "hang"
        except self._closed():
            self.close()
            return "closed"

    def close(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:  # noqa: BLE001
                pass
        self.ws = None


class RawTcpSession(RawSession):
    """The same, over the raw TCP transport (preamble, length-prefixed frames, data frames agreed)."""

    def open(self) -> None:
        import socket

        from ..transport.tcp import PREAMBLE, parse_address
        host, port, _ = parse_address(self.address)
        self.ws = socket.create_connection((host, port), timeout=10)
        self.ws.sendall(PREAMBLE)
        self._send(codec.encode_hello(session_id=os.urandom(16), device=0, features=self.features))
        reply = msgpack.unpackb(self._recv(10))
        if reply.get("type") != "welcome":
            raise RuntimeError(f"fuzz session refused: {reply}")
        self._send(codec.packb(_setup_batch()))

    def _send(self, frame: bytes) -> None:
        self.ws.sendall(len(frame).to_bytes(4, "big") + frame)

    def _recv(self, timeout: float) -> bytes:
        self.ws.settimeout(timeout)
        n = int.from_bytes(self._exact(4), "big")
        return self._exact(n)

    def _exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            part = self.ws.recv(min(n - len(buf), 1 << 20))
            if not part:
                raise ConnectionError("closed")
            buf += part
        return bytes(buf)

    def _closed(self) -> tuple[type[BaseException], ...]:
        return (OSError,)  # ConnectionError included


def first_frame_case(address: str, frame: bytes) -> None:
    """Open a stream, send ``frame`` as its first frame, read briefly, close."""
    from websockets.sync.client import connect
    try:
        with connect(address, max_size=None, open_timeout=10, compression=None) as ws:
            ws.send(frame)
            try:
                ws.recv(timeout=0.2)
            except Exception:  # noqa: BLE001 - timeout or closed: both fine
                pass
    except Exception:  # noqa: BLE001
        pass


class IrohPoker:
    """Raw iroh streams to the peer: header, length prefixes and frames exactly as drawn."""

    def __init__(self, ticket: str) -> None:
        self.ticket = ticket
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-iroh", daemon=True)
        self.thread.start()
        self.ep: Any = None
        self.conn: Any = None

    def _run(self, coro: Any, timeout: float = 15.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> None:
        import iroh

        from ..transport.iroh_endpoint import ALPN, bind_endpoint
        if self.ep is None:
            self.ep = await bind_endpoint(offline=True, bind=["127.0.0.1:0", "[::1]:0"], require_relay=False)
        addr = iroh.EndpointTicket.from_string(self.ticket).endpoint_addr()
        self.conn = await asyncio.wait_for(self.ep.connect(addr, ALPN), 10)

    async def _poke(self, data: bytes) -> None:
        if self.conn is None or self.conn.close_reason() is not None:
            await self._connect()
        bi = await asyncio.wait_for(self.conn.open_bi(), 5)
        send, recv = bi.send(), bi.recv()
        try:
            await asyncio.wait_for(send.write_all(data), 2)
            await asyncio.wait_for(send.finish(), 2)
            await asyncio.wait_for(recv.read_to_end(1 << 20), 0.2)
        except Exception:  # noqa: BLE001 - the peer resets bad streams: expected
            pass
        finally:
            for stop in (lambda: send.reset(0), lambda: recv.stop(0)):
                try:
                    await asyncio.wait_for(stop(), 1)
                except Exception:  # noqa: BLE001
                    pass

    def poke(self, data: bytes) -> None:
        try:
            self._run(self._poke(data))
        except Exception:  # noqa: BLE001 - a broken connection is re-made on the next poke
            self.conn = None

    def close(self) -> None:
        from ..transport.iroh_endpoint import close_endpoint
        if self.ep is not None:
            try:
                self._run(close_endpoint(self.ep), 5)
            except Exception:  # noqa: BLE001
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Canary(threading.Thread):
    """A well-behaved client on its own session: every result must equal NumPy's."""

    def __init__(self, address: str, report: Report) -> None:
        super().__init__(name="fuzz-canary", daemon=True)
        self.address, self.report = address, report
        self.stop = threading.Event()

    def run(self) -> None:
        import ember
        import ember.array_api as xp
        rng = np.random.default_rng(0)
        try:
            dev = ember.connect(self.address)
        except Exception as e:  # noqa: BLE001
            self.report.canary_failures.append(f"canary could not connect: {e}")
            return
        while not self.stop.is_set():
            a = rng.standard_normal(int(rng.integers(1, 64)))
            try:
                got = (xp.asarray(a, device=dev) * 2.0 + 1.0) @ xp.asarray(a, device=dev)
                value = float(got)
            except Exception as e:  # noqa: BLE001
                self.report.canary_failures.append(f"canary: {type(e).__name__}: {e}")
                return
            want = float((a * 2.0 + 1.0) @ a)
            if not np.isclose(value, want, rtol=1e-12, atol=1e-12):
                self.report.canary_failures.append(f"canary: {value} != {want}")
            self.report.canary_checks += 1
            self.stop.wait(0.002)
        dev.close()


def real_frames(address: str) -> list[bytes]:
    """Frames a real client sends for a small workload (uploads, ops, graphs, reads, drops)."""
    import ember
    import ember.array_api as xp
    dev = ember.connect(address)
    s = dev.session
    frames: list[bytes] = []
    send = s.conn.send

    async def record(frame: Any) -> None:
        frames.append(bytes(frame))
        await send(frame)
    s.conn.send = record  # type: ignore[method-assign]
    x = xp.asarray(np.arange(12.0).reshape(3, 4), device=dev)
    w = xp.ones((4, 2), device=dev)
    for _ in range(12):
        x = xp.tanh(x) * 0.5 + x
        y = (x @ w)[1:, ::-1]
        float(xp.sum(y))
    float(xp.sum(x[xp.asarray([0, 2], device=dev)]))
    xp.unique_values(xp.asarray([3, 1, 3], device=dev))
    del x, y
    dev.sync()
    dev.close()
    return frames


def run(cases: int = 2000, seed: int = 0, hang_timeout: float = 20.0, corpus: int | None = None,
        progress: Callable[[Report], None] | None = None) -> Report:
    """Fuzz a fresh peer with ``cases`` hostile inputs; return the report.

    Hypothesis draws a corpus of ``corpus`` items (default: min(cases, 3000) / 2) with the
    strategies of :mod:`ember.bench.fuzz_cases`; a seeded mutator recombines it into the cases.
    Every :data:`CASES_PER_EXAMPLE` session frames the fuzzer sends a SYNC (a hang check).
    """
    import random

    from .fuzz_cases import Cases, Mutator, draw_corpus

    report = Report()
    handler = _CrashLog(report)
    root = logging.getLogger()
    root.addHandler(handler)
    old_hook = threading.excepthook

    def thread_died(args: Any) -> None:
        report.crashes.append(f"thread {args.thread.name if args.thread else '?'} died: {args.exc_type.__name__}: "
                              f"{args.exc_value}")
    threading.excepthook = thread_died
    srv = fuzz_peer()
    srv._loop.set_exception_handler(  # type: ignore[union-attr]
        lambda loop, ctx: report.crashes.append(f"event loop: {ctx.get('message')}: {ctx.get('exception')!r}"))
    ws_addr = next(a for a in srv.addresses if a.startswith("ws://"))
    ticket = next(a for a in srv.addresses if a.startswith("endpoint"))
    tcp_addr = next(a for a in srv.addresses if a.startswith("tcp://"))
    frames = real_frames(ws_addr)
    strategies = Cases(sorted(LIVE), ws_addr, [GRAPH[1], 7, 2**63], frames)
    pool = draw_corpus(strategies, seed, corpus if corpus is not None else max(200, min(cases, 3000) // 2))
    mutate = Mutator(pool, random.Random(seed), frames)
    sessions = {"session": RawSession(ws_addr, features=[]), "data": RawSession(ws_addr),
                "tcp": RawTcpSession(tcp_addr)}
    poker, canary = IrohPoker(ticket), Canary(ws_addr, report)
    canary.start()
    recent: list[bytes] = []
    rng = random.Random(seed + 1)
    t0 = time.monotonic()
    try:
        while report.cases < cases:
            target = rng.choice(("session",) * 4 + ("data",) * 2 + ("tcp",) * 2 + ("first", "iroh"))
            session = sessions.get(target)
            for _ in range(CASES_PER_EXAMPLE):
                report.cases += 1
                report.kinds[target] += 1
                if session is not None:  # plain frames; data frames too where they were agreed
                    frame = mutate.session_frame() if target == "session" or rng.random() < 0.5 \
                        else mutate.data_frame()
                    recent.append(frame)
                    if not session.send(frame):
                        report.sessions_ended_by_peer += 1
                elif target == "first":
                    first_frame_case(ws_addr, mutate.first_frame())
                else:
                    poker.poke(mutate.stream())
            if session is not None:
                verdict = session.check(hang_timeout)
                if verdict == "hang":
                    report.hangs.append("no answer to SYNC after: " + " | ".join(f.hex()[:300] for f in recent))
                elif verdict == "closed":
                    report.sessions_ended_by_peer += 1
                recent.clear()
            if progress is not None:
                progress(report)
    finally:
        report.seconds = time.monotonic() - t0
        canary.stop.set()
        canary.join(30)
        for each in sessions.values():
            each.close()
        poker.close()
        report.alive_after = _still_serves(ws_addr)
        report.budget_after = _budget_after(srv)
        srv.close()
        root.removeHandler(handler)
        threading.excepthook = old_hook
    return report


def _still_serves(address: str) -> bool:
    import ember
    import ember.array_api as xp
    try:
        dev = ember.connect(address)
        ok = float(xp.sum(xp.arange(10, device=dev))) == 45
        dev.close()
        return ok
    except Exception:  # noqa: BLE001
        return False


def _budget_after(srv: Any, wait: float = 10.0) -> int:
    deadline = time.monotonic() + wait
    while srv.memory_held() and time.monotonic() < deadline:
        time.sleep(0.05)
    return srv.memory_held()


__all__ = ["run", "Report", "fuzz_peer", "RawSession"]
