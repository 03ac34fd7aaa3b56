"""Lanes: several streams per large transfer (feature ``"lanes"``). Sans-I/O.

A session's frames travel on one stream, and one stream is one queue: over iroh (QUIC) a
single stream moves bulk data well below what the connection can carry. With the feature
``"lanes"`` agreed, the client opens up to ``max`` more streams to the same peer (over iroh,
bi-streams of the same QUIC connection) and *attaches* each to its session; a large upload or
read answer is then cut into contiguous *stripes*, one per lane, sent side by side as ordinary
data frames and reassembled in place by offset. The session stream keeps every ordering
decision:

* upload: the session stream carries ``[UPLOAD, id, dtype, shape, 0, nil, total]`` (nil bytes:
  "they come on lanes") at the upload's place in the batch order; the peer runs it only once
  every chunk has arrived on the lanes, so the tensor exists before any later message uses it;
* read: the chunks arrive on the lanes as ``[req, CHUNK, [offset, nil, total]]`` frames, the
  answer's ``[req, OK, [dtype, shape, total, nil, total]]`` (no payload) on the session stream
  after them; the client completes the read when it has the OK *and* all ``total`` bytes;
* download between peers: the request names ``lanes``; the source answers ``lanes`` (how
  many streams it will use), ``lane_key`` and ``chunk``, the downloader opens the extra
  transfer streams with a :func:`transfer_lane` request each, and stripe ``i`` of
  :func:`stripe_bounds` arrives on lane ``i`` (lane 0 is the request's own stream), in order.

Chunks on lanes are ``chunk`` bytes (the session's, from Welcome) at offsets that are
multiples of it (the last one shorter); a receiver tracks them in a :class:`Coverage`, so a
duplicate, misaligned or out-of-range chunk is refused and a tensor is complete only when
every byte has arrived exactly once.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import ProtocolError
from . import codec
from . import messages as m

#: Streams a session may attach, at most (the peer may announce fewer).
MAX_LANES = 8
#: Bytes from which an upload or read is striped over lanes.
STRIPE_MIN = 2 * m.DEFAULT_CHUNK
#: Lanes a client opens over iroh unless told otherwise (``ember.connect(..., lanes=N)``); a
#: download between iroh peers uses as many streams.
DEFAULT_LANES = 4
TRANSFER_LANES = DEFAULT_LANES


def stripe_bounds(total: int, chunk: int, k: int) -> list[tuple[int, int]]:
    """``total`` bytes cut into at most ``k`` contiguous, chunk-aligned stripes ``[lo, hi)``
    (fewer when there are fewer chunks; one empty stripe for an empty tensor)."""
    chunks = max(1, -(-total // chunk))
    k = max(1, min(k, chunks))
    cuts = [min(total, (i * chunks // k) * chunk) for i in range(k)] + [total]
    return [(cuts[i], cuts[i + 1]) for i in range(k)]


def upload_stripe(tid: int, dtype: str, shape: list[int], flat: memoryview, lo: int, hi: int,
                  chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """Data frames of one stripe of an upload (heads as ``codec.upload_frames``)."""
    total = len(flat)
    return codec.chunked(lambda off: [m.UPLOAD, tid, dtype, shape, off, None, total], flat, lo, hi, chunk)


def read_stripe(req: int, flat: memoryview, lo: int, hi: int, chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """CHUNK data frames of one stripe of a read answer."""
    total = len(flat)
    return codec.chunked(lambda off: [req, m.CHUNK, [off, None, total]], flat, lo, hi, chunk)


def read_done(req: int, dtype: str, shape: list[int], total: int) -> bytes:
    """The OK that ends a striped read answer: a data frame without payload, on the session stream."""
    return codec.data_prefix([req, m.OK, [dtype, shape, total, None, total]])


class Coverage:
    """Which chunks of a ``total``-byte tensor have arrived (each exactly once, chunk-aligned)."""

    __slots__ = ("total", "chunk", "seen", "missing")

    def __init__(self, total: int, chunk: int) -> None:
        self.total, self.chunk = total, chunk
        n = -(-total // chunk)
        self.seen = bytearray(n)
        self.missing = n

    def expect(self, off: Any, n: int) -> bool:
        """May a chunk of ``n`` bytes at ``off`` be placed? (Marks it: a second one is refused.)"""
        c = self.chunk
        if type(off) is not int or off < 0 or off % c or off >= self.total or n != min(c, self.total - off):
            return False
        i = off // c
        if self.seen[i]:
            return False
        self.seen[i] = 1
        self.missing -= 1
        return True

    @property
    def complete(self) -> bool:
        return self.missing == 0


# ---- attaching a lane -------------------------------------------------------------------

def encode_attach(session_id: bytes, key: bytes) -> bytes:
    """The first frame of a lane stream: attach it to session ``session_id`` (``key`` from Welcome)."""
    return codec.packb({"type": "lane", "session_id": session_id, "key": key})


def encode_transfer_lane(key: bytes, index: int) -> bytes:
    """The first frame of an extra transfer stream: stripe ``index`` of the download ``key`` names."""
    return codec.packb({"type": "transfer_lane", "key": key, "index": index})


def decode_first(d: Any) -> tuple[str, bytes, Any] | None:
    """``("lane", session_id, key)`` or ``("transfer_lane", key, index)`` for a decoded first frame
    that asks for a lane, else None. ProtocolError when it asks for one but is malformed."""
    if not isinstance(d, dict) or d.get("type") not in ("lane", "transfer_lane"):
        return None
    key = d.get("key")
    if not isinstance(key, bytes) or len(key) != 32:
        raise ProtocolError("a lane request must carry a 32-byte key")
    if d["type"] == "lane":
        sid = d.get("session_id")
        if not isinstance(sid, bytes) or len(sid) != 16:
            raise ProtocolError("a lane request must name a 16-byte session id")
        return "lane", sid, key
    index = d.get("index")
    if type(index) is not int or not 0 < index < MAX_LANES:
        raise ProtocolError(f"a transfer lane index must be an int in 1..{MAX_LANES - 1}")
    return "transfer_lane", key, index


def agreed_lanes(welcome: dict[str, Any], wanted: int) -> tuple[int, bytes | None]:
    """(how many lanes this session may use, the attach key) from a Welcome."""
    info = welcome.get("lanes")
    if m.LANES_FEATURE not in codec.agreed_features(welcome.get("features")) or not isinstance(info, dict):
        return 0, None
    key, most = info.get("key"), info.get("max")
    if not isinstance(key, bytes) or len(key) != 32 or type(most) is not int:
        return 0, None
    return max(0, min(wanted, most, MAX_LANES)), key


__all__ = ["MAX_LANES", "STRIPE_MIN", "DEFAULT_LANES", "TRANSFER_LANES", "stripe_bounds", "upload_stripe", "read_stripe", "read_done",
           "Coverage", "encode_attach", "encode_transfer_lane", "decode_first", "agreed_lanes"]
