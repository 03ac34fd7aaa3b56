"""The benchmark server process (``python -m ember.bench --child``): Ember over WebSocket and iroh,
plus the raw baselines (asyncio TCP, raw iroh frames, a websockets echo, rpyc)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from typing import Any

from .common import MiB


def child_main(core: int | None, iroh_on: bool) -> None:
    """Serve Ember (WebSocket, TCP, iroh) and the raw baselines until stdin closes; print addresses."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    os.environ.setdefault("EMBER_OFFLINE", "1")
    from ..transport.loop import install_uvloop
    install_uvloop()
    from ..server import Server

    try:  # a torch:cpu device (index 1) for the ember.torch workloads, where torch is installed
        import torch  # noqa: F401
        devices = ["cpu", "torch:cpu"]
    except ImportError:
        devices = ["cpu"]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = Server(devices)
        srv.listen_websocket("127.0.0.1", 0)
        srv.listen_tcp("127.0.0.1", 0)
        info: dict[str, Any] = {}
        iroh_lst = None
        if iroh_on:
            try:
                iroh_lst = srv.listen_iroh(offline=True, bind=["127.0.0.1:0"])
            except Exception as e:  # noqa: BLE001
                info["iroh_error"] = f"{type(e).__name__}: {e}"
        try:
            await srv.start()
        except Exception as e:  # noqa: BLE001 - iroh may fail to bind: serve WebSocket anyway
            info["iroh_error"] = f"{type(e).__name__}: {e}"
            iroh_lst = None
            srv = Server(devices)
            srv.listen_websocket("127.0.0.1", 0)
            srv.listen_tcp("127.0.0.1", 0)
            await srv.start()
        info["torch_device"] = devices.index("torch:cpu") if "torch:cpu" in devices else None
        info["websocket"] = next(a for a in srv.addresses if a.startswith("ws://"))
        info["tcp_ember"] = next(a for a in srv.addresses if a.startswith("tcp://"))
        if iroh_lst is not None:
            info["iroh"] = iroh_lst.ticket
        tcp = await asyncio.start_server(_tcp_baseline, "127.0.0.1", 0)
        info["tcp"] = tcp.sockets[0].getsockname()[1]
        info["wsecho"] = await _ws_echo_server()
        info["rpyc"] = _rpyc_server()
        frames_lst = None
        if iroh_on and iroh_lst is not None:
            try:
                from ..transport.iroh import IrohListener
                frames_lst = IrohListener(offline=True, bind=["127.0.0.1:0"])
                await frames_lst.start(_frames_baseline)
                info["iroh_frames"] = frames_lst.ticket
            except Exception as e:  # noqa: BLE001
                info["iroh_frames_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(info), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
        tcp.close()
        if frames_lst is not None:
            await frames_lst.stop()
        await srv.stop()

    asyncio.run(main())


async def _tcp_baseline(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Raw asyncio TCP: ``E`` + n: echo n bytes; ``U`` + n: swallow n bytes, answer ok; ``D`` + n: send n bytes."""
    import socket
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b""
    try:
        while True:
            head = await r.readexactly(9)
            kind, n = head[:1], int.from_bytes(head[1:], "little")
            if kind == b"E":
                w.write(await r.readexactly(n))
            elif kind == b"U":
                left = n
                while left:
                    chunk = await r.read(min(left, 4 * MiB))
                    if not chunk:
                        return
                    left -= len(chunk)
                w.write(b"ok")
            elif kind == b"D":
                if len(payload) < n:
                    payload = bytes(n)
                mv = memoryview(payload)
                for off in range(0, n, 4 * MiB):
                    w.write(mv[off:off + 4 * MiB])
                    await w.drain()
            else:
                return
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        w.close()


async def _frames_baseline(conn: Any) -> None:
    """Raw frames over one iroh stream (no Ember session): ``E``: echo; ``U`` + n: swallow n bytes of
    frames, answer ok; ``D`` + n: send n bytes in 1 MiB frames."""
    payload = b""
    try:
        while True:
            f = await conn.recv()
            if f is None:
                return
            kind = bytes(f[:1])
            if kind == b"E":
                await conn.send(f)
            elif kind == b"U":
                left = int.from_bytes(f[1:9], "little")
                while left > 0:
                    g = await conn.recv()
                    if g is None:
                        return
                    left -= len(g)
                await conn.send(b"ok")
            elif kind == b"D":
                n = int.from_bytes(f[1:9], "little")
                if len(payload) < n:
                    payload = bytes(n)
                mv = memoryview(payload)
                for off in range(0, n, MiB):
                    await conn.send(mv[off:min(n, off + MiB)])
    except Exception:  # noqa: BLE001 - the client went away
        return
    finally:
        try:
            await conn.close()
        except Exception:  # noqa: BLE001
            pass


async def _ws_echo_server() -> str | None:
    try:
        from websockets.asyncio.server import serve
    except ImportError:
        return None

    async def echo(ws: Any) -> None:
        async for msg in ws:
            await ws.send(msg)

    s = await serve(echo, "127.0.0.1", 0, compression=None, ping_interval=None, max_size=None)
    port = s.sockets[0].getsockname()[1]
    return f"ws://127.0.0.1:{port}"


def _rpyc_server() -> int | None:
    try:
        import rpyc  # noqa: F401
        from rpyc.utils.server import ThreadedServer
        from rpyc.core.service import SlaveService
    except ImportError:
        return None
    srv = ThreadedServer(SlaveService, hostname="127.0.0.1", port=0,
                         protocol_config={"allow_all_attrs": True, "allow_pickle": True})
    threading.Thread(target=srv.start, daemon=True).start()
    return srv.port


def memory_child(address: str, size: int) -> None:
    """Upload ``size`` bytes to ``address`` and print the peak RSS growth over the array's size."""
    import time
    import numpy as np
    import ember
    import ember.array_api as xp
    dev = ember.connect(address, timeout=30.0)
    dev.sync()
    base = _rss()
    _reset_peak()
    host = np.full(size, 7, dtype=np.uint8)  # touches every page
    with_array = _rss()
    t0 = time.perf_counter()
    x = xp.asarray(host, device=dev)
    dev.sync(timeout=600)
    dt = time.perf_counter() - t0
    peak = _peak()
    print(json.dumps({"array": size, "base": base, "with_array": with_array, "peak": peak,
                      "ratio": (peak - base) / size, "MBps": size / dt / 1e6}), flush=True)
    del x
    dev.close()


def _reset_peak() -> None:
    """Start the peak-RSS count afresh (Linux: VmHWM), so imports before do not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ServerProcess:
    """The child process, started with ``python -m ember.bench --child``."""

    def __init__(self, core: int | None, iroh_on: bool, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "ember.bench", "--child"]
        if core is not None:
            cmd += ["--core", str(core)]
        if not iroh_on:
            cmd += ["--no-iroh"]
        env = dict(os.environ, EMBER_OFFLINE="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict[str, Any] = {}
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline() if self.proc.stdout else ""),
                             daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0].strip():
            self.close()
            raise RuntimeError(f"the benchmark server did not start within {timeout:g} s")
        self.info = json.loads(box[0])

    def close(self) -> None:
        p = self.proc
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(15)
        except Exception:  # noqa: BLE001
            p.kill()
            p.wait(5)


def serve_collectives(device: str, env: dict[str, str], prefix: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """``ember serve --device DEVICE --collectives`` on loopback TCP (no iroh), started with ``prefix`` (e.g.
    ``taskset``); returns the process and its ``tcp://`` address, read from its output."""
    p = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ember.cli.main", "serve", "--device", device,
                          "--collectives", "--no-iroh", "--tcp", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True,
                         env=env)
    assert p.stdout is not None
    for line in p.stdout:
        found = re.search(r"listening on (tcp://\S+)", line)
        if found:
            return p, found.group(1)
    raise SystemExit("ember serve printed no address")
