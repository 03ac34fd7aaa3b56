"""Statistical functions: reductions and cumulative sums/products."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit
from ._device import check_dtype
from ._dtypes import DType, to_dtype

__all__ = ["cumulative_prod", "cumulative_sum", "max", "mean", "min", "prod", "std", "sum", "var"]


def normalize_axis(axis: int | tuple[int, ...] | None, ndim: int, name: str = "axis") -> tuple[int, ...]:
    """Axes as non-negative ints (all of them for None); ``AxisError`` (an IndexError and a ValueError)
    when out of range, TypeError when not ints, ValueError when repeated."""
    return V.axes(name, axis, ndim)


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


#: (shape, axis, keepdims, extra kwargs) -> (result shape, op kwargs): a reduction's plan, computed
#: once per combination (the kwargs dict is shared by the messages that use it; nothing mutates it).
_PLANS: dict[tuple[Any, ...], tuple[tuple[int, ...], dict[str, Any]]] = {}


def reduce_plan(x: RemoteArray, axis: Any, keepdims: bool,
                extra: tuple[tuple[str, Any], ...] = ()) -> tuple[tuple[int, ...], dict[str, Any]]:
    key: Any = (x._shape, axis, keepdims, extra)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable axis (a list): no caching
        plan = key = None
    if plan is None:
        keepdims = V.flag("keepdims", keepdims)
        axes = normalize_axis(axis, len(x._shape))
        kwargs: dict[str, Any] = {"axis": list(axes) if axis is not None else None, "keepdims": keepdims}
        kwargs.update(extra)
        plan = (reduced_shape(x._shape, axes, keepdims), kwargs)
        if key is not None:
            if len(_PLANS) > 4096:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _reduce(name: str, x: RemoteArray, axis: Any, keepdims: bool, dt: DType,
            extra: tuple[tuple[str, Any], ...] = ()) -> RemoteArray:
    shape, kwargs = reduce_plan(x, axis, keepdims, extra)
    return emit(name, [x], 0, kwargs, shape, dt)


def accumulate_dtype(x: RemoteArray, dtype: Any) -> DType:
    """The standard's result dtype of sum/prod/trace/cumulative_*: integers widen to 64 bits."""
    if dtype is not None:
        dt = to_dtype(dtype)
    else:
        k = x.dtype.kind
        dt = d.int64 if k == "i" else d.uint64 if k == "u" else x.dtype
    if dt is not x.dtype:
        check_dtype(x.device, dt)
    return dt


def _numeric(name: str, x: RemoteArray, allowed: frozenset[DType]) -> None:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"{name} does not accept {x.dtype} inputs")


def sum(x: RemoteArray, /, *, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("sum", x, d.NUMERIC)
    dt = accumulate_dtype(x, dtype)
    return _reduce("sum", x, axis, keepdims, dt, (("dtype", dt.name),))


def prod(x: RemoteArray, /, *, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("prod", x, d.NUMERIC)
    dt = accumulate_dtype(x, dtype)
    return _reduce("prod", x, axis, keepdims, dt, (("dtype", dt.name),))


def mean(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("mean", x, d.FLOAT)
    return _reduce("mean", x, axis, keepdims, x.dtype)


def min(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("min", x, d.REAL_NUMERIC)
    return _reduce("min", x, axis, keepdims, x.dtype)


def max(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("max", x, d.REAL_NUMERIC)
    return _reduce("max", x, axis, keepdims, x.dtype)


def std(x: RemoteArray, /, *, axis: Any = None, correction: int | float = 0.0,
        keepdims: bool = False) -> RemoteArray:
    _numeric("std", x, d.REAL_FLOAT)
    correction = V.real("correction", correction)
    return _reduce("std", x, axis, keepdims, x.dtype, (("correction", correction),))


def var(x: RemoteArray, /, *, axis: Any = None, correction: int | float = 0.0,
        keepdims: bool = False) -> RemoteArray:
    _numeric("var", x, d.REAL_FLOAT)
    correction = V.real("correction", correction)
    return _reduce("var", x, axis, keepdims, x.dtype, (("correction", correction),))


def _cumulative(name: str, x: RemoteArray, axis: int | None, dtype: Any, include_initial: bool) -> RemoteArray:
    _numeric(name, x, d.NUMERIC)
    if x.ndim == 0:
        raise ValueError(f"{name} needs an array of at least one dim")
    if axis is None:
        if x.ndim > 1:
            raise ValueError(f"{name} needs an axis for arrays of more than one dim")
        axis = 0
    a = normalize_axis(axis, x.ndim)[0]
    dt = accumulate_dtype(x, dtype)
    include_initial = V.flag("include_initial", include_initial)
    shape = tuple(n + 1 if i == a and include_initial else n for i, n in enumerate(x.shape))
    kw = {"axis": a, "dtype": dt.name, "include_initial": include_initial}
    return emit(name, [x], 0, kw, shape, dt)


def cumulative_sum(x: RemoteArray, /, *, axis: int | None = None, dtype: Any = None,
                   include_initial: bool = False) -> RemoteArray:
    return _cumulative("cumulative_sum", x, axis, dtype, include_initial)


def cumulative_prod(x: RemoteArray, /, *, axis: int | None = None, dtype: Any = None,
                    include_initial: bool = False) -> RemoteArray:
    return _cumulative("cumulative_prod", x, axis, dtype, include_initial)
