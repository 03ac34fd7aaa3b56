"""Tensor movement, the target side: download a tensor another peer exposes, on a transfer stream.

The target peer dials the source (``transport.dial``, kind ``transfer``), sends the request, checks the header, and
receives the bytes in order, striped over several streams on iroh (``protocol.lanes``). A watchdog notes each frame:
a download that gets nothing for ``STALL_S`` pings the source (``{type: ping}``), and a source that does not answer
within ``PROBE_S`` fails it, so that a vanished source is noticed in seconds (QUIC's idle timeout is ~30 s).
The source side and the session's handlers are :mod:`.transfer`.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable

import numpy as np

from ..errors import ProtocolError, TransferError
from ..protocol import codec
from ..protocol import lanes as pl
from ..protocol import messages as m
from ..transport.base import FrameConnection, receive_buffer
from ..transport.loop import all_or_nothing

#: How long a download waits for a capability that the source has not announced (network reordering).
UNANNOUNCED_WAIT = 5.0
#: A download that receives nothing for this long asks the source whether it is still there: a SIGKILLed iroh
#: peer is otherwise noticed only at QUIC's idle timeout (~30 s; TCP's reset is immediate).
STALL_S = 2.0
#: How long that question waits for any answer before the source is taken for gone.
PROBE_S = 3.0


async def download(address: str, cap: bytes, *, timeout: float, max_frame: int,
                   reserve: Callable[[int], None] | None = None, dtypes: Any = None) -> np.ndarray:
    """Dial ``address`` on a transfer stream and download the tensor exposed under ``cap``.

    The header the source sends is checked (``dtypes``: the names allowed; shape and total
    must agree) and ``reserve(total)`` is called before the buffer is allocated (it raises to refuse).
    """
    from ..transport import dial
    try:
        conn = await dial(address, timeout=timeout, max_frame=max_frame, kind="transfer")
    except Exception as e:
        raise TransferError(f"cannot reach the source peer {address}: {getattr(e, 'message', e)}") from None
    watch = _Watch(address, max_frame)
    try:
        return await watch.run(_download(conn, watch, address, cap, timeout, max_frame, reserve, dtypes))
    finally:
        try:
            await asyncio.wait_for(conn.close(), 2.0)
        except Exception:
            pass


class _Watch:
    """A download's watchdog: the time of its last frame (any stream), and a probe of the source when that is
    ``STALL_S`` old, so that a source that vanished fails the download in seconds."""

    def __init__(self, address: str, max_frame: int) -> None:
        self.address, self.max_frame, self.last = address, max_frame, time.monotonic()

    def tick(self) -> None:
        self.last = time.monotonic()

    async def run(self, body: Any) -> Any:
        task = asyncio.ensure_future(body)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=STALL_S)
                if not done and time.monotonic() - self.last >= STALL_S \
                        and not await source_answers(self.address, self.max_frame) and not task.done():
                    raise TransferError(f"the source peer {self.address[:72]} stopped answering: nothing came for "
                                        f"{STALL_S:g} s and a ping got no answer within {PROBE_S:g} s (it has "
                                        "ended, or the link to it is down)")
                if task.done():
                    return task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.wait({task})


async def source_answers(address: str, max_frame: int) -> bool:
    """Whether the peer at ``address`` answers a ``ping`` transfer request (any answer, a close included) within
    ``PROBE_S``; False when it cannot be reached or stays silent."""
    from ..transport import dial

    async def ask() -> bool:
        c = await dial(address, timeout=PROBE_S, max_frame=max_frame, kind="transfer")
        try:
            await c.send(codec.packb({"type": "ping"}))
            await c.recv()
            return True
        finally:
            try:
                await asyncio.wait_for(c.close(), 1.0)
            except Exception:
                pass
    try:
        return await asyncio.wait_for(ask(), PROBE_S)
    except Exception:  # noqa: BLE001 - unreachable, reset or silent: gone
        return False


async def _download(conn: FrameConnection, watch: _Watch, address: str, cap: bytes, timeout: float,
                    max_frame: int, reserve: Callable[[int], None] | None, dtypes: Any) -> np.ndarray:
    lanes = pl.TRANSFER_LANES if _is_iroh(address) else 1
    await conn.send(codec.packb({"type": "transfer", "protocol": m.PROTOCOL_VERSION, "capability": cap,
                                 "wait": timeout, "features": list(m.FEATURES), "lanes": lanes}))
    hdr = codec.unpackb(await _recv(conn, timeout + UNANNOUNCED_WAIT + 5.0, watch))
    if not isinstance(hdr, dict) or hdr.get("type") != "ok":
        reason = hdr.get("reason", "no reason given") if isinstance(hdr, dict) else "malformed answer"
        raise TransferError(f"the source peer denied the transfer: {reason}")
    total, dtype, shape = _checked_header(hdr, dtypes)
    if reserve is not None:
        reserve(total)
    buf = receive_buffer(total)
    view = memoryview(buf)
    agreed = codec.agreed_features(hdr.get("features"))
    if m.LANES_FEATURE in agreed and m.DATA_FEATURE in agreed and lanes > 1:
        await _receive_striped(address, conn, hdr, view, timeout, max_frame, watch)
    elif m.DATA_FEATURE in agreed:
        await _receive_data(conn, view, timeout, watch=watch)
    else:
        got = 0
        while got < total:
            part = await _recv(conn, timeout, watch)
            if got + len(part) > total:
                raise TransferError("the source peer sent more bytes than it announced")
            view[got:got + len(part)] = part
            got += len(part)
    return buf.view(np.dtype(dtype)).reshape(shape)


def _checked_header(hdr: dict[str, Any], dtypes: Any) -> tuple[int, str, list[int]]:
    total, dtype, shape = hdr.get("total"), hdr.get("dtype"), hdr.get("shape")
    ok = type(total) is int and total >= 0 and isinstance(dtype, str) and isinstance(shape, list) \
        and (dtypes is None or dtype in dtypes) and all(type(d) is int and d >= 0 for d in shape)
    if ok:
        try:
            ok = math.prod(shape) * np.dtype(dtype).itemsize == total
        except TypeError:
            ok = False
    if not ok:
        raise TransferError(f"the source peer sent a malformed header: {str(hdr)[:120]}")
    return total, dtype, shape


def _is_iroh(address: str) -> bool:
    from ..transport import is_iroh_address
    return is_iroh_address(address)


async def _receive_striped(address: str, conn: FrameConnection, hdr: dict[str, Any], view: memoryview,
                           timeout: float, max_frame: int, watch: _Watch | None = None) -> None:
    """A download striped over ``hdr["lanes"]`` streams: stripe 0 on ``conn``, stripe i on an extra
    transfer stream opened here (``protocol.lanes``), all side by side, each in order."""
    from ..transport import dial
    k, key, chunk = hdr.get("lanes"), hdr.get("lane_key"), hdr.get("chunk")
    well_formed = type(k) is int and 1 <= k <= pl.MAX_LANES and isinstance(key, bytes) and len(key) == 32 \
        and type(chunk) is int and chunk > 0
    bounds = pl.stripe_bounds(len(view), chunk, k) if well_formed else []
    if not well_formed or len(bounds) != k:
        raise TransferError(f"the source peer sent a malformed striped header: {str(hdr)[:120]}")

    async def lane(i: int) -> None:
        try:
            c = await dial(address, timeout=timeout, max_frame=max_frame, kind="transfer")
        except Exception as e:
            raise TransferError(f"cannot open transfer lane {i} to {address}: {getattr(e, 'message', e)}") from None
        try:
            await c.send(pl.encode_transfer_lane(key, i))
            ok = codec.unpackb(await _recv(c, timeout, watch))
            if not isinstance(ok, dict) or ok.get("type") != "ok":
                reason = ok.get("reason", "no reason given") if isinstance(ok, dict) else "malformed answer"
                raise TransferError(f"the source peer refused transfer lane {i}: {reason}")
            await _receive_data(c, view, timeout, *bounds[i], watch=watch)
        finally:
            try:
                await asyncio.wait_for(c.close(), 2.0)
            except Exception:
                pass
    await all_or_nothing([_receive_data(conn, view, timeout, *bounds[0], watch=watch),
                          *(lane(i) for i in range(1, k))])


async def _receive_data(conn: FrameConnection, view: memoryview, timeout: float, lo: int = 0,
                        hi: int | None = None, watch: _Watch | None = None) -> None:
    """Data frames ``[offset, nil, total]`` covering ``view[lo:hi]``, in order; straight into place
    where the transport has a data sink."""
    total = len(view)
    hi = total if hi is None else hi
    got = lo
    placed: dict[int, int] = {}
    expect = [lo]  # where the sink expects the next chunk

    def sink(head: memoryview, n: int) -> memoryview | None:
        try:
            off, _, tot = codec.decode_data_head(head)
        except (ProtocolError, ValueError):
            return None
        if type(off) is not int or tot != total or off != expect[0] or not n or off + n > hi:
            return None
        expect[0] += n
        placed[off] = n
        return view[off:off + n]

    set_sink = getattr(conn, "set_data_sink", None)
    if set_sink is not None:
        set_sink(sink)
    try:
        while got < hi:
            frame = await _recv(conn, timeout, watch)
            try:
                (off, _, _), payload = codec.decode_data(frame)
            except (ProtocolError, ValueError):
                raise TransferError("the source peer sent a malformed chunk") from None
            n = placed.pop(off, None) if not len(payload) and type(off) is int else None
            if n is None:
                n = len(payload)
                if type(off) is not int or not lo <= off <= hi - n:
                    raise TransferError("the source peer sent a chunk outside the tensor")
                view[off:off + n] = payload
                expect[0] = off + n
            if off != got or not n:
                raise TransferError("the source peer sent chunks out of order")
            got += n
    finally:
        if set_sink is not None:
            set_sink(None)


async def _recv(conn: FrameConnection, timeout: float, watch: _Watch | None = None) -> bytes:
    try:
        frame = await asyncio.wait_for(conn.recv(), timeout)
    except asyncio.TimeoutError:
        raise TransferError(f"the source peer sent nothing for {timeout:g} s") from None
    except (ConnectionError, OSError) as e:
        raise TransferError(f"the transfer stream broke: {e}") from None
    if frame is None:
        raise TransferError("the source peer closed the transfer stream early")
    if watch is not None:
        watch.tick()
    return frame


__all__ = ["download", "source_answers", "UNANNOUNCED_WAIT", "STALL_S", "PROBE_S"]
