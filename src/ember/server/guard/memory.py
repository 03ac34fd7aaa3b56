"""Memory budgets: what a device, and each session on it, may hold.

Two budgets bound every byte a peer keeps for its clients:

* a **device budget** (:class:`DeviceMemory`), shared by every session on that
  device. Devices backed by host RAM (``cpu``, ``torch:cpu``, ``jax:cpu``) share
  one host budget; each GPU has its own. Default: 75 % of physical RAM (or of
  the cgroup's memory limit, when lower) for the host, 90 % of device memory
  for a GPU (``ember serve --memory-limit``, ``Server(memory_limit=...)``);
* a **session budget** (:class:`SessionMemory`), drawn from its device's
  (``--session-memory``, ``Server(session_memory=...)``; default: the device
  budget).

The rule: **charge before allocating wherever the size is known, else right
after.** The client knows every output's shape, the server must not trust it,
so the server charges

* uploads their *declared* total at the first chunk (before the buffer exists);
* creation functions (``zeros``, ``full``, ``arange``, ``eye``...) and every op
  whose output can be larger than its inputs (broadcasting, ``matmul``,
  ``tile``, advanced indexing...: :mod:`ember.server.execute.sizes`) their predicted
  size before they run; the reservation is replaced by the real figure after;
* staging copies of reads before the copy, downloads from other peers before
  the buffer is allocated;
* everything else from the result's ``nbytes`` right after the op produced it
  (an op whose output is no larger than its inputs can overshoot by at most
  one such output before it is refused); over budget, the result is freed at
  once and the op's outputs are poisoned with :class:`~ember.errors.LimitExceeded`.

Tensors are charged per *buffer*: views (reshapes, slices, transposes,
broadcasts) of a buffer the session already holds cost nothing more, and keep
that buffer charged for as long as they live (:meth:`SessionMemory.hold`).
Graph-cache entries, exposed transfers and half-received uploads are charged
by bytes (:meth:`SessionMemory.charge`). Batches queued for the session's worker
are *counted* but never refused (``shared_charge``), and answers queued for the
network appear in the session's figures: back-pressure bounds both instead
(``max_inflight``, ``stage_window`` in :mod:`ember.server.guard.limits`). Closing a
session returns everything it held (:meth:`SessionMemory.close`).

Anything else that keeps memory for a session (e.g. the PyTorch frontend's
per-session storage store) calls ``session.charge(nbytes, what)`` before it
allocates, ``session.release(nbytes)`` when it frees, and lets ``close()``
return the rest. ``what`` is a string or a zero-argument callable producing
one (built only when a refusal needs the message). Thread use is described on
:class:`SessionMemory`: the per-op path takes no lock (sessions draw device
memory in 1 MiB slabs), cross-thread figures go through the device's lock.
"""

from __future__ import annotations

import os
import queue
import re
import threading
from typing import Any, Callable

from ...errors import LimitExceeded

#: Fractions of physical memory a device budget takes by default.
HOST_FRACTION = 0.75
GPU_FRACTION = 0.90

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"16GiB"``, ``"512 MB"``, ``"1.5g"``, ``4096`` -> bytes; ValueError naming the accepted forms."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (write e.g. 16GiB, 512MiB, 4GB or a number of bytes)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """Human figure with the exact count: ``3.0 GiB (3200000000 bytes)`` style, short for small values."""
    n = int(n)
    if abs(n) < 1024:
        return f"{n} bytes"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _text(what: Any) -> str:
    """``what`` as words: a string, a callable producing one, or ``(op name, value)`` for an output."""
    try:
        if type(what) is tuple:
            name, v = what
            shape = getattr(v, "shape", None)
            return f"{name} output {tuple(shape)} {str(getattr(v, 'dtype', '')).rsplit('.', 1)[-1]}" \
                if shape is not None else f"{name} output"
        return what() if callable(what) else str(what)
    except Exception:  # noqa: BLE001 - a message must never fail the refusal it explains
        return "this request"


def physical_memory() -> int | None:
    """Bytes of RAM this process may use: physical memory, capped by a cgroup limit."""
    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            total = min(total, int(raw)) if total else int(raw)
    return total


def default_limit(device_memory: int | None, on_host: bool) -> int | None:
    """The default budget of a device (None: unknown, unbounded)."""
    if on_host:
        ram = physical_memory()
        return int(ram * HOST_FRACTION) if ram else None
    return int(device_memory * GPU_FRACTION) if device_memory else None


_trim_lock = threading.Lock()
_last_trim = [0.0]
_libc: Any = None


def _libc_handle() -> Any:
    """glibc through ctypes, or False where it is not the C library (called under ``_trim_lock``)."""
    global _libc
    if _libc is None:
        try:
            import ctypes
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    return _libc


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # (glibc's malloc.h)


#: ``ember serve --keep-freed``'s default: free space a malloc heap keeps at its top for the next buffers.
KEEP_FREED = 512 << 20


def keep_freed_pages(mmap_threshold: int = 32 << 20, trim_threshold: int = KEEP_FREED) -> bool:
    """Make glibc keep what kernels free for the next step's buffers, as a GPU caching allocator does.

    By default a peer's session thread allocates from a secondary malloc arena whose heap glibc
    trims (and whose large blocks it maps and unmaps) as buffers come and go: every training step
    then touches hundreds to thousands of fresh pages (page faults and zeroing: a GPT step's kernels
    ran ~1.3x slower on the peer than in a local process, which keeps its main-arena pages).
    Blocks up to ``mmap_threshold`` (32 MiB, glibc's maximum) now come from the heap, and up to
    ``trim_threshold`` of free space at a heap's top stays mapped (``ember serve --keep-freed``; each
    session's thread has its own heap, so a peer may hold that much per open session beyond what its
    budgets count); ``give_back_freed`` still returns everything when a session ends. Process-wide:
    called by ``ember serve`` only, never in a user's process (the embedded peer). A no-op (False)
    where glibc is not the allocator.
    """
    with _trim_lock:
        libc = _libc_handle()
        if not libc:
            return False
        most = (1 << 31) - 1  # (mallopt takes a C int)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, min(mmap_threshold, most))) and \
            bool(libc.mallopt(_M_TRIM_THRESHOLD, min(trim_threshold, most)))


def give_back_freed(min_interval: float = 1.0, force: bool = False) -> bool:
    """Return freed heap pages to the OS (glibc ``malloc_trim``), at most every ``min_interval`` s
    unless ``force`` (the last session of a peer ended).

    Called when a session ends: its worker thread's malloc arena otherwise keeps the pages
    of everything the session freed, and a peer's RSS would creep up with each tenant.
    A no-op where glibc is not the allocator.
    """
    import time
    with _trim_lock:
        now = time.monotonic()
        if now - _last_trim[0] < min_interval and not force:
            return False
        _last_trim[0] = now
        libc = _libc_handle()
        if not libc:
            return False
    libc.malloc_trim(0)
    return True


# ---- what a value costs ----------------------------------------------------------------

Footprint = Callable[[Any], "tuple[int, int]"]


def _array_footprint(x: Any) -> tuple[int, int]:
    """NumPy / CuPy: (identity of the buffer's owner, its size). Views resolve to their base."""
    b = x
    while True:
        nb = getattr(b, "base", None)
        if nb is None:
            break
        b = nb
    n = getattr(b, "nbytes", None)
    if n is None:
        try:
            n = memoryview(b).nbytes  # bytes / bytearray behind np.frombuffer
        except TypeError:
            n = 0
    return id(b), int(n)


def _torch_footprint(x: Any) -> tuple[int, int]:
    try:
        s = x.untyped_storage()
    except AttributeError:  # a Python scalar
        return id(x), 0
    return s.data_ptr(), int(s.nbytes())


def _plain_footprint(x: Any) -> tuple[int, int]:
    return id(x), int(getattr(x, "nbytes", 0) or 0)


def footprint_for(kind: str) -> Footprint:
    """``value -> (buffer key, bytes)`` for a backend kind (numpy, torch, cupy, jax)."""
    return {"numpy": _array_footprint, "cupy": _array_footprint, "torch": _torch_footprint}.get(
        kind, _plain_footprint)


def host_copy_bytes(kind: str, v: Any) -> int:
    """Bytes a read of ``v`` copies before sending (0 when the host sees the tensor's own memory)."""
    try:
        if kind == "numpy":
            return 0 if v.flags.c_contiguous else int(v.size * v.itemsize)
        if kind == "torch" and v.device.type == "cpu" and v.is_contiguous():
            return 0
        return int(v.nbytes)
    except Exception:  # noqa: BLE001 - scalars and oddities: nothing worth charging
        return 0


# ---- budgets ----------------------------------------------------------------------------------

class DeviceMemory:
    """The budget of one device (or of host RAM, shared by the host's devices)."""

    def __init__(self, limit: int | None, name: str, flag: str = "--memory-limit") -> None:
        self.limit = limit
        self.name = name
        self.flag = flag
        self.lock = threading.Lock()
        self._held = 0
        self.peak = 0
        self.refusals = 0
        self.sessions: set[SessionMemory] = set()

    def held(self) -> int:
        """Bytes the sessions hold (without the slab credit they drew but have not used)."""
        with self.lock:
            return self._held - sum(s._credit for s in self.sessions)

    def reserved(self) -> int:
        """Bytes drawn from this budget: what is held plus the sessions' unused slab credit."""
        return self._held

    def session(self, limit: int | None, label: str, flag: str = "--session-memory") -> "SessionMemory":
        """A new session budget drawn from this device (``limit`` None: bounded by the device only)."""
        s = SessionMemory(self, limit, label, flag)
        with self.lock:
            self.sessions.add(s)
        return s

    def stats(self) -> dict[str, Any]:
        with self.lock:
            credit = sum(s._credit for s in self.sessions)
            return {"budget": self.name, "limit": self.limit, "held": self._held - credit,
                    "reserved": self._held, "peak": self.peak, "refusals": self.refusals,
                    "sessions": len(self.sessions)}


class SessionMemory:
    """One session's budget, drawn from its device's.

    Threads: ``charge``, ``release``, ``hold`` and ``unhold`` are called by whoever runs the
    session's interpreter (its worker, or the network loop for an inline batch: one at a time),
    so they take no lock on the hot path; the session draws device memory in slabs of
    :data:`SLAB` bytes under the device's lock and returns what it does not use. ``shared_charge``,
    ``shared_reserve``, ``shared_release`` and ``unhold_later`` may be called from any thread (frames
    queued for the network, batches queued for the worker, uploads the network loop reads into place,
    exposures released by another session); ``adopt_shared`` makes a shared charge the owner's.
    """

    SLAB = 1 << 20

    def __init__(self, device: DeviceMemory, limit: int | None, label: str, flag: str) -> None:
        self.device = device
        self.limit = limit
        self.label = label
        self.flag = flag
        self._held = 0    # charged by this session's own thread
        self._credit = 0  # drawn from the device, not yet used (at most 2 slabs)
        self._shared = 0  # charged from other threads (under the device lock)
        self.peak = 0
        self.refusals = 0
        self.closed = False
        self._bufs: dict[int, list[int]] = {}  # buffer key -> [bytes charged, references]
        self._later: queue.SimpleQueue[int] = queue.SimpleQueue()

    # ---- bytes ------------------------------------------------------------------------
    def charge(self, nbytes: int, what: Any = "this request", *, strict: bool = True) -> None:
        """Charge ``nbytes``; LimitExceeded (and nothing charged) when a budget cannot take them.

        ``strict=False`` records them without refusing (bounded elsewhere).
        """
        n = int(nbytes)
        if n <= 0:
            return
        if self.closed:
            if strict:
                raise LimitExceeded(f"{_text(what)}: this session has ended")
            return
        if strict and self.limit is not None and self._held + self._shared + n > self.limit:
            self.refusals += 1
            raise LimitExceeded(self._refusal(n, what, session=True), hint=self._hint(session=True))
        if n > self._credit:
            self._draw(n - self._credit, what, strict)
        self._credit -= n
        self._held += n
        if self._held + self._shared > self.peak:
            self.peak = self._held + self._shared

    def _draw(self, need: int, what: Any, strict: bool) -> None:
        dev = self.device
        with dev.lock:
            want = need + self.SLAB
            if dev.limit is not None and dev._held + want > dev.limit:
                want = need  # near the limit: no slack
                if strict and dev._held + want > dev.limit:
                    self.refusals += 1
                    dev.refusals += 1
                    raise LimitExceeded(self._refusal(need + self._credit, what, session=False),
                                        hint=self._hint(session=False))
            dev._held += want
            if dev._held > dev.peak:
                dev.peak = dev._held
        self._credit += want

    def release(self, nbytes: int) -> None:
        """Give ``nbytes`` back (a no-op once the session is closed: close returned everything)."""
        n = min(int(nbytes), self._held)
        if n <= 0 or self.closed:
            return
        self._held -= n
        self._credit += n
        if self._credit > 2 * self.SLAB:
            give, self._credit = self._credit - self.SLAB, self.SLAB
            with self.device.lock:
                self.device._held -= give

    def shared_charge(self, nbytes: int) -> None:
        """Count ``nbytes`` from any thread (never refused: back-pressure bounds these)."""
        with self.device.lock:
            if self.closed or nbytes <= 0:
                return
            self._shared += nbytes
            self.device._held += nbytes

    def shared_reserve(self, nbytes: int, what: Any = "this request") -> None:
        """``shared_charge`` that refuses like :meth:`charge` (LimitExceeded, nothing charged) past
        the session's or the device's budget: for buffers another thread fills (uploads on lanes)."""
        n = int(nbytes)
        dev = self.device
        with dev.lock:
            if self.closed:
                raise LimitExceeded(f"{_text(what)}: this session has ended")
            if self.limit is not None and self._held + self._shared + n > self.limit:
                self.refusals += 1
                raise LimitExceeded(self._refusal(n, what, session=True), hint=self._hint(session=True))
            if dev.limit is not None and dev._held + n > dev.limit:
                self.refusals += 1
                dev.refusals += 1
                raise LimitExceeded(self._refusal(n, what, session=False), hint=self._hint(session=False))
            self._shared += n
            dev._held += n
            self.peak = max(self.peak, self._held + self._shared)
            dev.peak = max(dev.peak, dev._held)

    def adopt_shared(self, nbytes: int) -> None:
        """Turn ``nbytes`` of a shared charge into this session's own (its thread, e.g. the worker
        taking over an upload the network loop reserved); the device's count is unchanged."""
        with self.device.lock:
            if self.closed:
                return
            n = min(int(nbytes), self._shared)
            self._shared -= n
            self._held += n

    def shared_release(self, nbytes: int) -> None:
        with self.device.lock:
            if self.closed:
                return
            n = min(nbytes, self._shared)
            self._shared -= n
            self.device._held -= n

    # ---- tensors, per buffer --------------------------------------------------------------
    def hold(self, key: int, nbytes: int, what: Any, prepaid: int = 0) -> None:
        """One more tensor refers to buffer ``key`` of ``nbytes``: charge it if it is new.

        ``prepaid``: bytes already charged for this value (an upload's declared total),
        converted into the holding. LimitExceeded leaves nothing charged (prepaid released).
        """
        bufs = self._bufs
        e = bufs.get(key)
        if e is not None:
            e[1] += 1
            if prepaid:
                self.release(prepaid)
            return
        if not prepaid and nbytes <= self._credit and not self.closed and \
                (self.limit is None or self._held + self._shared + nbytes <= self.limit):
            self._credit -= nbytes  # the hot path: charge() inlined
            self._held += nbytes
            if self._held + self._shared > self.peak:
                self.peak = self._held + self._shared
            bufs[key] = [nbytes, 1]
            return
        if nbytes > prepaid:
            try:
                self.charge(nbytes - prepaid, what)
            except LimitExceeded:
                self.release(prepaid)
                raise
        elif prepaid:
            self.release(prepaid - nbytes)
        self._bufs[key] = [nbytes, 1]

    def unhold(self, key: int) -> None:
        """A tensor referring to buffer ``key`` is gone; release the buffer with its last reference."""
        e = self._bufs.get(key)
        if e is None:
            return
        if e[1] > 1:
            e[1] -= 1
            return
        del self._bufs[key]
        n = e[0]
        if n <= self._held and self._credit + n <= 2 * self.SLAB and not self.closed:
            self._held -= n  # the hot path: release() inlined
            self._credit += n
        else:
            self.release(n)

    def unhold_later(self, key: int) -> None:
        """:meth:`unhold` from another thread: done by the session's thread at its next :meth:`settle`."""
        self._later.put(key)

    def settle(self) -> None:
        """Apply the releases other threads queued (the session's thread calls this before a batch)."""
        later = self._later
        while not later.empty():
            self.unhold(later.get_nowait())

    # ---- figures and the end -------------------------------------------------------------
    def held(self) -> int:
        """Bytes this session holds (its charges and the shared ones; not its unused slab credit)."""
        return self._held + self._shared

    def stats(self) -> dict[str, Any]:
        return {"session": self.label, "limit": self.limit, "held": self.held(), "peak": self.peak,
                "buffers": len(self._bufs), "refusals": self.refusals}

    def close(self) -> None:
        """Return everything this session still holds (and its credit) to its device. Idempotent;
        called by the session's own thread at its end."""
        self.settle()
        dev = self.device
        with dev.lock:
            if self.closed:
                return
            dev._held -= self._held + self._credit + self._shared
            self._held = self._credit = self._shared = 0
            self._bufs.clear()
            self.closed = True
            dev.sessions.discard(self)

    # ---- messages ---------------------------------------------------------------------------
    def _refusal(self, n: int, what: Any, session: bool) -> str:
        mine = f"this session holds {format_bytes(self.held())}"
        if session:
            return (f"{_text(what)} needs {format_bytes(n)}, over the session memory budget of "
                    f"{format_bytes(self.limit or 0)} ({self.flag}); {mine}")
        dev = self.device
        others = len(dev.sessions)
        return (f"{_text(what)} needs {format_bytes(n)}, over the {dev.name} memory budget of "
                f"{format_bytes(dev.limit or 0)} ({dev.flag}), of which "
                f"{format_bytes(dev._held - sum(x._credit for x in dev.sessions))} is held by "
                f"{others} session{'s' if others != 1 else ''}; {mine}")

    def _hint(self, session: bool) -> str:
        flag = self.flag if session else self.device.flag
        return (f"free arrays you no longer need (del x), work in smaller pieces, "
                f"or ask the peer's operator to raise {flag}")


__all__ = ["DeviceMemory", "SessionMemory", "parse_size", "format_bytes", "default_limit", "footprint_for",
           "give_back_freed", "keep_freed_pages", "KEEP_FREED", "host_copy_bytes",
           "physical_memory", "HOST_FRACTION", "GPU_FRACTION"]
