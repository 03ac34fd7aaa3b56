"""Creation functions: data made on the peer where possible, uploaded otherwise."""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..client.progress import choose
from ..errors import EmberError
from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit, emit_multi, real_dtype, same_device, scalar_array
from ._device import check_dtype, resolve
from ._dtypes import DType, to_dtype

__all__ = ["arange", "asarray", "empty", "empty_like", "eye", "from_dlpack", "full", "full_like", "linspace",
           "meshgrid", "ones", "ones_like", "tril", "triu", "zeros", "zeros_like"]

_PY_SCALARS = (bool, int, float, complex)


def _shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    return V.shape("shape", shape)


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


def _dtype_or(dtype: Any, default: DType) -> DType:
    return default if dtype is None else to_dtype(dtype)


def _create(name: str, device: Any, kwargs: dict[str, Any], shape: tuple[int, ...], dt: DType,
            args: list[Any] | None = None) -> RemoteArray:
    """Record a creation op; ``args`` are the standard's positional-only (scalar) parameters."""
    dev = resolve(device)
    check_dtype(dev, dt)
    V.fits(name, shape, dt, dev.session)
    kwargs["dtype"] = dt.name
    args = args or []
    return emit(name, args, (1 << len(args)) - 1, kwargs, shape, dt, session=dev.session, dev=dev)


def upload(arr: np.ndarray, dev: Any, progress: bool | None = None) -> RemoteArray:
    """Send host data to ``dev`` as a new array (``progress``: see ``ember.client.progress``)."""
    dt = d.to_dtype(arr.dtype)
    check_dtype(dev, dt)
    s = dev.session
    return RemoteArray(s.upload(arr, progress=choose(progress, arr.nbytes)), tuple(arr.shape), dt, dev, s)


def _host(obj: Any, dtype: DType | None) -> np.ndarray:
    """Host data for ``obj`` (NumPy array, buffer, DLPack producer, nested sequence or scalar)."""
    try:
        if not isinstance(obj, np.ndarray) and hasattr(obj, "__dlpack__") and not isinstance(obj, _PY_SCALARS):
            obj = _from_dlpack(obj)
        if isinstance(obj, (list, tuple)) and any(isinstance(v, RemoteArray) for v in obj):
            obj = [np.asarray(v) for v in obj]
        arr = np.asarray(obj, dtype=dtype.np if dtype is not None else None)
    except (TypeError, ValueError, OverflowError, BufferError, EmberError):
        raise
    except Exception as e:  # a foreign object whose conversion fails in its own way
        raise TypeError(f"asarray: cannot convert a {type(obj).__name__} to an array ({type(e).__name__}: {e})") \
            from None
    if arr.dtype.name not in d.BY_NAME:
        raise TypeError(f"asarray: NumPy dtype {arr.dtype} is not an Array API dtype; pass dtype=")
    return arr


def _from_dlpack(obj: Any) -> Any:
    """A DLPack producer's data on the host: asked for a host copy (DLPack 1.x ``dl_device``) where it
    lives elsewhere, else imported as it is, else through NumPy's ``__array__``."""
    for kw in ({"device": "cpu"}, {}):
        try:
            return np.from_dlpack(obj, **kw)
        except (BufferError, RuntimeError, TypeError, ValueError):  # an older producer, or a device tensor
            continue
    return np.asarray(obj)


def asarray(obj: Any, /, *, dtype: Any = None, device: Any = None, copy: bool | None = None,
            progress: bool | None = None) -> RemoteArray:
    """The standard's ``asarray``; ``progress`` (an Ember extension) shows a bar for a large upload:
    True always, False never, None as ``ember.set_progress`` says (default: 64 MiB and more, in a
    terminal or notebook)."""
    dt = None if dtype is None else to_dtype(dtype)
    if copy is not None:
        copy = V.flag("copy", copy)
    if isinstance(obj, RemoteArray):
        out = obj if device is None or device is obj.device else obj.to_device(device)
        if dt is not None and dt is not out.dtype:
            if copy is False:
                raise ValueError("asarray(copy=False) cannot change the dtype")
            from ._data_types import astype
            return astype(out, dt)
        if out is not obj and copy is False:
            raise ValueError("asarray(copy=False) cannot move an array to another device")
        return emit("copy", [out], 0, None, out.shape, out.dtype) if copy and out is obj else out
    if copy is False:
        raise ValueError("asarray(copy=False) cannot avoid a copy: the data must be sent to the peer")
    if isinstance(obj, (list, tuple)) and obj and all(type(v) is RemoteArray for v in obj) \
            and (device is None or all(v.device is device for v in obj)):
        from ._manipulation import stack  # a sequence of ember arrays stays on the peer
        out = stack(obj)
        return out if dt is None or dt is out.dtype else _astype(out, dt)
    return upload(_host(obj, dt), resolve(device), progress)


def _astype(x: RemoteArray, dt: DType) -> RemoteArray:
    from ._data_types import astype
    return astype(x, dt)


def from_dlpack(x: Any, /, *, device: Any = None, copy: bool | None = None) -> RemoteArray:
    """Import a DLPack producer (through a host copy) onto ``device``."""
    if copy is not None:
        copy = V.flag("copy", copy)
    if isinstance(x, RemoteArray):
        return asarray(x, device=device, copy=copy)
    if copy is False:
        raise BufferError("from_dlpack(copy=False): the data must be copied to the compute peer")
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"from_dlpack needs an object with __dlpack__, got {type(x).__name__}")
    return upload(_host(x, None), resolve(device))


def zeros(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("zeros", device, {"shape": list(s)}, s, _dtype_or(dtype, d.DEFAULT_FLOAT))


def ones(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("ones", device, {"shape": list(s)}, s, _dtype_or(dtype, d.DEFAULT_FLOAT))


def empty(shape: int | Sequence[int], *, dtype: Any = None, device: Any = None) -> RemoteArray:
    s = _shape(shape)
    return _create("empty", device, {"shape": list(s)}, s, _dtype_or(dtype, d.DEFAULT_FLOAT))


def full(shape: int | Sequence[int], fill_value: bool | int | float | complex, *, dtype: Any = None,
         device: Any = None) -> RemoteArray:
    s = _shape(shape)
    if isinstance(fill_value, RemoteArray):
        fill_value = fill_value._scalar(complex if fill_value.dtype.kind == "c" else
                                        float if fill_value.dtype.kind == "f" else
                                        bool if fill_value.dtype.kind == "b" else int)
    if isinstance(fill_value, np.generic) and fill_value.dtype.kind in "biufc":
        fill_value = fill_value.item()
    dt = _dtype_or(dtype, _scalar_dtype(fill_value))
    fill_value = V.fill("fill_value", fill_value, dt)
    if isinstance(fill_value, complex):  # no complex literals on the wire: zeros + a 0-d upload
        z = _create("full", device, {"shape": list(s), "fill_value": 0}, s, dt)
        return emit("add", [z, scalar_array(fill_value, dt, z)], 0, None, s, dt)
    return _create("full", device, {"shape": list(s), "fill_value": fill_value}, s, dt)


def arange(start: int | float, /, stop: int | float | None = None, step: int | float = 1, *,
           dtype: Any = None, device: Any = None) -> RemoteArray:
    if stop is None:
        start, stop = 0, start
    start, stop, step = V.real("start", start), V.real("stop", stop), V.real("step", step)
    if step == 0:
        raise ValueError("arange step must not be zero")
    isfloat = any(isinstance(x, float) for x in (start, stop, step))
    n = max(0, math.ceil((stop - start) / step)) if isfloat else len(range(start, stop, step))
    dt = _dtype_or(dtype, d.DEFAULT_FLOAT if isfloat else d.DEFAULT_INT)
    return _create("arange", device, {"num": n}, (n,), dt, [start, stop, step])


def linspace(start: int | float | complex, stop: int | float | complex, /, num: int, *, dtype: Any = None,
             device: Any = None, endpoint: bool = True) -> RemoteArray:
    num = V.integer("num", num, lo=0)
    endpoint = V.flag("endpoint", endpoint)
    iscomplex = isinstance(start, complex) or isinstance(stop, complex)
    if not iscomplex:
        start, stop = V.real("start", start), V.real("stop", stop)
    dt = _dtype_or(dtype, d.DEFAULT_COMPLEX if iscomplex else d.DEFAULT_FLOAT)
    if iscomplex and any(type(b) not in (int, float, complex) for b in (start, stop)):
        raise TypeError(f"linspace bounds must be numbers, got {type(start).__name__} and {type(stop).__name__}")
    if iscomplex and dt not in d.COMPLEX:
        raise TypeError(f"linspace with complex bounds needs a complex dtype, got {dt}")
    if iscomplex or dt in d.COMPLEX:  # no complex literals on the wire: start + (stop - start) * t
        t = _create("linspace", device, {"num": num, "endpoint": endpoint}, (num,), real_dtype(dt), [0.0, 1.0])
        a, b = complex(start), complex(stop)
        step = emit("multiply", [t, scalar_array(b - a, dt, t)], 0, None, (num,), dt)
        return emit("add", [step, scalar_array(a, dt, t)], 0, None, (num,), dt)
    return _create("linspace", device, {"num": num, "endpoint": endpoint}, (num,), dt, [start, stop])


def eye(n_rows: int, n_cols: int | None = None, /, *, k: int = 0, dtype: Any = None,
        device: Any = None) -> RemoteArray:
    n_rows = V.integer("n_rows", n_rows, lo=0)
    cols = n_rows if n_cols is None else V.integer("n_cols", n_cols, lo=0)
    k = V.clamp(V.integer("k", k), -n_rows, cols)  # a diagonal beyond the matrix: all zeros either way
    return _create("eye", device, {"k": k}, (n_rows, cols), _dtype_or(dtype, d.DEFAULT_FLOAT), [n_rows, cols])


def _like(name: str, x: RemoteArray, dtype: Any, device: Any, **kw: Any) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    dt = _dtype_or(dtype, x.dtype)
    if "fill_value" in kw:
        if isinstance(kw["fill_value"], np.generic) and kw["fill_value"].dtype.kind in "biufc":
            kw["fill_value"] = kw["fill_value"].item()
        kw["fill_value"] = V.fill("fill_value", kw["fill_value"], dt)
    if device is not None and device is not x.device:
        base = name.removesuffix("_like")
        args = (x.shape, kw["fill_value"]) if base == "full" else (x.shape,)
        return globals()[base](*args, dtype=dt, device=device)
    if dt is not x.dtype:
        check_dtype(x.device, dt)
    if isinstance(kw.get("fill_value"), complex):  # no complex literals on the wire
        z = emit(name, [x], 0, {"fill_value": 0, "dtype": dt.name}, x.shape, dt)
        return emit("add", [z, scalar_array(kw["fill_value"], dt, z)], 0, None, x.shape, dt)
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


def meshgrid(*arrays: RemoteArray, indexing: str = "xy") -> tuple[RemoteArray, ...]:
    V.choice("indexing", indexing, ("xy", "ij"))
    if not arrays:
        return ()
    if any(type(a) is not RemoteArray for a in arrays):
        raise TypeError("meshgrid expects ember arrays")
    same_device(*arrays)
    if len({a.dtype for a in arrays}) > 1:
        raise ValueError("meshgrid inputs must all have the same dtype")
    if any(a.ndim != 1 for a in arrays):
        raise ValueError("meshgrid inputs must be one-dimensional")
    shape = [a.shape[0] for a in arrays]
    if indexing == "xy" and len(shape) > 1:
        shape[0], shape[1] = shape[1], shape[0]
    spec = (tuple(shape), arrays[0].dtype)
    V.fits("meshgrid", spec[0], spec[1], arrays[0]._session)
    return emit_multi("meshgrid", list(arrays), {"indexing": indexing}, [spec] * len(arrays))


def _triangle(name: str, x: RemoteArray, k: int) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"{name} needs an array of at least 2 dims, got {x.ndim}")
    k = V.clamp(V.integer("k", k), -x.shape[-2], x.shape[-1])  # beyond the matrix: the same result
    return emit(name, [x], 0, {"k": k}, x.shape, x.dtype)


def tril(x: RemoteArray, /, *, k: int = 0) -> RemoteArray:
    return _triangle("tril", x, k)


def triu(x: RemoteArray, /, *, k: int = 0) -> RemoteArray:
    return _triangle("triu", x, k)
