"""The namespace as a whole: completeness, inspection, devices, dtype refusals, round trips, DLPack."""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.protocol import messages as m
from ember.server import Server
from ember.server.backends import BackendUnavailable, make_backend

xs = pytest.importorskip("array_api_strict")

STRICT_ONLY = {"ArrayAPIStrictFlags", "Device", "__version__", "get_array_api_strict_flags",
               "reset_array_api_strict_flags", "set_array_api_strict_flags", "isin"}


def test_every_name_of_the_standard() -> None:
    """Every function, constant and dtype of 2024.12, the linalg and fft extensions, every array member."""
    xs.set_array_api_strict_flags(api_version="2024.12")
    missing = [n for n in xs.__all__ if n not in STRICT_ONLY and not hasattr(xp, n)]
    assert not missing, missing
    assert not [n for n in xs.linalg.__all__ if not hasattr(xp.linalg, n)]
    assert not [n for n in xs.fft.__all__ if not hasattr(xp.fft, n)]
    members = {n for n in dir(type(xs.asarray(1))) if not n.startswith("_") or n.startswith("__") and n not in
               ("__annotations__", "__buffer__", "__class__", "__delattr__", "__dir__", "__doc__", "__format__",
                "__getattribute__", "__getstate__", "__init__", "__init_subclass__", "__module__", "__new__",
                "__reduce__", "__reduce_ex__", "__setattr__", "__sizeof__", "__slots__", "__str__",
                "__subclasshook__", "__weakref__", "__repr__", "__hash__")}
    assert not [n for n in members if not hasattr(xp.Array, n)]
    assert xp.__array_api_version__ == "2024.12"
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
    assert x.__array_namespace__(api_version="2024.12") is xp
    with pytest.raises(ValueError):
        x.__array_namespace__(api_version="1999.01")


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
                xp.asarray([a[0, 0, 0], a[1, 2, 3]])]
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


def test_dlpack_through_host(two_peers: tuple[ember.Device, Any]) -> None:
    dev = two_peers[0]
    host = np.arange(6.0).reshape(2, 3)
    x = xp.asarray(host, device=dev)
    assert x.__dlpack_device__() == (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(x), host)
    with pytest.raises(BufferError):
        x.__dlpack__(copy=False)
    y = xp.from_dlpack(host, device=dev)
    assert isinstance(y, xp.Array) and y.device is dev
    np.testing.assert_array_equal(y.to_numpy(), host)
    assert xp.from_dlpack(x) is x
    with pytest.raises(BufferError):
        xp.from_dlpack(host, copy=False)
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(torch.from_dlpack(x).numpy(), host)
    np.testing.assert_array_equal(xp.from_dlpack(torch.arange(3.0), device=dev).to_numpy(), [0.0, 1.0, 2.0])


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
