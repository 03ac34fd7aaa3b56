"""``RemoteArray`` and the one path every op takes: infer shape/dtype here, record, return.

An op costs no round trip: ids are allocated on the client, the result's shape
and dtype are computed locally, and the op joins the session's pending batch.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ..client.progress import choose
from ..client.session import ClientSession
from ..protocol import messages as m
from . import _dtypes as d
from ._dtypes import DType
from ._validate import I64_MAX as _I64_MAX, I64_MIN as _I64_MIN, literal, positive_real

_OP = m.OP
_Scalar = (int, float, complex, bool)

#: ``api_version`` -> the namespace ``x.__array_namespace__(api_version=...)`` returns; ``ember.array_api``
#: fills it on import (None and "2025.12": itself; earlier versions: its 2024.12 form).
NAMESPACES: dict[str | None, Any] = {}


class DLDeviceType(enum.IntEnum):
    """DLPack device types (``__dlpack_device__``): an ember array exports host copies only."""

    kDLCPU = 1


class RemoteArray:
    """An array whose value lives on a compute peer. Shape and dtype are known locally."""

    __slots__ = ("_id", "_shape", "_dtype", "_dev", "_session", "__weakref__")
    __array_priority__ = 100

    def __init__(self, tid: int, shape: tuple[int, ...], dtype: DType, dev: Any, session: ClientSession) -> None:
        self._id = tid
        self._shape = shape
        self._dtype = dtype
        self._dev = dev
        self._session = session

    def __del__(self) -> None:
        try:
            self._session.release(self._id)
        except Exception:
            pass

    # ---- attributes --------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def device(self) -> Any:
        return self._dev

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        n = 1
        for s in self._shape:
            n *= s
        return n

    @property
    def T(self) -> "RemoteArray":
        if self.ndim != 2:
            raise ValueError(f"x.T needs a 2-D array, this one has {self.ndim} dims; use matrix_transpose")
        return emit("permute_dims", [self], 0, {"axes": [1, 0]}, self._shape[::-1], self._dtype)

    @property
    def mT(self) -> "RemoteArray":
        if self.ndim < 2:
            raise ValueError("x.mT needs at least 2 dims")
        return emit("matrix_transpose", [self], 0, None, self._shape[:-2] + self._shape[:-3:-1], self._dtype)

    def __array_namespace__(self, *, api_version: str | None = None) -> Any:
        if api_version is not None and type(api_version) is not str:
            raise TypeError(f"api_version must be a string such as '2025.12', got {type(api_version).__name__}")
        ns = NAMESPACES.get(api_version)
        if ns is None:
            raise ValueError(f"unsupported Array API version {api_version!r}; ember.array_api offers "
                             f"{', '.join(sorted(v for v in NAMESPACES if v))}")
        return ns

    # ---- reading -----------------------------------------------------------------
    def to_numpy(self, timeout: float | None = None, progress: bool | None = None) -> np.ndarray:
        """Fetch the value (blocks until computed, with a deadline). ``progress``: a bar for a large
        download (True always, False never, None as ``ember.set_progress`` says)."""
        if timeout is not None:
            timeout = positive_real("timeout", timeout)
        if progress is not None and type(progress) is not bool:
            raise TypeError(f"progress must be None or a bool, got {type(progress).__name__}")
        n = self._dtype.itemsize * self.size
        return self._session.read(self._id, timeout, progress=choose(progress, n), nbytes=n)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if dtype is not None:
            try:
                dtype = np.dtype(dtype)
            except Exception:  # whatever a foreign object raises: it is not a dtype
                raise TypeError(f"__array__: dtype must be a NumPy dtype, got {type(dtype).__name__}") from None
        if copy is not None and type(copy) is not bool:
            raise TypeError(f"__array__: copy must be None or a bool, got {type(copy).__name__}")
        a = self.to_numpy()
        if dtype is not None:
            a = a.astype(dtype, copy=False)
        return a.copy() if copy else a

    def _scalar(self, kind: type) -> Any:
        if self.size != 1:
            raise TypeError(f"only a one-element array converts to a Python {kind.__name__}; shape is {self._shape}")
        return kind(self.to_numpy().reshape(()).item())

    def __bool__(self) -> bool:
        return self._scalar(bool)

    def __int__(self) -> int:
        return self._scalar(int)

    def __float__(self) -> float:
        return self._scalar(float)

    def __complex__(self) -> complex:
        return self._scalar(complex)

    def __index__(self) -> int:
        if self._dtype.kind not in "iu" or self.ndim:
            raise TypeError("only 0-d integer arrays can be used as an index")
        return self._scalar(int)

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d array")
        return self._shape[0]

    def __iter__(self) -> Any:
        if not self._shape:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._shape[0]))

    # ---- DLPack: through a host copy ---------------------------------------------
    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """A DLPack capsule of a host copy (the value lives on a peer: there is no zero-copy path).

        The capsule is a DLPack 1.x ``DLManagedTensorVersioned`` with the IS_COPIED flag when the
        consumer passes ``max_version >= (1, 0)``, else a legacy 0.x capsule; its device is kDLCPU.
        """
        if copy is False:
            raise BufferError("an ember array lives on a compute peer; DLPack export needs a host copy "
                              "(copy=False cannot be honoured)")
        if copy is not None and type(copy) is not bool:
            raise TypeError(f"__dlpack__: copy must be None or a bool, got {type(copy).__name__}")
        if dl_device is not None:
            try:
                kind, index = dl_device
                ok = int(kind) == DLDeviceType.kDLCPU and int(index) == 0
            except (TypeError, ValueError):
                raise TypeError(f"__dlpack__: dl_device must be a (device type, index) pair, got {dl_device!r}") \
                    from None
            if not ok:
                raise BufferError(f"ember exports DLPack tensors on the host (kDLCPU, 0) only, not {dl_device}")
        if stream is not None:
            raise BufferError(f"__dlpack__: the export is a host (kDLCPU) tensor, which takes stream=None only, "
                              f"not {stream!r}")
        versioned = False
        if max_version is not None:
            try:
                versioned = int(max_version[0]) >= 1
            except (TypeError, ValueError, IndexError):
                raise TypeError(f"__dlpack__: max_version must be a (major, minor) pair, got {max_version!r}") \
                    from None
        host = self.to_numpy()  # read-only: the bytes as they arrived
        if versioned:  # NumPy copies (writable) and flags the capsule IS_COPIED
            return host.__dlpack__(max_version=(1, 0), copy=True)
        return np.array(host).__dlpack__()  # DLPack 0.x cannot signal read-only: a writable copy

    def __dlpack_device__(self) -> tuple[DLDeviceType, int]:
        return (DLDeviceType.kDLCPU, 0)  # the exported capsule is a host copy

    # ``x[key]`` / ``x[key] = v`` are installed by ``_indexing``, ``x.to_device`` by ``_transfer``,
    # ``repr(x)`` / ``str(x)`` (the values, read once) by ``_display``
    # (the families import this module, never the other way round: no import cycles).

    def _adopt(self, new: "RemoteArray") -> None:
        """Take over ``new``'s remote value in place (identity kept; the old value is released)."""
        if new._dtype is not self._dtype:
            raise TypeError(f"an in-place result of dtype {new._dtype} does not fit an array of {self._dtype}")
        if new._shape != self._shape:
            raise ValueError(f"an in-place result of shape {new._shape} does not fit an array of shape {self._shape}")
        self._id, new._id = new._id, self._id


# ---- the op path ----------------------------------------------------------------------

def _owner(args: list[Any]) -> RemoteArray:
    for x in args:
        if type(x) is RemoteArray:
            return x
    raise TypeError("an op needs at least one ember array argument")


def emit(name: str, args: list[Any], smask: int, kwargs: dict[str, Any] | None,
         shape: tuple[int, ...], dtype: DType, session: ClientSession | None = None, dev: Any = None) -> RemoteArray:
    """Record op ``name`` on the session of the first array in ``args``; return its output.

    ``smask`` marks (bit i) the positions of ``args`` that are literal scalars, not arrays.
    """
    if session is None:
        a = args[0] if not smask & 1 else _owner(args)
        session, dev = a._session, a._dev
    ids = [x._id if type(x) is RemoteArray else x for x in args]
    tid = next(session.ids)
    session.record([_OP, name, ids, smask, [tid], kwargs])
    return RemoteArray(tid, shape, dtype, dev, session)


def emit_multi(name: str, args: list[Any], kwargs: dict[str, Any] | None,
               specs: list[tuple[tuple[int, ...], DType]], smask: int = 0,
               session: ClientSession | None = None, dev: Any = None) -> tuple[RemoteArray, ...]:
    """Record an op with several outputs, one per ``(shape, dtype)`` in ``specs``."""
    if session is None:
        a = _owner(args)
        session, dev = a._session, a._dev
    ids = [x._id if type(x) is RemoteArray else x for x in args]
    tids = [next(session.ids) for _ in specs]
    session.record([_OP, name, ids, smask, tids, kwargs])
    return tuple(RemoteArray(t, s, dt, dev, session) for t, (s, dt) in zip(tids, specs))


def _ask_shape(out: RemoteArray) -> tuple[int, ...]:
    """The one round trip of a data-dependent op: the shape of its (first) output."""
    shape, _ = out._session.request(m.SHAPE, out._id)
    return tuple(shape)


def emit_dynamic(name: str, args: list[Any], kwargs: dict[str, Any] | None, dtype: DType,
                 smask: int = 0) -> RemoteArray:
    """An op whose output shape depends on data: one round trip to learn it."""
    out = emit(name, args, smask, kwargs, (), dtype)
    out._shape = _ask_shape(out)
    return out


def emit_dynamic_multi(name: str, args: list[Any], kwargs: dict[str, Any] | None,
                       specs: list[tuple[tuple[int, ...] | None, DType]]) -> tuple[RemoteArray, ...]:
    """Several outputs, all of length n (a data-dependent count) except those whose shape is given.

    One SHAPE request for the first output (which must be 1-d of length n) sizes every output
    whose spec shape is None: still one round trip.
    """
    outs = emit_multi(name, args, kwargs, [(s or (), dt) for s, dt in specs])
    n = _ask_shape(outs[0])
    for o, (s, _) in zip(outs, specs):
        if s is None:
            o._shape = n
    return outs


def scalar_array(value: Any, dt: DType, like: RemoteArray) -> RemoteArray:
    """A Python scalar the wire cannot carry as a literal (complex) as an uploaded 0-d array."""
    s = like._session
    return RemoteArray(s.upload(np.asarray(value, dtype=dt.np)), (), dt, like._dev, s)


def same_device(*arrays: RemoteArray) -> None:
    s = arrays[0]._session
    for a in arrays[1:]:
        if a._session is not s:
            raise ValueError(f"arrays are on different devices ({arrays[0]._dev!r} and {a._dev!r}); "
                             f"move one with to_device first")


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    if not shapes:
        return ()
    n = max(len(s) for s in shapes)
    out = []
    for i in range(-n, 0):
        dim = 1
        for s in shapes:
            if len(s) >= -i:
                k = s[i]
                if k != 1:
                    if dim != 1 and dim != k:
                        raise ValueError(f"shapes {' and '.join(map(str, shapes))} cannot be broadcast together")
                    dim = k
        out.append(dim)
    return tuple(out)


def real_dtype(dt: DType) -> DType:
    return d.float32 if dt is d.complex64 else d.float64 if dt is d.complex128 else dt


#: name -> (allowed input dtypes, output rule) for every elementwise function.
#: Output rules: "same" (promoted inputs), "bool", "real" (complex -> its real dtype).
RULES: dict[str, tuple[frozenset[DType], str]] = {}


def _rules(category: str, rule: str, names: str) -> None:
    for n in names.split():
        RULES[n] = (d.CATEGORIES[category], rule)


_rules("numeric", "same", "add subtract multiply pow negative positive square sign conj round")
_rules("numeric", "real", "abs real")
_rules("complex floating-point", "real", "imag")
_rules("floating-point", "same", "divide acos acosh asin asinh atan atanh cos cosh exp expm1 log log1p log2 log10 "
                                 "sin sinh sqrt tan tanh reciprocal")
_rules("real floating-point", "same", "atan2 copysign hypot logaddexp nextafter")
_rules("real numeric", "same", "floor_divide remainder maximum minimum ceil floor trunc")
_rules("integer_or_bool", "same", "bitwise_and bitwise_or bitwise_xor bitwise_invert")
_rules("integer", "same", "bitwise_left_shift bitwise_right_shift")
_rules("any", "bool", "equal not_equal")
_rules("real numeric", "bool", "greater greater_equal less less_equal")
_rules("numeric", "bool", "isfinite isinf isnan")
_rules("real floating-point", "bool", "signbit")
_rules("bool", "bool", "logical_and logical_or logical_xor logical_not")


def _check(name: str, dt: DType, allowed: frozenset[DType]) -> None:
    if dt not in allowed:
        raise TypeError(f"{name} does not accept {dt} inputs (the standard allows "
                        f"{', '.join(sorted(x.name for x in allowed))})")


#: (name, id(dtype)[, id(dtype) | scalar type]) -> result dtype, for combinations already checked
#: once: the hot path then skips the rule and promotion lookups (DType hashes in Python).
_RESULT: dict[tuple[Any, ...], DType] = {}


def _py_scalar(v: np.generic) -> Any:
    """A NumPy scalar (``np.float64(2.0)``) as the Python scalar it holds (an extension of the standard)."""
    if v.dtype.kind not in "biufc":
        raise TypeError(f"unsupported operand type {type(v).__name__}")
    return v.item()


def unary(name: str, x: RemoteArray) -> RemoteArray:
    if type(x) is RemoteArray:
        out = _RESULT.get((name, id(x._dtype)))
        if out is not None:  # the hot path: one dict lookup, then record
            s = x._session
            tid = next(s.ids)
            s.record([_OP, name, [x._id], 0, [tid], None])
            return RemoteArray(tid, x._shape, out, x._dev, s)
    else:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    allowed, rule = RULES[name]
    dt = x._dtype
    if dt not in allowed:
        _check(name, dt, allowed)
    out = dt if rule == "same" else d.bool if rule == "bool" else real_dtype(dt)
    _RESULT[name, id(dt)] = out
    return emit(name, [x], 0, None, x._shape, out)


def binary(name: str, a: Any, b: Any) -> RemoteArray:
    """``name(a, b)`` with at least one ember array (a Python scalar may be the other)."""
    ta, tb = type(a) is RemoteArray, type(b) is RemoteArray
    if ta:  # the hot path: a combination seen before, on one session -> record directly
        if tb:
            out = _RESULT.get((name, id(a._dtype), id(b._dtype)))
            s = a._session
            if out is not None and b._session is s:
                sa, sb = a._shape, b._shape
                tid = next(s.ids)
                s.record([_OP, name, [a._id, b._id], 0, [tid], None])
                return RemoteArray(tid, sa if sa == sb else broadcast_shapes(sa, sb), out, a._dev, s)
        else:
            out = _RESULT.get((name, id(a._dtype), type(b)))
            if out is not None and (type(b) is not int or _I64_MIN <= b <= _I64_MAX):
                s = a._session
                tid = next(s.ids)
                s.record([_OP, name, [a._id, b], 2, [tid], None])
                return RemoteArray(tid, a._shape, out, a._dev, s)
    elif tb:
        out = _RESULT.get((name, type(a), id(b._dtype)))
        if out is not None and (type(a) is not int or _I64_MIN <= a <= _I64_MAX):
            s = b._session
            tid = next(s.ids)
            s.record([_OP, name, [a, b._id], 1, [tid], None])
            return RemoteArray(tid, b._shape, out, b._dev, s)
    return _binary(name, a, b, ta, tb)


def _binary(name: str, a: Any, b: Any, ta: bool, tb: bool) -> RemoteArray:
    allowed, rule = RULES[name]
    ta, tb = type(a) is RemoteArray, type(b) is RemoteArray
    if ta and tb:
        if a._session is not b._session:
            same_device(a, b)
        dt = d.PROMOTION.get((a._dtype, b._dtype)) or d.promote(a._dtype, b._dtype)
        sa, sb = a._shape, b._shape
        shape = sa if sa == sb else broadcast_shapes(sa, sb)
        smask = 0
    elif ta:
        if type(b) not in _Scalar:
            if not isinstance(b, np.generic):
                return NotImplemented
            b = _py_scalar(b)
        dt, shape, smask = d.scalar_ok(a._dtype, b), a._shape, 2
        if type(b) is complex:
            b, smask = scalar_array(b, dt, a), 0
        elif type(b) is int and dt.kind in "fc":
            b = literal(b, dt)
    elif tb:
        if type(a) not in _Scalar:
            if not isinstance(a, np.generic):
                return NotImplemented
            a = _py_scalar(a)
        dt, shape, smask = d.scalar_ok(b._dtype, a), b._shape, 1
        if type(a) is complex:
            a, smask = scalar_array(a, dt, b), 0
        elif type(a) is int and dt.kind in "fc":
            a = literal(a, dt)
    else:
        raise TypeError(f"{name} needs at least one ember array")
    if dt not in allowed:
        _check(name, dt, allowed)
    out = dt if rule == "same" else d.bool if rule == "bool" else real_dtype(dt)
    if smask == 0 and ta and tb:
        _RESULT[name, id(a._dtype), id(b._dtype)] = out
    elif smask and _value_free(a if tb else b, dt):  # the result dtype depends on the scalar's type only
        _RESULT[(name, id(a._dtype), type(b)) if ta else (name, type(a), id(b._dtype))] = out
    return emit(name, [a, b], smask, None, shape, out)


def _value_free(v: Any, dt: DType) -> bool:
    """Does combining scalar ``v`` with ``dt`` succeed whatever its value? (Not an int with an int
    array: that checks the range; not complex: that uploads a 0-d array.)"""
    t = type(v)
    return t is float or t is bool or (t is int and dt.kind not in "iu")


def _binop(name: str, reflected: bool = False) -> Any:
    if reflected:
        def f(self: RemoteArray, other: Any) -> Any:
            return binary(name, other, self)
    else:
        def f(self: RemoteArray, other: Any) -> Any:
            return binary(name, self, other)
    f.__name__ = name
    return f


def _inplace(name: str) -> Any:
    def f(self: RemoteArray, other: Any) -> RemoteArray:
        new = binary(name, self, other)
        if new is NotImplemented:
            return new
        self._adopt(new)
        return self
    return f


for _dunder, _fn in {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "divide",
                     "floordiv": "floor_divide", "mod": "remainder", "pow": "pow", "and": "bitwise_and",
                     "or": "bitwise_or", "xor": "bitwise_xor", "lshift": "bitwise_left_shift",
                     "rshift": "bitwise_right_shift"}.items():
    setattr(RemoteArray, f"__{_dunder}__", _binop(_fn))
    setattr(RemoteArray, f"__r{_dunder}__", _binop(_fn, reflected=True))
    setattr(RemoteArray, f"__i{_dunder}__", _inplace(_fn))
for _dunder, _fn in {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal", "gt": "greater",
                     "ge": "greater_equal"}.items():
    setattr(RemoteArray, f"__{_dunder}__", _binop(_fn))
RemoteArray.__hash__ = None  # type: ignore[assignment]
RemoteArray.__neg__ = lambda self: unary("negative", self)  # type: ignore[attr-defined]
RemoteArray.__pos__ = lambda self: unary("positive", self)  # type: ignore[attr-defined]
RemoteArray.__abs__ = lambda self: unary("abs", self)  # type: ignore[attr-defined]
RemoteArray.__invert__ = lambda self: unary("bitwise_invert", self)  # type: ignore[attr-defined]


# ``@`` / ``@=`` are installed by ``_linalg`` (imported with the package), next to ``matmul``.

__all__ = ["RemoteArray", "DLDeviceType", "scalar_array", "emit", "emit_multi", "emit_dynamic", "emit_dynamic_multi", "unary", "binary", "broadcast_shapes",
           "same_device"]
