"""The ``fft`` extension of the Array API standard (``xp.fft``); ops travel as ``fft.<name>``."""

from __future__ import annotations

from typing import Any, Sequence

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit, real_dtype
from ._device import check_dtype, resolve
from ._statistical import normalize_axis

__all__ = ["fft", "ifft", "fftn", "ifftn", "rfft", "irfft", "rfftn", "irfftn", "hfft", "ihfft", "fftfreq",
           "rfftfreq", "fftshift", "ifftshift"]

_NORMS = ("backward", "ortho", "forward")
_C = {d.float32: d.complex64, d.float64: d.complex128}


def _arr(name: str, x: Any, allowed: frozenset[d.DType], norm: str = "backward") -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"fft.{name} expects an ember array, got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"fft.{name} does not accept {x.dtype} inputs")
    V.choice("norm", norm, _NORMS)
    if x.ndim == 0:
        raise ValueError(f"fft.{name} needs an array of at least one dim")
    return x


def _one(name: str, x: RemoteArray, n: int | None, axis: int, norm: str, out_len: int,
         dt: d.DType) -> RemoteArray:
    if out_len < 1:
        raise ValueError(f"fft.{name}: invalid number of points {out_len}")
    a = normalize_axis(axis, x.ndim)[0]
    shape = x.shape[:a] + (out_len,) + x.shape[a + 1:]
    V.fits("fft." + name, shape, dt, x._session)
    return emit("fft." + name, [x], 0, {"n": n, "axis": a, "norm": norm}, shape, dt)


def _len(x: RemoteArray, axis: int) -> int:
    return x.shape[normalize_axis(V.integer("axis", axis), x.ndim)[0]]


def _n(n: Any) -> int | None:
    return V.optional_integer("n", n, lo=1)


def fft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("fft", x, d.COMPLEX, norm)
    n = _n(n)
    return _one("fft", x, n, axis, norm, n or _len(x, axis), x.dtype)


def ifft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("ifft", x, d.COMPLEX, norm)
    n = _n(n)
    return _one("ifft", x, n, axis, norm, n or _len(x, axis), x.dtype)


def rfft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("rfft", x, d.REAL_FLOAT, norm)
    n = _n(n)
    return _one("rfft", x, n, axis, norm, (n or _len(x, axis)) // 2 + 1, _C[x.dtype])


def irfft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("irfft", x, d.COMPLEX, norm)
    n = _n(n)
    return _one("irfft", x, n, axis, norm, n or 2 * (_len(x, axis) - 1), real_dtype(x.dtype))


def hfft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("hfft", x, d.COMPLEX, norm)
    n = _n(n)
    return _one("hfft", x, n, axis, norm, n or 2 * (_len(x, axis) - 1), real_dtype(x.dtype))


def ihfft(x: RemoteArray, /, *, n: int | None = None, axis: int = -1, norm: str = "backward") -> RemoteArray:
    _arr("ihfft", x, d.REAL_FLOAT, norm)
    n = _n(n)
    return _one("ihfft", x, n, axis, norm, (n or _len(x, axis)) // 2 + 1, _C[x.dtype])


def _axes_s(x: RemoteArray, s: Sequence[int] | None, axes: Sequence[int] | None) -> tuple[list[int], list[int]]:
    """NumPy's rule: axes default to the last len(s) axes (all axes without s); s to their sizes."""
    if s is not None:
        s = V.integers("s", s, limit=V.MAX_DIMS)
        if axes is None and len(s) > x.ndim:
            raise ValueError(f"fftn: s has {len(s)} sizes for an array of {x.ndim} dims")
    if axes is None:
        ax = list(range(x.ndim - len(s), x.ndim)) if s is not None else list(range(x.ndim))
    else:
        ax = list(normalize_axis(V.integers("axes", axes, limit=V.MAX_DIMS), x.ndim, "axes"))
    sizes = [x.shape[a] for a in ax] if s is None else list(s)
    if len(sizes) != len(ax):
        raise ValueError("fftn: s and axes need the same length")
    if any(v < 1 for v in sizes):
        raise ValueError(f"fftn: invalid sizes {sizes}")
    return ax, sizes


def _many(name: str, x: RemoteArray, s: Any, axes: Any, norm: str, dt: d.DType, last: Any = None) -> RemoteArray:
    ax, sizes = _axes_s(x, s, axes)
    shape = list(x.shape)
    for a, v in zip(ax, sizes):
        shape[a] = v
    if last is not None and ax:
        shape[ax[-1]] = last(sizes[-1], s is not None, x.shape[ax[-1]])
        if shape[ax[-1]] < 1:
            raise ValueError(f"fft.{name}: invalid number of points {shape[ax[-1]]}")
    kw = {"s": None if s is None else sizes, "axes": ax, "norm": norm}
    V.fits("fft." + name, tuple(shape), dt, x._session)
    return emit("fft." + name, [x], 0, kw, tuple(shape), dt)


def fftn(x: RemoteArray, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
         norm: str = "backward") -> RemoteArray:
    return _many("fftn", _arr("fftn", x, d.COMPLEX, norm), s, axes, norm, x.dtype)


def ifftn(x: RemoteArray, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
          norm: str = "backward") -> RemoteArray:
    return _many("ifftn", _arr("ifftn", x, d.COMPLEX, norm), s, axes, norm, x.dtype)


def rfftn(x: RemoteArray, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
          norm: str = "backward") -> RemoteArray:
    _arr("rfftn", x, d.REAL_FLOAT, norm)
    return _many("rfftn", x, s, axes, norm, _C[x.dtype], lambda v, given, m: v // 2 + 1)


def irfftn(x: RemoteArray, /, *, s: Sequence[int] | None = None, axes: Sequence[int] | None = None,
           norm: str = "backward") -> RemoteArray:
    _arr("irfftn", x, d.COMPLEX, norm)
    return _many("irfftn", x, s, axes, norm, real_dtype(x.dtype), lambda v, given, m: v if given else 2 * (m - 1))


def _freq(name: str, n: int, dspace: float, dtype: Any, device: Any, length: int) -> RemoteArray:
    n = V.integer("n", n, lo=1)
    dspace = V.real("d", dspace)
    dev = resolve(device)
    dt = d.DEFAULT_FLOAT if dtype is None else d.to_dtype(dtype)
    if dt not in d.REAL_FLOAT:
        raise TypeError(f"fft.{name}: dtype must be a real floating-point dtype, got {dt}")
    check_dtype(dev, dt)
    V.fits("fft." + name, (length,), dt, dev.session)
    return emit("fft." + name, [n], 1, {"d": dspace, "dtype": dt.name}, (length,), dt, session=dev.session, dev=dev)


def fftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None) -> RemoteArray:
    return _freq("fftfreq", n, d, dtype, device, n)


def rfftfreq(n: int, /, *, d: float = 1.0, dtype: Any = None, device: Any = None) -> RemoteArray:
    return _freq("rfftfreq", n, d, dtype, device, n // 2 + 1)


def _shift(name: str, x: RemoteArray, axes: int | Sequence[int] | None) -> RemoteArray:
    _arr(name, x, d.FLOAT)
    wire = None if axes is None else list(normalize_axis(axes, x.ndim, "axes"))
    return emit("fft." + name, [x], 0, {"axes": wire}, x.shape, x.dtype)


def fftshift(x: RemoteArray, /, *, axes: int | Sequence[int] | None = None) -> RemoteArray:
    return _shift("fftshift", x, axes)


def ifftshift(x: RemoteArray, /, *, axes: int | Sequence[int] | None = None) -> RemoteArray:
    return _shift("ifftshift", x, axes)
