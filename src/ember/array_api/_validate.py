"""Argument checks at the call: a value the wire or the standard cannot carry raises where the user
called the function, naming the argument, with the exception a NumPy user expects.

* ``TypeError``: a value of the wrong type (a string for an axis, an object for a shape);
* ``OverflowError``: an integer beyond 64 bits, or beyond the range of the array's dtype;
* ``ValueError``: a bad shape or value (a negative size, an unknown option, too many dims);
* ``AxisError`` (a subclass of NumPy's, so a ``ValueError`` and an ``IndexError``): an axis out of range;
* ``IndexError``: an index out of bounds (raised by the indexing code);
* ``LimitExceeded``: a result larger than the peer's ``max_tensor``.

Every function here is small and called at the top of the function that takes the argument;
none of them is on the hot path of elementwise ops (those check scalars in ``_dtypes``).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Iterable

import numpy as np

from ..errors import LimitExceeded
from ._dtypes import INT_RANGE, DType

I64_MIN, I64_MAX = -(1 << 63), (1 << 63) - 1
MAX_DIMS = 64
"""Dimensions of an array, at most (``capabilities()["max dimensions"]``, NumPy's limit)."""


class AxisError(np.exceptions.AxisError):
    """An axis out of range: NumPy's AxisError (so both a ValueError and an IndexError)."""


def _kind(v: Any) -> str:
    return type(v).__name__


def integer(name: str, v: Any, lo: int | None = None) -> int:
    """An integer argument (an int or anything with ``__index__``) that fits 64 bits, and is >= ``lo``."""
    if type(v) is not int:
        if isinstance(v, (float, complex, str, bytes)) or v is None:
            raise TypeError(f"{name} must be an integer, got {_kind(v)} {v!r:.60}")
        try:
            v = operator.index(v)
        except Exception:  # a foreign object: whatever its __index__ raises, it is not an integer
            raise TypeError(f"{name} must be an integer, got {_kind(v)}") from None
    if not I64_MIN <= v <= I64_MAX:
        raise OverflowError(f"{name}={v} does not fit in a 64-bit integer")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def optional_integer(name: str, v: Any, lo: int | None = None) -> int | None:
    return None if v is None else integer(name, v, lo)


def clamp(v: int, lo: int, hi: int) -> int:
    """An integer whose effect saturates (a diagonal offset, a slice bound) brought into [lo, hi]."""
    return lo if v < lo else hi if v > hi else v


def integers(name: str, v: Any, lo: int | None = None, limit: int = 1 << 20) -> tuple[int, ...]:
    """A sequence of integers (each checked as ``integer``), at most ``limit`` long."""
    if isinstance(v, (str, bytes, dict)) or not isinstance(v, Iterable):
        raise TypeError(f"{name} must be a sequence of integers, got {_kind(v)}")
    try:
        items = list(itertools.islice(v, limit + 1))
    except Exception:  # a foreign object whose iteration fails in its own way
        raise TypeError(f"{name} must be a sequence of integers, got {_kind(v)}") from None
    if len(items) > limit:
        raise ValueError(f"{name} has more than {limit} entries")
    return tuple(integer(f"{name}[{i}]", x, lo) for i, x in enumerate(items))


def shape(name: str, v: Any, *, unknown: bool = False) -> tuple[int, ...]:
    """A shape: an int or a sequence of at most 64 non-negative ints (``-1`` once where ``unknown``)."""
    if type(v) is tuple and len(v) <= MAX_DIMS:  # the common case, checked in one pass
        for n in v:
            if type(n) is not int or not (0 <= n <= I64_MAX or unknown and n == -1):
                break
        else:
            return v
    if type(v) is int or (not isinstance(v, Iterable) and hasattr(v, "__index__")):
        dims: tuple[int, ...] = (integer(name, v),)
    else:
        dims = integers(name, v, limit=MAX_DIMS)
    if len(dims) > MAX_DIMS:
        raise ValueError(f"{name} has {len(dims)} dims; at most {MAX_DIMS} are supported")
    for n in dims:
        if n < 0 and not (unknown and n == -1):
            raise ValueError(f"{name}: negative dimensions are not allowed, got {dims}")
    return dims


def fits(name: str, dims: tuple[int, ...], dt: DType, session: Any) -> None:
    """A result of these dims and dtype is not too big for any array, nor for the peer's ``max_tensor``."""
    n = math.prod(dims) * dt.itemsize
    if n <= 1 << 20:  # (the common case: no further arithmetic)
        return
    if n > I64_MAX:
        raise ValueError(f"{name}: an array of shape {dims} and dtype {dt.name} is too big ({n} bytes)")
    limit = session.welcome.get("limits", {}).get("max_tensor")
    if limit is not None and n > limit:
        raise LimitExceeded(f"{name}: an array of shape {dims} and dtype {dt.name} takes {n} bytes, more than the "
                            f"peer's max_tensor of {limit} bytes",
                            hint="work in smaller pieces, or raise the peer's max_tensor (Server(max_tensor=...))")


def axes(name: str, axis: Any, ndim: int) -> tuple[int, ...]:
    """Axes as non-negative ints (all of them for None): TypeError, AxisError, or ValueError when repeated."""
    if axis is None:
        return tuple(range(ndim))
    if type(axis) is int:
        items: tuple[int, ...] = (axis,)
    elif isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or a tuple of ints, got {axis!r}")
    elif not isinstance(axis, Iterable) and hasattr(axis, "__index__"):
        items = (integer(name, axis),)
    else:
        items = integers(name, axis, limit=ndim + 1)
    out = []
    for a in items:
        if isinstance(a, bool) or not -ndim <= a < ndim:
            raise AxisError(f"{name}={a} is out of bounds for an array of {ndim} dims")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: repeated axis in {axis!r}")
    return tuple(out)


def flag(name: str, v: Any) -> bool:
    """A boolean argument (``keepdims``, ``stable``...): a bool or a NumPy bool."""
    if type(v) is bool or isinstance(v, np.bool_):
        return bool(v)
    raise TypeError(f"{name} must be a bool, got {_kind(v)}")


def choice(name: str, v: Any, options: tuple[str, ...]) -> str:
    """One of a few strings (``side``, ``norm``, ``mode``...)."""
    if type(v) is not str:
        raise TypeError(f"{name} must be one of {options}, got {_kind(v)}")
    if v not in options:
        raise ValueError(f"{name} must be one of {options}, got {v!r:.60}")
    return v


def real(name: str, v: Any) -> int | float:
    """A real number for the wire: a float (NaN and infinities included) or an int within 64 bits."""
    if type(v) is float:
        return v
    if type(v) is int:
        return integer(name, v)
    if isinstance(v, (np.floating, np.integer)) and not isinstance(v, np.bool_):
        return v.item()
    raise TypeError(f"{name} must be a real number, got {_kind(v)}")


def literal(v: Any, dt: DType) -> Any:
    """The literal to send for a Python scalar ``v`` already accepted for an array of dtype ``dt``
    (``_dtypes.scalar_ok``): an int beyond 64 bits with a floating dtype travels as a float, as NumPy
    converts it (OverflowError beyond the float range)."""
    if type(v) is int and dt.kind in "fc" and not I64_MIN <= v <= I64_MAX:
        return float(v)
    return v


def fill(name: str, v: Any, dt: DType) -> Any:
    """A fill value (``full``, ``full_like``) for dtype ``dt``: an int must fit an integer dtype
    (OverflowError, as NumPy) and travels as a float for a floating one."""
    if type(v) is int:
        if dt.kind in "iu":
            lo, hi = INT_RANGE[dt]
            if not lo <= v <= hi:
                raise OverflowError(f"{name}={v} is out of range for {dt.name}")
        elif dt.kind in "fc":
            return literal(v, dt)
        elif not I64_MIN <= v <= I64_MAX:
            raise OverflowError(f"{name}={v} does not fit in a 64-bit integer")
    elif type(v) not in (bool, float, complex):
        raise TypeError(f"{name} must be a bool, int, float or complex, got {_kind(v)}")
    return v


def positive_real(name: str, v: Any) -> float:
    """A finite positive number (a timeout, a ttl)."""
    x = real(name, v)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{name} must be a finite positive number, got {v!r}")
    return float(x)
