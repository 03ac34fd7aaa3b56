"""Runtime fixes for the generated ``iroh`` Python binding (uniffi).

Two defects of the binding shipped with ``iroh`` 1.2.0 matter to Ember:

1. **Slow copy.** ``_UniffiRustBufferBuilder.write`` copies outgoing bytes into
   the Rust buffer one byte at a time in a Python loop (~10 MB/s). uniffi 0.32
   replaced that loop with a ``memmove``. :func:`install_fast_copy` does the
   same, but only when the installed binding still has the byte loop: the
   check reads the method's source, it does not trust a version number. After
   patching, a self-test round-trips known bytes through a real Rust buffer and
   the original method is restored if anything differs.

   The byte-string converter is patched alongside so that the length prefix is
   the buffer's size in *bytes* (``nbytes``): the original used ``len(value)``,
   which is wrong for memoryviews of wider items.

2. **One global event loop.** Once ``uniffi_set_event_loop(loop)`` is called
   (required before registering router protocol handlers), *every* async call
   in the process creates its futures on that loop, even when called from a
   different running loop (for instance Ember's background client loop) -- and
   the call then fails or hangs. :func:`install_loop_fix` makes the binding
   prefer the caller's running loop and fall back to the global one only on
   threads with no running loop (Rust threads calling back into Python), which
   is the case the global exists for.

Both functions are idempotent and return whether the patch is active.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import threading
from typing import Any

__all__ = ["has_slow_copy", "install_fast_copy", "uninstall_fast_copy",
           "fast_copy_installed", "install_loop_fix", "install_all"]

_lock = threading.Lock()
_state: dict[str, Any] = {"fast": False, "orig_write": None, "orig_bytes_write": None,
                          "loop_fix": False}


def _ffi() -> Any:
    from iroh import iroh_ffi  # imported lazily: the module is heavy

    return iroh_ffi


def has_slow_copy(ffi: Any | None = None) -> bool:
    """True when the binding's buffer builder copies bytes in a Python loop."""
    ffi = ffi or _ffi()
    builder = getattr(ffi, "_UniffiRustBufferBuilder", None)
    write = getattr(builder, "write", None)
    if write is None:
        return False
    if getattr(write, "_ember_fast_copy", False):
        return False
    try:
        src = inspect.getsource(write)
    except (OSError, TypeError):
        return _measure_slow(ffi)
    return "memmove" not in src and "for " in src and "enumerate(" in src


def _measure_slow(ffi: Any) -> bool:
    """Fallback when no source is available: time a 64 KiB write."""
    import time

    builder = ffi._UniffiRustBufferBuilder()
    try:
        t = time.perf_counter()
        builder.write(b"\0" * 65536)
        return time.perf_counter() - t > 0.002  # a memmove takes microseconds
    finally:
        builder.discard()


def _byte_view(value: Any) -> memoryview:
    """A flat, C-contiguous, byte-format memoryview of ``value``."""
    mv = value if isinstance(value, memoryview) else memoryview(value)
    if mv.format in ("B", "b", "c") and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if mv.c_contiguous:
        return mv.cast("B")
    return memoryview(mv.tobytes())


def _fast_write(self: Any, value: Any) -> None:
    """Replacement for ``_UniffiRustBufferBuilder.write``: one memmove."""
    if isinstance(value, bytes):
        n = len(value)
        with self._reserve(n):
            if n:
                dst = ctypes.cast(self.rbuf.data, ctypes.c_void_p).value + self.rbuf.len
                ctypes.memmove(dst, value, n)
        return
    mv = _byte_view(value)
    n = mv.nbytes
    with self._reserve(n):
        if n:
            dst = ctypes.cast(self.rbuf.data, ctypes.c_void_p).value + self.rbuf.len
            if mv.readonly:
                src: Any = (ctypes.c_char * n).from_buffer_copy(mv)
            else:
                src = (ctypes.c_char * n).from_buffer(mv)
            ctypes.memmove(dst, src, n)


_fast_write._ember_fast_copy = True  # type: ignore[attr-defined]


def _bytes_write(value: Any, buf: Any) -> None:
    """Replacement for ``_UniffiFfiConverterBytes.write``: prefix = nbytes."""
    n = len(value) if isinstance(value, bytes) else memoryview(value).nbytes
    buf.write_i32(n)
    buf.write(value)


def _self_test(ffi: Any) -> bool:
    """Round-trip odd sizes and buffer kinds through a real Rust buffer."""
    payloads: list[Any] = [b"", b"x", bytes(range(256)) * 3 + b"abc",
                           bytearray(b"\x01\x02\x03" * 1001),
                           memoryview(bytes(range(200)))[7:150],
                           memoryview(bytearray(range(64))).cast("I")]
    for p in payloads:
        expect = bytes(memoryview(p).cast("B")) if isinstance(p, memoryview) else bytes(p)
        rbuf = ffi._UniffiFfiConverterBytes.lower(p)
        try:
            got = ffi._UniffiRustBufferStream.from_rust_buffer(rbuf)
            if got.read_i32() != len(expect) or got.read(len(expect)) != expect:
                return False
        finally:
            rbuf.free()
    return True


def install_fast_copy(force: bool = False) -> bool:
    """Install the memmove fast path if the binding has the slow copy.

    Returns True when the fast path is active after the call. ``force``
    installs even when the slow loop was not detected (tests only).
    ``EMBER_IROH_FAST_COPY=0`` in the environment disables it (benchmarks).
    """
    if not force and os.environ.get("EMBER_IROH_FAST_COPY", "").strip() == "0":
        return False
    with _lock:
        if _state["fast"]:
            return True
        ffi = _ffi()
        builder = getattr(ffi, "_UniffiRustBufferBuilder", None)
        conv = getattr(ffi, "_UniffiFfiConverterBytes", None)
        needed = ("_reserve", "write")
        if builder is None or conv is None or not all(hasattr(builder, n) for n in needed):
            return False
        if not force and not has_slow_copy(ffi):
            return False
        _state["orig_write"] = builder.__dict__["write"]
        _state["orig_bytes_write"] = conv.__dict__["write"]
        builder.write = _fast_write
        conv.write = staticmethod(_bytes_write)
        try:
            ok = _self_test(ffi)
        except Exception:  # noqa: BLE001 - any surprise means "do not patch"
            ok = False
        if not ok:
            builder.write = _state["orig_write"]
            conv.write = _state["orig_bytes_write"]
            return False
        _state["fast"] = True
        return True


def uninstall_fast_copy() -> None:
    """Restore the binding's original copy (benchmarks use this)."""
    with _lock:
        if not _state["fast"]:
            return
        ffi = _ffi()
        ffi._UniffiRustBufferBuilder.write = _state["orig_write"]
        ffi._UniffiFfiConverterBytes.write = _state["orig_bytes_write"]
        _state["fast"] = False


def fast_copy_installed() -> bool:
    """Whether Ember's memmove fast path is active."""
    return bool(_state["fast"])


def install_loop_fix() -> bool:
    """Make the binding prefer the caller's running event loop.

    Without this, ``uniffi_set_event_loop`` (needed for router protocol
    handlers) pins every async call of the process to one loop.
    """
    with _lock:
        if _state["loop_fix"]:
            return True
        ffi = _ffi()
        if not hasattr(ffi, "_uniffi_get_event_loop") or not hasattr(
                ffi, "_UNIFFI_GLOBAL_EVENT_LOOP"):
            return False

        def _get_loop() -> asyncio.AbstractEventLoop:
            try:
                return asyncio.get_running_loop()
            except RuntimeError:
                pass
            loop = ffi._UNIFFI_GLOBAL_EVENT_LOOP
            if loop is not None:
                return loop
            return asyncio.get_running_loop()  # raises, like the original

        _get_loop._ember_loop_fix = True  # type: ignore[attr-defined]
        ffi._uniffi_get_event_loop = _get_loop
        _state["loop_fix"] = True
        return True


def install_all() -> dict[str, bool]:
    """Install every fix; returns which ones are active."""
    from .iroh_finalizers import install as install_finalizers
    return {"fast_copy": install_fast_copy(), "loop_fix": install_loop_fix(),
            "finalizers": install_finalizers() >= 0}
