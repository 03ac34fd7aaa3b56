"""Creation functions: data made on the peer where possible, uploaded otherwise."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from . import _dtypes as d
from ._array import RemoteArray, emit
from ._device import check_dtype, resolve
from ._dtypes import DType, to_dtype

__all__ = ["asarray", "zeros", "ones", "empty", "full", "arange", "linspace", "eye",
           "zeros_like", "ones_like", "empty_like", "full_like"]


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    s = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    if any(n < 0 for n in s):
        raise ValueError(f"negative dimension in shape {s}")
    return s


def _scalar_dtype(v: Any) -> DType:
    if isinstance(v, bool):
        return d.bool
    if isinstance(v, int):
        return d.DEFAULT_INT
    if isinstance(v, float):
        return d.DEFAULT_FLOAT
    if isinstance(v, complex):
        return d.DEFAULT_COMPLEX
    raise TypeError(f"expected a Python scalar, got {type(v).__name__}")


def _create(name: str, device: Any, kwargs: dict[str, Any], shape: tuple[int, ...], dt: DType,
            args: Sequence[Any] = ()) -> RemoteArray:
    """Record a creation op; ``args`` are positional scalars (e.g. arange's start)."""
    dev = resolve(device)
    check_dtype(dev, dt)
    kwargs["dtype"] = dt.name
    s = dev.session
    return emit(name, list(args), (1 << len(args)) - 1, kwargs, shape, dt, session=s, dev=dev)


def upload(arr: np.ndarray, dev: Any) -> RemoteArray:
    dt = d.to_dtype(arr.dtype)
    check_dtype(dev, dt)
    s = dev.session
    return RemoteArray(s.upload(arr), tuple(arr.shape), dt, dev, s)


def asarray(obj: Any, /, *, dtype: Any = None, device: Any = None, copy: bool | None = None) -> RemoteArray:
    if isinstance(obj, RemoteArray):
        from ._data_types import astype
        out = obj if device is None or device is obj.device else obj.to_device(device)
        if dtype is not None and to_dtype(dtype) is not out.dtype:
            if copy is False:
                raise ValueError("asarray(copy=False) cannot change the dtype")
            return astype(out, dtype)
        return emit("copy", [out], 0, None, out.shape, out.dtype) if copy and out is obj else out
    if copy is False:
        raise ValueError("asarray(copy=False) cannot avoid a copy: the data must be sent to the peer")
    dev = resolve(device)
    if hasattr(obj, "__array_namespace__") or hasattr(obj, "__dlpack__") and not isinstance(obj, np.ndarray):
        obj = np.from_dlpack(obj) if hasattr(obj, "__dlpack__") else np.asarray(obj)
    arr = np.asarray(obj, dtype=to_dtype(dtype).np if dtype is not None else None)
    if dtype is None and arr.dtype.name not in d.BY_NAME:
        raise TypeError(f"asarray: NumPy dtype {arr.dtype} is not an Array API dtype; pass dtype=")
    return upload(arr, dev)


def zeros(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("zeros", device, {"shape": list(s)}, s, to_dtype(dtype) if dtype else d.DEFAULT_FLOAT)


def ones(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("ones", device, {"shape": list(s)}, s, to_dtype(dtype) if dtype else d.DEFAULT_FLOAT)


def empty(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("empty", device, {"shape": list(s)}, s, to_dtype(dtype) if dtype else d.DEFAULT_FLOAT)


def full(shape: int | Sequence[int], fill_value: bool | int | float | complex, *, dtype: Any = None,
         device: Any = None) -> RemoteArray:
    s = _shape(shape)
    dt = to_dtype(dtype) if dtype else _scalar_dtype(fill_value)
    return _create("full", device, {"shape": list(s), "fill_value": fill_value}, s, dt)


def arange(start: int | float, /, stop: int | float | None = None, step: int | float = 1, *,
           dtype: Any = None, device: Any = None) -> RemoteArray:
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise ValueError("arange step must not be zero")
    n = max(0, math.ceil((stop - start) / step))
    isfloat = any(isinstance(v, float) for v in (start, stop, step))
    dt = to_dtype(dtype) if dtype else (d.DEFAULT_FLOAT if isfloat else d.DEFAULT_INT)
    return _create("arange", device, {"stop": stop, "step": step}, (n,), dt, [start])


def linspace(start: int | float | complex, stop: int | float | complex, /, num: int, *, dtype: Any = None,
             device: Any = None, endpoint: bool = True) -> RemoteArray:
    if num < 0:
        raise ValueError("linspace num must be >= 0")
    iscomplex = isinstance(start, complex) or isinstance(stop, complex)
    dt = to_dtype(dtype) if dtype else (d.DEFAULT_COMPLEX if iscomplex else d.DEFAULT_FLOAT)
    return _create("linspace", device, {"num": num, "endpoint": endpoint}, (num,), dt, [start, stop])


def eye(n_rows: int, n_cols: int | None = None, /, *, k: int = 0, dtype: Any = None,
        device: Any = None) -> RemoteArray:
    cols = n_rows if n_cols is None else n_cols
    return _create("eye", device, {"k": k}, (n_rows, cols), to_dtype(dtype) if dtype else d.DEFAULT_FLOAT,
                   [n_rows, cols])


def _like(name: str, x: RemoteArray, dtype: Any, device: Any, **kw: Any) -> RemoteArray:
    if device is not None and device is not x.device:
        return globals()[name.removesuffix("_like")](x.shape, dtype=dtype or x.dtype, device=device, **kw)
    dt = to_dtype(dtype) if dtype else x.dtype
    kw["dtype"] = dt.name
    return emit(name, [x], 0, kw, x.shape, dt)


def zeros_like(x: RemoteArray, /, *, dtype: Any = None, device: Any = None) -> RemoteArray:
    return _like("zeros_like", x, dtype, device)


def ones_like(x: RemoteArray, /, *, dtype: Any = None, device: Any = None) -> RemoteArray:
    return _like("ones_like", x, dtype, device)


def empty_like(x: RemoteArray, /, *, dtype: Any = None, device: Any = None) -> RemoteArray:
    return _like("empty_like", x, dtype, device)


def full_like(x: RemoteArray, /, fill_value: bool | int | float | complex, *, dtype: Any = None,
              device: Any = None) -> RemoteArray:
    return _like("full_like", x, dtype, device, fill_value=fill_value)
