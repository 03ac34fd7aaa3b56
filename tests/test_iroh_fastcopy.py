"""The memmove fast path for the iroh binding's outgoing copies."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from iroh import iroh_ffi

from ember.transport import iroh as T
from ember.transport import iroh_fastcopy as fc


def lowered(value: Any) -> bytes:
    """What the binding hands to Rust for a ``bytes`` argument."""
    rbuf = iroh_ffi._UniffiFfiConverterBytes.lower(value)
    try:
        s = iroh_ffi._UniffiRustBufferStream.from_rust_buffer(rbuf)
        n = s.read_i32()
        data = s.read(n)
        assert s.remaining() == 0
        return data
    finally:
        rbuf.free()


@pytest.fixture(autouse=True)
def _installed() -> None:
    fc.install_all()


def test_detection_and_install() -> None:
    assert fc.fast_copy_installed() or not fc.has_slow_copy()
    if fc.fast_copy_installed():
        assert not fc.has_slow_copy()  # the patched method is not "slow"
        fc.uninstall_fast_copy()
        assert fc.has_slow_copy() and not fc.fast_copy_installed()
        assert fc.install_fast_copy() and fc.fast_copy_installed()
    assert fc.install_fast_copy() == fc.fast_copy_installed()  # idempotent


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 15, 16, 17, 255, 4095, 4097, 65537, (1 << 20) + 3])
def test_odd_sizes_round_trip(n: int) -> None:
    data = os.urandom(n)
    assert lowered(data) == data
    assert lowered(bytearray(data)) == data
    assert lowered(memoryview(data)) == data


def test_buffer_kinds_round_trip() -> None:
    base = bytes(range(256)) * 41
    mv = memoryview(base)
    assert lowered(mv[3:1000]) == base[3:1000]                 # read-only slice
    assert lowered(mv[::3]) == base[::3]                       # non-contiguous
    assert lowered(memoryview(bytearray(base))[5:9]) == base[5:9]
    assert lowered(memoryview(b"")) == b""
    assert lowered(bytearray()) == b""
    arr = np.arange(1001, dtype=np.float64)
    assert lowered(memoryview(arr)) == arr.tobytes()          # wide items: length in bytes
    assert lowered(arr) == arr.tobytes()
    m2 = np.arange(24, dtype=np.int32).reshape(4, 6)
    assert lowered(memoryview(m2)) == m2.tobytes()             # 2-D, C-contiguous
    assert lowered(m2[:, ::2]) == np.ascontiguousarray(m2[:, ::2]).tobytes()  # strided


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 50), st.integers(0, 50))
def test_random_slices_round_trip(data: bytes, a: int, b: int) -> None:
    cut = memoryview(data)[a:len(data) - b] if a < len(data) - b else memoryview(b"")
    assert lowered(cut) == bytes(cut)
    assert lowered(data) == data


def test_loop_fix_prefers_the_running_loop() -> None:
    assert fc.install_loop_fix()
    other = asyncio.new_event_loop()
    try:
        iroh_ffi.uniffi_set_event_loop(other)

        async def check() -> Any:
            return iroh_ffi._uniffi_get_event_loop() is asyncio.get_running_loop()
        assert asyncio.run(check())
        assert iroh_ffi._uniffi_get_event_loop() is other  # no running loop: the global one
    finally:
        iroh_ffi.uniffi_set_event_loop(None)  # type: ignore[arg-type]
        other.close()


@pytest.mark.timeout(60)
def test_frames_over_iroh_with_odd_buffers() -> None:
    T.configure_client(offline=True, bind=["127.0.0.1:0", "[::1]:0"])

    async def echo(c: Any) -> None:
        while (f := await c.recv()) is not None:
            await c.send(f)

    async def go() -> None:
        lst = T.IrohListener(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
        await lst.start(echo)
        try:
            c = await T.dial(lst.ticket)
            big = np.random.default_rng(0).standard_normal(600_001)  # 4.8 MB: more than one write chunk
            cases: list[Any] = [b"", memoryview(b""), bytearray(b"\x00"), memoryview(big),
                                memoryview(big.tobytes())[1:-1], memoryview(big)[::2], os.urandom(4 * 2**20 + 1)]
            for frame in cases:
                expect = memoryview(frame).tobytes()
                await c.send(frame)
                assert await c.recv() == expect
            await c.close()
        finally:
            await lst.stop()
            await T.close_client()
    asyncio.run(asyncio.wait_for(go(), 50))
