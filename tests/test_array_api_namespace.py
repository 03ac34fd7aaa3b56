"""The namespace as a whole: completeness, inspection, devices, dtype refusals, round trips, DLPack."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.array_api._array import DLDeviceType
from ember.protocol import messages as m
from ember.server import Server
from ember.server.execute.backends import BackendUnavailable, make_backend

xs = pytest.importorskip("array_api_strict")

STRICT_ONLY = {"ArrayAPIStrictFlags", "Device", "__version__", "get_array_api_strict_flags",
               "reset_array_api_strict_flags", "set_array_api_strict_flags"}
ADDED_2025 = {"isin", "broadcast_shapes"}
ADDED_2025_LINALG = {"eig", "eigvals"}


def test_every_name_of_the_standard() -> None:
    """Every function, constant and dtype of 2025.12, the linalg and fft extensions, every array member;
    the 2024.12 namespace has 2024.12's names and not those added since."""
    xs.set_array_api_strict_flags(api_version="2025.12")
    missing = [n for n in xs.__all__ if n not in STRICT_ONLY and not hasattr(xp, n)]
    assert not missing, missing
    linalg = set(xs.linalg.__all__) | ADDED_2025_LINALG  # (array-api-strict 2.6 leaves eig out of __all__)
    assert all(callable(getattr(xs.linalg, n)) for n in linalg)
    assert not [n for n in linalg if not hasattr(xp.linalg, n)]
    assert not [n for n in xs.fft.__all__ if not hasattr(xp.fft, n)]
    assert ADDED_2025 <= set(xp.__all__) and ADDED_2025_LINALG <= set(xp.linalg.__all__)
    v = xp.ones(1).__array_namespace__(api_version="2024.12")
    assert v.__array_api_version__ == "2024.12" and v is not xp
    assert not [n for n in xs.__all__ if n not in STRICT_ONLY | ADDED_2025 and not hasattr(v, n)]
    assert not [n for n in ADDED_2025 if hasattr(v, n)] and not [n for n in ADDED_2025_LINALG if hasattr(v.linalg, n)]
    assert v.linalg.svd is xp.linalg.svd and v.fft is xp.fft and v.sum is xp.sum
    members = {n for n in dir(type(xs.asarray(1))) if not n.startswith("_") or n.startswith("__") and n not in
               ("__annotations__", "__buffer__", "__class__", "__delattr__", "__dir__", "__doc__", "__format__",
                "__getattribute__", "__getstate__", "__init__", "__init_subclass__", "__module__", "__new__",
                "__reduce__", "__reduce_ex__", "__setattr__", "__sizeof__", "__slots__", "__str__",
                "__subclasshook__", "__weakref__", "__repr__", "__hash__")}
    assert not [n for n in members if not hasattr(xp.Array, n)]
    assert xp.__array_api_version__ == "2025.12"
    assert (xp.e, xp.pi, xp.newaxis) == (np.e, np.pi, None) and np.isinf(xp.inf) and np.isnan(xp.nan)


@pytest.fixture(scope="module")
def two_peers() -> Iterator[tuple[ember.Device, ember.Device | None]]:
    """A NumPy device, and a torch:cpu device where torch is installed (one peer hosting both)."""
    try:
        import torch  # noqa: F401
        specs = ["cpu", "torch:cpu"]
    except ImportError:
        specs = ["cpu"]
    srv = Server(specs)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    devs = ember.devices(srv.addresses[0])
    yield devs[0], (devs[1] if len(devs) > 1 else None)
    for d in devs:
        d.close()
    srv.close()


def test_namespace_info(two_peers: tuple[ember.Device, Any]) -> None:
    np_dev, torch_dev = two_peers
    info = xp.__array_namespace_info__()
    caps = info.capabilities()
    assert caps["boolean indexing"] is True and caps["data-dependent shapes"] is True
    assert caps["max dimensions"] == 64
    assert isinstance(info.default_device(), ember.Device)
    assert info.default_dtypes() == {"real floating": xp.float64, "complex floating": xp.complex128,
                                     "integral": xp.int64, "indexing": xp.int64}
    assert set(info.dtypes(device=np_dev)) == {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                                "uint32", "uint64", "float32", "float64", "complex64", "complex128"}
    assert info.dtypes(device=np_dev, kind="real floating") == {"float32": xp.float32, "float64": xp.float64}
    assert set(info.dtypes(device=np_dev, kind=("bool", "complex floating"))) == {"bool", "complex64", "complex128"}
    with pytest.raises(ValueError):
        info.dtypes(kind="floats")
    xp.zeros(1, device=np_dev)
    assert np_dev in info.devices() and info.default_device() in info.devices()
    if torch_dev is not None:
        xp.zeros(1, device=torch_dev)
        assert torch_dev in info.devices()
        assert "uint32" not in info.dtypes(device=torch_dev)
        assert np_dev.info["backend"] == "numpy" and torch_dev.info["backend"] == "torch"


def test_array_api_compat_sees_ember(two_peers: tuple[ember.Device, Any]) -> None:
    import array_api_compat as compat
    dev = two_peers[0]
    x = xp.ones((2, 3), device=dev)
    assert compat.is_array_api_obj(x)
    assert compat.array_namespace(x) is xp
    assert compat.array_namespace(x, xp.zeros(2, device=dev)) is xp
    assert compat.device(x) is dev and x.device is dev
    assert compat.size(x) == 6
    assert compat.to_device(x, dev) is x
    assert x.__array_namespace__() is xp and x.__array_namespace__(api_version="2025.12") is xp
    assert x.__array_namespace__(api_version="2024.12").__array_api_version__ == "2024.12"
    assert x.__array_namespace__(api_version="2023.12") is x.__array_namespace__(api_version="2024.12")
    with pytest.raises(ValueError, match="2025.12"):
        x.__array_namespace__(api_version="1999.01")
    with pytest.raises(TypeError):
        x.__array_namespace__(api_version=2025.12)


def test_missing_dtype_refused_before_sending(two_peers: tuple[ember.Device, Any]) -> None:
    torch_dev = two_peers[1]
    if torch_dev is None:
        pytest.skip("torch is not installed")
    s = torch_dev.session
    x = xp.ones(3, dtype=xp.uint8, device=torch_dev)
    s.sync()
    sent = s.stats["ops"]
    for f in (lambda: xp.asarray(np.zeros(3, np.uint32), device=torch_dev),
              lambda: xp.zeros(3, dtype=xp.uint16, device=torch_dev),
              lambda: xp.astype(x, xp.uint64),
              lambda: xp.sum(x),                          # the standard's uint8 sum is uint64
              lambda: xp.cumulative_sum(x),
              lambda: xp.full_like(x, 1, dtype=xp.uint32)):
        with pytest.raises(TypeError, match="has no uint"):
            f()
    s.sync()
    assert s.stats["ops"] == sent + 1  # only the sync itself went out
    assert xp.sum(x, dtype=xp.int64).to_numpy() == 3


class Requests:
    """Counts requests (READ, SHAPE, SYNC) a block sends: each is one round trip."""

    def __init__(self, dev: ember.Device) -> None:
        self.session = dev.session
        self.kinds: list[int] = []

    def __enter__(self) -> "Requests":
        orig = self.session.request

        def counting(kind: int, *a: Any, **k: Any) -> Any:
            self.kinds.append(kind)
            return orig(kind, *a, **k)

        self.session.request = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.session.request


def test_no_round_trip_for_shapes(two_peers: tuple[ember.Device, Any]) -> None:
    dev = two_peers[0]
    a = xp.asarray(np.arange(24.0).reshape(2, 3, 4), device=dev)
    m2 = xp.asarray(np.eye(3) + 0.5, device=dev)
    with Requests(dev) as r:
        outs = [xp.sum(a, axis=1), xp.mean(a, axis=(0, 2), keepdims=True), xp.reshape(a, (6, -1)),
                xp.permute_dims(a, (2, 0, 1)), xp.concat([a, a], axis=2), xp.stack([a, a], axis=-1),
                xp.tile(a, (2, 1, 1, 1)), xp.repeat(a, 3, axis=1), xp.roll(a, 2), xp.argmax(a, axis=2),
                xp.argsort(a), xp.cumulative_sum(a, axis=0, include_initial=True), xp.diff(a, n=2),
                xp.matmul(a, xp.ones((4, 5), device=dev)), xp.tensordot(a, a, axes=([1, 2], [1, 2])),
                xp.linalg.svd(m2)[1], xp.linalg.qr(a)[0], xp.linalg.inv(m2), xp.linalg.vector_norm(a, axis=(1, 2)),
                xp.fft.rfftn(a), xp.fft.irfft(xp.fft.fft(xp.astype(a, xp.complex128)), n=7), xp.fft.fftfreq(9, device=dev),
                a[1, ::-1, None, 1:3], a[xp.asarray([0, 1, 1], device=dev)], xp.take(a, xp.asarray([2, 0], device=dev),
                                                                                  axis=2),
                xp.broadcast_to(a[0], (5, 3, 4)), xp.meshgrid(a[0, 0], a[0, :, 0])[1], xp.unstack(a, axis=1)[2],
                xp.searchsorted(xp.arange(5.0, device=dev), a), xp.count_nonzero(a, axis=0), xp.clip(a, 1.0, 3.0),
                xp.asarray([a[0, 0, 0], a[1, 2, 3]]),
                # 2025.12
                xp.isin(a, xp.asarray([1.0, 5.0], device=dev)), xp.isin(3, a), xp.expand_dims(a, axis=(0, -1, 2)),
                xp.permute_dims(a, (-1, 0, -2)), xp.searchsorted(xp.arange(5.0, device=dev), 2.5),
                xp.linalg.eig(m2)[1], xp.linalg.eigvals(m2), xp.broadcast_arrays(a, a[0])[1],
                xp.clip(a, 1, xp.full((4,), 2.0, device=dev))]
        assert xp.broadcast_shapes(a.shape, (5, 1, 1, 1)) == (5, 2, 3, 4) and xp.broadcast_shapes() == ()
        shapes = [o.shape for o in outs]
    assert r.kinds == [], "functions whose shape depends only on input shapes must not ask the peer"
    for o, s in zip(outs, shapes):
        assert o.to_numpy().shape == s


def test_data_dependent_shapes_cost_one_round_trip(two_peers: tuple[ember.Device, Any]) -> None:
    dev = two_peers[0]
    a = xp.asarray(np.array([[3, 1, 2], [1, 0, 3]]), device=dev)
    for f, n in ((lambda: xp.unique_all(a), 4), (lambda: xp.unique_counts(a), 4), (lambda: xp.unique_inverse(a), 4),
                 (lambda: xp.unique_values(a), 4), (lambda: xp.nonzero(a), 5), (lambda: a[a > 1], 3),
                 (lambda: xp.repeat(a, xp.asarray([1, 0, 2], device=dev), axis=1), 3)):
        with Requests(dev) as r:
            out = f()
        assert r.kinds == [m.SHAPE], r.kinds
        first = out[0] if isinstance(out, tuple) else out
        assert first.shape[-1] == n
        for o in out if isinstance(out, tuple) else (out,):
            assert o.to_numpy().shape == o.shape


class _DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _DLManagedTensorVersioned(ctypes.Structure):  # the head of the DLPack 1.x struct, up to its flags
    _fields_ = [("version", _DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64)]


def _versioned_flags(capsule: Any) -> tuple[tuple[int, int], int]:
    """(DLPack version, flags) of a ``dltensor_versioned`` capsule, read with ctypes."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLManagedTensorVersioned.from_address(get(capsule, b"dltensor_versioned"))
    return (t.version.major, t.version.minor), t.flags


def test_dlpack_through_host(two_peers: tuple[ember.Device, Any]) -> None:
    """The standard's protocol: a host copy (kDLCPU) that NumPy and PyTorch consume; versioned capsules
    flag the copy; what needs zero copy or another device raises BufferError."""
    dev = two_peers[0]
    host = np.arange(6.0).reshape(2, 3)
    x = xp.asarray(host, device=dev)
    assert x.__dlpack_device__() == (1, 0) and x.__dlpack_device__()[0] is DLDeviceType.kDLCPU
    for kw in ({}, {"copy": True}, {"device": "cpu"}, {"device": "cpu", "copy": None}):
        got = np.from_dlpack(x, **kw)
        np.testing.assert_array_equal(got, host)
        assert got.flags.writeable
    legacy = x.__dlpack__()
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)
    for mv in ((1, 0), (1, 9), (2, 0)):
        version, flags = _versioned_flags(x.__dlpack__(max_version=mv, copy=None, dl_device=(1, 0)))
        assert version[0] == 1 and flags & 0b10, "IS_COPIED must be set (and READ_ONLY not)"
        assert not flags & 0b01
    for kw in ({"copy": False}, {"dl_device": (2, 0)}, {"dl_device": (1, 1)}, {"stream": 1}):
        with pytest.raises(BufferError):
            x.__dlpack__(**kw)
    for kw in ({"copy": "yes"}, {"dl_device": "cpu"}, {"max_version": 1}):
        with pytest.raises(TypeError):
            x.__dlpack__(**kw)
    with pytest.raises(BufferError):
        np.from_dlpack(x, copy=False)
    y = xp.from_dlpack(host, device=dev)
    assert isinstance(y, xp.Array) and y.device is dev
    np.testing.assert_array_equal(y.to_numpy(), host)
    assert xp.from_dlpack(x) is x and xp.from_dlpack(x, copy=False) is x
    with pytest.raises(BufferError):
        xp.from_dlpack(host, copy=False)
    with pytest.raises(TypeError):
        xp.from_dlpack([1, 2])
    torch = pytest.importorskip("torch")
    t = torch.from_dlpack(x)
    np.testing.assert_array_equal(t.numpy(), host)
    t += 1  # a writable copy: the remote value is untouched
    np.testing.assert_array_equal(x.to_numpy(), host)
    np.testing.assert_array_equal(xp.from_dlpack(torch.arange(3.0), device=dev).to_numpy(), [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(xp.from_dlpack(torch.arange(4)[::2], device=dev).to_numpy(), [0, 2])


def test_inplace_and_setitem_keep_identity(two_peers: tuple[ember.Device, Any]) -> None:
    dev = two_peers[0]
    x = xp.asarray(np.zeros((2, 3), np.float32), device=dev)
    y = x
    x += 1
    x *= xp.full((3,), 2.0, dtype=xp.float32, device=dev)
    x[0, 1:] = 5.0
    x[x > 4] = xp.asarray(np.float32(7.0), device=dev)
    assert y is x and x.dtype == xp.float32
    np.testing.assert_array_equal(x.to_numpy(), [[2, 7, 7], [2, 2, 2]])
    with pytest.raises(TypeError):
        x += xp.ones(3, dtype=xp.float64, device=dev)  # would change the dtype
    with pytest.raises(TypeError):
        i = xp.ones(3, dtype=xp.int32, device=dev)
        i += 1.5
    with pytest.raises(ValueError):
        x += xp.ones((4, 2, 3), dtype=xp.float32, device=dev)  # would change the shape


def test_python_conversions(two_peers: tuple[ember.Device, Any]) -> None:
    dev = two_peers[0]
    assert bool(xp.asarray(True, device=dev)) is True
    assert int(xp.asarray(7, device=dev)) == 7 and float(xp.asarray(2.5, device=dev)) == 2.5
    assert complex(xp.asarray(1 + 2j, device=dev)) == 1 + 2j
    assert [10, 20, 30][xp.asarray(1, device=dev)] == 20  # __index__
    with pytest.raises(TypeError):
        float(xp.ones(3, device=dev))


def test_missing_backend_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendUnavailable) as e:
        make_backend("cupy:0" if "cupy" not in sys.modules else "nosuch")
    assert e.value.hint and ("ember[cupy]" in e.value.hint or "use cpu" in e.value.hint)
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(BackendUnavailable) as e:
        make_backend("torch:cpu")
    assert e.value.hint == "pip install 'ember[torch]'"


@pytest.mark.timeout(60)
def test_serve_reports_missing_backend() -> None:
    code = ("import sys; sys.modules['torch'] = None; from ember.cli.main import main; "
            "sys.exit(main(['serve', '--device', 'torch:cpu', '--websocket', '127.0.0.1:0']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 2
    assert "torch" in r.stderr and "pip install 'ember[torch]'" in r.stderr
