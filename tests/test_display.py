"""repr/str/print of an ember array: its values like NumPy (one small read), dtype and device; errors shown."""

from __future__ import annotations

import numpy as np
import pytest

import ember
import ember.array_api as xp

CASES = [np.arange(5.0), np.arange(12, dtype=np.int32).reshape(3, 4), np.array([True, False]), np.float64(3.5),
         np.arange(2000.0), np.arange(7 * 200.0).reshape(7, 200), np.linspace(0, 1, 3 * 8 * 60).reshape(3, 8, 60),
         np.array([1 + 2j, 3.5 - 1j], dtype=np.complex64), np.zeros((0, 3))]


@pytest.mark.parametrize("a", CASES, ids=lambda a: f"{a.dtype}{a.shape}")
def test_repr_shows_values_like_numpy(dev, a):
    x = xp.asarray(a, device=dev)
    body = np.array2string(np.asarray(a), separator=", ", prefix="Array(")
    extra = f", shape={a.shape}" if a.size == 0 else ""
    assert repr(x) == f"Array({body}{extra}, dtype={a.dtype.name}, device={dev!r})"
    assert str(x) == repr(x)


def test_a_large_array_is_summarised_with_one_small_read(dev, capsys):
    a = np.random.default_rng(1).standard_normal((400, 500))
    x = xp.asarray(a, device=dev)
    before = dev.stats(peer=False)
    print(x)
    after = dev.stats(peer=False)
    out = capsys.readouterr().out
    assert out.rstrip("\n") == f"Array({np.array2string(a, separator=', ', prefix='Array(')}, dtype=float64, device={dev!r})"
    assert "..." in out
    assert after["reads"] - before["reads"] == 1
    assert after["bytes_received"] - before["bytes_received"] < 2000  # 8 x 8 float64, not 1.6 MB


def test_print_options_are_honoured(dev):
    x = xp.asarray(np.arange(100.0), device=dev)
    with np.printoptions(threshold=10, edgeitems=2, precision=1):
        assert repr(x).startswith("Array([ 0.,  1., ..., 98., 99.]")


def test_a_poisoned_array_shows_its_error_instead_of_raising(dev):
    a = xp.asarray(np.ones(3), device=dev)
    bad = ember.custom_op("no_such_op", a, outputs=[((3,), xp.float64)])
    r = repr(xp.exp(bad))
    assert r.startswith("Array(<RemoteExecutionError: op no_such_op((3,) float64) failed")
    assert r.endswith(f", shape=(3,), dtype=float64, device={dev!r})")
    assert repr(a).startswith("Array([1., 1., 1.]")  # the session is fine


def test_an_array_of_a_closed_session_shows_why():
    d = ember.connect("local")
    x = xp.asarray(np.ones(2), device=d)
    d.close()
    assert repr(x).startswith("Array(<SessionLost: ")
