"""Bytes <-> messages. Sans-I/O: nothing here knows a socket or a thread.

Tensor bytes travel as raw C-order bytes next to their dtype name and shape; nothing is
ever pickled. Small ones ride inside a MessagePack frame as ``bin``; large ones travel in
*data frames* (see ``messages``): a small MessagePack head followed by the bytes as they
are, so a sender hands a view of the array to the transport and a receiver can read them
straight into the destination array.
"""

from __future__ import annotations

import reprlib
from typing import Any, Callable, Iterator

import msgpack

from ..errors import LimitExceeded, ProtocolError
from . import messages as m

_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack
_array_header = msgpack.Packer(use_bin_type=True, autoreset=True).pack_array_header


def packb(obj: Any) -> bytes:
    """Encode one frame."""
    return _packb(obj)


def batch_frame(encoded: list[bytes]) -> bytes:
    """A batch frame of messages encoded one by one with ``packb``: the bytes ``packb(batch)`` gives."""
    return _array_header(len(encoded)) + b"".join(encoded)


#: Frames above this size are decoded counting their arrays and maps (see :func:`unpackb`).
COUNTED_ABOVE = 64 * 1024
#: Arrays and maps one frame may hold, whatever its size: decoding it costs at most ~0.2 s of the
#: network loop (a 60 MB frame of 15 M empty arrays stalled every session for 16 s). Real frames
#: hold far fewer: a batch of ``max_messages`` ops about 4 each, a graph of MAX_GRAPH_OPS 3 each.
MAX_OBJECTS = 1 << 19


class _TooManyObjects(Exception):
    pass


def _counting_hooks(limit: int) -> dict[str, Any]:
    left = [limit]

    def seen(obj: Any) -> Any:
        left[0] -= 1
        if left[0] < 0:
            raise _TooManyObjects
        return obj
    return {"list_hook": seen, "object_hook": seen}


def _most(n: int) -> int:
    return min(n // 4 + 4096, MAX_OBJECTS)


def unpackb(frame: bytes, *, max_frame: int = m.DEFAULT_MAX_FRAME + 4096) -> Any:
    """Decode one frame, turning every decoding failure into ``ProtocolError``.

    A MessagePack empty array is one byte but a Python list of 56: decoded, a frame of
    nested empty arrays is ~70x its size. Frames above :data:`COUNTED_ABOVE` bytes are
    therefore decoded counting arrays and maps, at most one per 4 bytes of frame (real
    frames have fewer: an upload chunk has three), which keeps a decoded frame
    within ~25x its size; smaller frames decode at full speed (at most a few MB).
    """
    n = len(frame)
    if n > max_frame:
        raise LimitExceeded(f"frame of {n} bytes exceeds the limit of {max_frame} bytes")
    try:
        if n <= COUNTED_ABOVE:
            return msgpack.unpackb(frame, raw=False, strict_map_key=False)
        return msgpack.unpackb(frame, raw=False, strict_map_key=False, **_counting_hooks(_most(n)))
    except _TooManyObjects:
        raise LimitExceeded(f"frame of {n} bytes holds more than {_most(n)} arrays and maps") from None
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"malformed frame ({n} bytes): {type(e).__name__}: {str(e)[:200]}") from None


# ---- data frames ------------------------------------------------------------------

_DATA_BYTE = bytes([m.DATA_MARK])


def data_prefix(head: list[Any]) -> bytes:
    """Everything of a data frame but its payload: the mark, the head's length and the head."""
    h = _packb(head)
    return _DATA_BYTE + len(h).to_bytes(4, "big") + h


def is_data(frame: Any) -> bool:
    """Is ``frame`` a data frame? (0xC1 never starts a MessagePack value.)"""
    return len(frame) > 0 and frame[0] == m.DATA_MARK


def data_head_size(first: Any) -> int:
    """Bytes of head after the 5-byte prefix of a data frame whose first 5 bytes are ``first``."""
    n = int.from_bytes(bytes(first[1:5]), "big")
    if n > m.MAX_DATA_HEAD:
        raise ProtocolError(f"data frame head of {n} bytes exceeds {m.MAX_DATA_HEAD} bytes")
    return n


def decode_data_head(head: Any) -> list[Any]:
    """The head of a data frame: a message or response whose bytes field is nil."""
    h = unpackb(bytes(head), max_frame=m.MAX_DATA_HEAD)
    if not isinstance(h, list) or len(h) < 3:
        raise ProtocolError(f"malformed data frame head: {str(h)[:80]}")
    return h


def is_upload_head(h: list[Any]) -> bool:
    """Is a client's data frame head an upload chunk, ``[UPLOAD, id, dtype, shape, offset, nil, total]``
    (the only data frame a client sends)?"""
    return len(h) == 7 and h[0] == m.UPLOAD and h[5] is None


def decode_data(frame: Any) -> tuple[list[Any], memoryview]:
    """(head, payload) of a data frame. The payload is empty when the transport already put it
    where the data sink asked (see ``transport.base``)."""
    mv = memoryview(frame)
    if len(mv) < m.DATA_PREFIX:
        raise ProtocolError(f"truncated data frame ({len(mv)} bytes)")
    n = data_head_size(mv[:m.DATA_PREFIX])
    end = m.DATA_PREFIX + n
    if len(mv) < end:
        raise ProtocolError(f"truncated data frame head ({len(mv)} of {end} bytes)")
    return decode_data_head(mv[m.DATA_PREFIX:end]), mv[end:]


def payload_slot(head: list[Any]) -> int:
    """Index in ``head`` of the (nil) bytes field whose value the payload is.

    Upload: ``[UPLOAD, id, dtype, shape, offset, nil, total]`` (slot 5). Read answers:
    ``[req, CHUNK, [offset, nil, total]]`` and ``[req, OK, [dtype, shape, offset, nil, total]]``
    (slot -2 of the payload list). Transfer chunks: ``[offset, nil, total]``.
    """
    return 5 if len(head) == 7 else -2


def upload_frames(tid: int, dtype: str, shape: list[int], flat: memoryview,
                  chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """An upload as data frames, ``(prefix, payload view)`` each: zero-copy chunks of ``flat``."""
    total = len(flat)
    for off in range(0, total, chunk) if total else [0]:
        yield data_prefix([m.UPLOAD, tid, dtype, shape, off, None, total]), flat[off:off + chunk]


def read_frames(req: int, dtype: str, shape: list[int], flat: memoryview,
                chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """A read answer as data frames: CHUNKs, then the OK carrying dtype and shape."""
    total = len(flat)
    last = ((total - 1) // chunk) * chunk if total else 0
    for off in range(0, last, chunk):
        yield data_prefix([req, m.CHUNK, [off, None, total]]), flat[off:off + chunk]
    yield data_prefix([req, m.OK, [dtype, shape, last, None, total]]), flat[last:]


def chunked(head: Callable[[int], list[Any]], flat: memoryview, lo: int, hi: int,
            chunk: int) -> Iterator[tuple[bytes, memoryview]]:
    """Data frames of bytes ``[lo, hi)`` of ``flat``, ``chunk`` at a time, each under ``head(offset)``."""
    for off in range(lo, hi, chunk):
        yield data_prefix(head(off)), flat[off:min(hi, off + chunk)]


def chunk_frames(flat: memoryview, chunk: int, lo: int = 0, hi: int | None = None) -> Iterator[tuple[bytes, memoryview]]:
    """A transfer stream's bytes (all, or the stripe ``[lo, hi)``) as data frames ``[offset, nil, total]``."""
    total = len(flat)
    return chunked(lambda off: [off, None, total], flat, lo, total if hi is None else hi, chunk)


# ---- handshake -----------------------------------------------------------------

def encode_hello(*, session_id: bytes, device: int, credential: bytes = b"",
                 client_version: str = "", protocol: int = m.PROTOCOL_VERSION,
                 features: list[str] | None = None, admin: bool = False) -> bytes:
    """``features``: optional wire features the client speaks (``messages.FEATURES``); the
    Welcome answers with those both sides speak. ``admin``: ask for an admin session
    (whole-peer STATS); ``credential`` is then the peer's admin token."""
    hello = {"type": "hello", "protocol": protocol, "session_id": session_id,
             "device": device, "credential": credential, "client": client_version,
             "features": [f for f in m.FEATURES if f != m.COMPILE_FEATURE] if features is None else list(features)}
    if admin:
        hello["admin"] = True
    return packb(hello)


def agreed_features(offered: Any) -> list[str]:
    """The features of ``offered`` (a Hello's or Welcome's ``features``) this side speaks too."""
    if not isinstance(offered, list):
        return []
    return [f for f in m.FEATURES if f in offered]


def decode_hello(frame: bytes) -> dict[str, Any]:
    """Validate a client's first frame; raise ProtocolError naming what is wrong."""
    d = unpackb(frame, max_frame=1 << 20)
    if not isinstance(d, dict) or d.get("type") != "hello":
        raise ProtocolError("expected a Hello frame as the first frame of a session")
    if not isinstance(d.get("protocol"), int):
        raise ProtocolError("Hello carries no protocol version")
    if not isinstance(d.get("device"), int) or isinstance(d.get("device"), bool):
        raise ProtocolError("Hello carries no device index")
    cred = d.get("credential", b"")
    if not isinstance(cred, (bytes, type(None))):
        raise ProtocolError("Hello credential must be bytes")
    sid = d.get("session_id", b"")
    if not isinstance(sid, bytes) or len(sid) != 16:
        raise ProtocolError("Hello session_id must be 16 bytes")
    if not isinstance(d.get("admin", False), bool):
        raise ProtocolError("Hello admin flag must be a boolean")
    d["credential"] = cred or b""
    return d


def encode_welcome(*, peer_id: str | None, devices: list[dict[str, Any]], device: int,
                   limits: dict[str, int], server_version: str = "", **extra: Any) -> bytes:
    """``extra``: ``instance`` (this server process), ``transfer_id`` (the peer id its downloads present)."""
    return packb({"type": "welcome", "protocol": m.PROTOCOL_VERSION, "peer_id": peer_id,
                  "device_count": len(devices), "devices": devices, "device": device,
                  "limits": limits, "server": server_version, **extra})


def encode_reject(code: str, reason: str, **extra: Any) -> bytes:
    return packb({"type": "reject", "protocol": m.PROTOCOL_VERSION, "code": code,
                  "reason": reason, **extra})


def decode_reply(frame: bytes) -> dict[str, Any]:
    """Decode the server's handshake reply (Welcome or Reject) without judging it."""
    d = unpackb(frame, max_frame=1 << 20)
    if not isinstance(d, dict) or d.get("type") not in ("welcome", "reject"):
        raise ProtocolError("the peer answered Hello with something that is neither Welcome nor Reject")
    return d


# ---- batches and responses -----------------------------------------------------

def decode_batch(frame: bytes, max_frame: int, max_messages: int | None = None) -> list[list[Any]]:
    """Decode a client batch; every message must be a non-empty array with a known kind.

    ``max_messages``: LimitExceeded for a batch of more messages than that.
    """
    batch = unpackb(frame, max_frame=max_frame)
    if not isinstance(batch, list):
        raise ProtocolError(f"a batch must be an array of messages, got {type(batch).__name__}")
    if max_messages is not None and len(batch) > max_messages:
        raise LimitExceeded(f"batch of {len(batch)} messages exceeds this peer's limit of {max_messages}")
    n = len(m.KIND_NAMES)
    for msg in batch:
        if not isinstance(msg, list) or not msg or type(msg[0]) is not int or not 0 <= msg[0] < n:
            raise ProtocolError(f"malformed message in batch: {safe_repr(msg)}")
    return batch


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict = 3, 80, 80, 8, 8


def safe_repr(v: Any, limit: int = 80) -> str:
    """repr of a client-sent value for a message: bounded in depth and length, never a RecursionError."""
    try:
        return _repr.repr(v)[:limit]
    except Exception:  # noqa: BLE001
        return f"<{type(v).__name__}>"


def decode_responses(frame: bytes, max_frame: int) -> list[list[Any]]:
    resp = unpackb(frame, max_frame=max_frame)
    if not isinstance(resp, list) or not all(isinstance(r, list) and len(r) == 3 for r in resp):
        raise ProtocolError("malformed response frame from the peer")
    return resp


# ---- index keys (x[key]) ---------------------------------------------------------

def encode_key(key: Any, array_ids: list[int], array_type: type) -> list[Any]:
    """Encode an index key. Arrays (instances of ``array_type``, which carry ``_id``)
    become ``["a", n]``: the n-th extra input, whose id is appended to ``array_ids``."""
    items = key if isinstance(key, tuple) else (key,)
    out: list[Any] = []
    for k in items:
        if isinstance(k, slice):
            out.append([m.KEY_SLICE, k.start, k.stop, k.step])
        elif k is None:
            out.append([m.KEY_NONE])
        elif k is Ellipsis:
            out.append([m.KEY_ELLIPSIS])
        elif isinstance(k, array_type):
            out.append([m.KEY_ARRAY, len(array_ids)])
            array_ids.append(k._id)
        else:
            out.append(k)
    return out


def decode_key(items: list[Any], arrays: list[Any]) -> tuple[Any, ...]:
    out: list[Any] = []
    for k in items:
        if isinstance(k, list):
            tag = k[0]
            if tag == m.KEY_SLICE:
                out.append(slice(k[1], k[2], k[3]))
            elif tag == m.KEY_NONE:
                out.append(None)
            elif tag == m.KEY_ELLIPSIS:
                out.append(Ellipsis)
            elif tag == m.KEY_ARRAY:
                out.append(arrays[k[1]])
            else:
                raise ProtocolError(f"unknown index item {k!r}")
        elif isinstance(k, (int, bool)):
            out.append(k)
        else:
            raise ProtocolError(f"unsupported index item {k!r}")
    return tuple(out)
