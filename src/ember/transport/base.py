"""The transport seam: a transport only moves frames and names the peer.

A *frame* is an opaque byte string. Every transport gives the session pump the
same three verbs (Burn Remote's ``drive_session`` seam): send a frame, receive a
frame, and who is the peer. Adding a transport never touches session logic.

Two optional refinements let bulk data move without copies in Python:

* ``send`` also takes a *gathered* frame: a tuple or list of byte buffers whose
  concatenation is the frame (a small header and a view of an array). Every
  transport accepts it; one that can writes the parts with scatter-gather I/O.
* ``set_data_sink(sink)``: a transport that can read into a caller's buffer calls
  ``sink(head)`` when a *data frame* arrives (``protocol.messages``: first byte
  0xC1, then the head's length and the head) with the head's bytes and the
  payload's length; when the sink returns a writable memoryview of exactly that
  length, the payload is read straight into it and ``recv`` returns the frame
  without its payload. When the sink returns None (or the transport has no
  sink), ``recv`` returns the whole frame. Transports only recognise the
  envelope; what a head means is the session's business.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Any, Awaitable, Callable, Protocol, Sequence, Union, runtime_checkable

from ..errors import BindError

Buffer = Union[bytes, bytearray, memoryview]
#: One frame: a buffer, or a sequence of buffers sent as their concatenation.
Frame = Union[Buffer, Sequence[Buffer]]
#: ``sink(head, payload_length)`` -> where the payload goes, or None.
DataSink = Callable[[memoryview, int], "memoryview | None"]


_BIND_CAUSES = {errno.EADDRINUSE: ("address_in_use", "pick another port, or port 0 for a free one"),
                errno.EADDRNOTAVAIL: ("address_not_available", "bind an address this host owns, e.g. 127.0.0.1")}


def bind_error(e: OSError, where: str, what: str, flag: str) -> BindError:
    """A listener's bind failure as a ``BindError`` with its cause and a hint."""
    cause, hint = _BIND_CAUSES.get(e.errno or 0, ("other", f"check the {flag} address"))
    return BindError(f"cannot listen on {where} for {what}: {e.strerror or e}",
                     cause=cause, hint=hint, transient=cause == "address_in_use")


#: The largest frame a server reads from a connection before it accepted the connection's first frame
#: (a Hello, a lane's attach, a transfer request: all far smaller); transports buffer no more than that.
PRE_AUTH_FRAME = 16 * 1024

#: Buffers from this size are mapped with their pages populated at once (``receive_buffer``).
PREFAULT_MIN = 32 << 20


def available_memory() -> int | None:
    """Bytes of memory this machine can give now (Linux ``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def receive_buffer(nbytes: int) -> Any:
    """A writable uint8 NumPy array of ``nbytes`` that a large payload is read into.

    Above glibc's largest mmap threshold (32 MiB) every ``np.empty`` is a fresh mapping whose
    pages fault in one by one as the payload lands, a trap per 4 KiB page; on virtual machines
    that costs up to 1.2 ms per MiB (measured here: a 256 MiB read at 0.7 GB/s instead of 3.5).
    On Linux such buffers are mapped with ``MAP_POPULATE``, so the kernel fills the pages in one
    call (≈0.2 ms per MiB). ``EMBER_PREFAULT=0`` turns it off.

    Never more than the machine can hold: a buffer larger than the memory available now raises
    ``MemoryError`` with the size (like NumPy), and only buffers within half of it are prefaulted,
    so a huge read cannot commit the process into the kernel's OOM killer.
    """
    import numpy as np
    free = available_memory()
    if free is not None and nbytes > free:
        raise MemoryError(f"cannot receive {nbytes} bytes: this machine has {free} bytes available")
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes < PREFAULT_MIN or not populate or os.environ.get("EMBER_PREFAULT", "").strip() == "0" \
            or (free is not None and nbytes > free // 2):
        return np.empty(nbytes, np.uint8)
    try:
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
    except (OSError, ValueError):
        return np.empty(nbytes, np.uint8)
    return np.frombuffer(m, np.uint8)  # (the array keeps the mapping; unmapped when the last view goes)


def frame_parts(frame: Frame) -> list[memoryview]:
    """The parts of ``frame`` as flat byte views (a buffer is one part)."""
    if isinstance(frame, (bytes, bytearray, memoryview)):
        parts: Sequence[Buffer] = (frame,)
    else:
        parts = frame
    out = []
    for p in parts:
        v = p if isinstance(p, memoryview) else memoryview(p)
        if v.ndim != 1 or v.itemsize != 1:
            v = v.cast("B") if v.c_contiguous else memoryview(v.tobytes())
        out.append(v)
    return out


def frame_bytes(frame: Frame) -> bytes:
    """``frame`` as one bytes object (transports that must copy anyway)."""
    if isinstance(frame, bytes):
        return frame
    if isinstance(frame, (bytearray, memoryview)):
        return bytes(frame)
    return b"".join(frame_parts(frame))


@runtime_checkable
class FrameConnection(Protocol):
    """One bidirectional, ordered, reliable stream of frames."""

    #: Authenticated identity of the remote peer (iroh: 64 hex chars), or None
    #: where the transport authenticates nobody (memory, WebSocket).
    peer_id: str | None
    #: Human-readable remote address, for messages.
    remote: str

    async def send(self, frame: Frame) -> None:
        """Send one frame (a buffer, or the parts of one). Raises ``ConnectionError`` once the
        link is gone. When it returns, the frame's buffers are no longer referenced: the
        caller may reuse or change them."""

    async def recv(self) -> bytes | None:
        """Next frame; ``None`` when the peer closed the stream cleanly.

        Raises ``ConnectionError`` when the link broke.
        """

    async def close(self) -> None:
        """Close this stream. Idempotent."""


#: What a listener calls for each accepted session stream.
SessionHandler = Callable[[FrameConnection], Awaitable[None]]


class Listener(Protocol):
    """A bound server-side transport."""

    #: Addresses a client can pass to ``ember.connect`` (filled once started).
    addresses: list[str]

    async def start(self, handler: SessionHandler) -> None:
        """Bind and begin accepting; raise ``ember.errors.BindError`` on failure."""

    async def stop(self) -> None:
        """Stop accepting and close open connections."""
