"""Hostile arguments for the client API: hypothesis strategies and a driver, shared by the property
tests (``tests/test_hostile_array_api.py``) and the long run (``bench/bench_hostile.py``).

* :func:`hostile` draws what a careless or malicious caller might pass: integers from 0 to far beyond
  2**64 of both signs, NaN and infinities, None, empty and huge tuples, strings, bytes, NumPy values,
  foreign objects (one raises from every conversion, one lies about its size), and the arrays of
  another device. ``extra`` adds values of the caller's own (e.g. torch tensors for ember.torch).
* :class:`Target` is a namespace, a device with a few arrays on it, a second device and a canary.
* :func:`public_functions` enumerates every public function of the namespace (its ``__all__``, the
  ``linalg`` and ``fft`` extensions, the array object's methods, the inspection object's methods).
* :func:`calls` draws a call to one function: each parameter gets a plausible value chosen from its
  name and annotation, then one or two of them (or an unexpected keyword) get a hostile one.
* :func:`run_call` makes the call, reads small results (the peer runs them), and checks that a
  canary op on the same session returns the right value: the session must always survive.

Needs hypothesis (a test dependency); nothing in ember imports this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from typing import Any, Callable, Iterator

import numpy as np
from hypothesis import strategies as st

from .errors import EmberError, LimitExceeded, ProtocolError, SessionLost

BOUNDARY_INTS = [0, 1, -1, 2, 3, 7, 255, 256, -129, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**62,
                 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64, -2**64, 2**70, -2**80, 2**100,
                 10**30, -10**40, 2**200]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e308, -1e308, 5e-324, 1.5, -2.5, 1e20]
OPTIONS = ["left", "right", "xy", "ij", "fro", "nuc", "reduced", "complete", "backward", "ortho", "forward",
           "2024.12", "2025.12", "signed integer", "real floating", "numeric", "bool", "", "x" * 300]

#: What a call may raise: the exceptions a NumPy user expects, and Ember's typed errors.
EXPECTED = (TypeError, ValueError, OverflowError, IndexError, BufferError, EmberError)


class Raising:
    """A foreign object: every conversion of it raises (its repr does not)."""

    def _boom(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError("a hostile object refuses every conversion")

    __index__ = __int__ = __float__ = __complex__ = __bool__ = __len__ = __iter__ = _boom
    __array__ = __dlpack__ = __dlpack_device__ = __getitem__ = __lt__ = __gt__ = _boom
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("a hostile object refuses to compare")

    def __repr__(self) -> str:
        return "Raising()"


class Liar:
    """A foreign object that claims to be an integer beyond 64 bits and a sequence of strings."""

    def __index__(self) -> int:
        return 2**70

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        return iter(["a", "b", "c"])

    def __float__(self) -> float:
        return math.nan

    def __repr__(self) -> str:
        return "Liar()"


FOREIGN = [Raising(), Liar(), object(), type, print, np.int64(2**62), np.uint64(2**64 - 1), np.float32(math.nan),
           np.bool_(True), np.float16(1.0), np.array(3), np.arange(3), np.array(["a"]), np.datetime64("2020"),
           np.array([[1, 2], [3, 4]], dtype=np.int8), 1 + 2j, complex(math.nan, math.inf), slice(0, 2**70),
           slice(None, None, 0), Ellipsis, range(5), bytearray(b"ab"), memoryview(b"abc"), {"a": 1}, {1, 2},
           [1, "x"], [[1], [2, 3]], [2**70], (None,), ((1, 2), (3,)), "1", b"\x00" * 8]


def hostile(extra: list[Any] | None = None) -> st.SearchStrategy[Any]:
    """Values no function should choke on (they may be refused with an expected exception)."""
    parts = [st.sampled_from(BOUNDARY_INTS), st.integers(-2**130, 2**130), st.sampled_from(SPECIAL_FLOATS),
             st.floats(), st.none(), st.booleans(), st.just(()), st.just((1,) * 100), st.just((2,) * 70),
             st.just((10**6,) * 3), st.just(tuple(range(100_000))), st.tuples(st.sampled_from(BOUNDARY_INTS)),
             st.lists(st.sampled_from(BOUNDARY_INTS), max_size=4).map(tuple), st.text(max_size=12),
             st.sampled_from(OPTIONS), st.binary(max_size=12), st.sampled_from(FOREIGN)]
    if extra:
        parts.append(st.sampled_from(extra))
    return st.one_of(*parts)


# ---- the target: a namespace, its arrays, another device --------------------------------------

@dataclasses.dataclass
class Target:
    """What calls run against: ``ns`` (e.g. ``ember.array_api``) on ``dev``, with arrays of ``other`` too."""

    ns: Any
    dev: Any
    other: Any

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """(Re)create the arrays (after a loss, or when hostile in-place calls have worn them)."""
        ns, dev = self.ns, self.dev
        self.arrays = [ns.asarray(np.arange(3.0), device=dev), ns.asarray(np.ones((2, 3), np.float32), device=dev),
                       ns.asarray(np.arange(4), device=dev), ns.asarray(np.eye(2, dtype=np.int8), device=dev),
                       ns.asarray(np.array([True, False, True]), device=dev), ns.asarray(np.float64(2.5), device=dev),
                       ns.asarray(np.array([1 + 2j, 3j]), device=dev), ns.asarray(np.zeros((0,)), device=dev),
                       ns.asarray(np.arange(4.0).reshape(1, 2, 1, 2), device=dev),
                       ns.asarray(np.array([[2.0, 1.0], [1.0, 3.0]]), device=dev),
                       ns.asarray(np.arange(3, dtype=np.uint8), device=dev)]
        self.foreign = [ns.asarray(np.arange(3.0), device=self.other), ns.asarray(np.arange(4), device=self.other)]
        self.canary = ns.asarray(np.arange(10.0), device=dev)
        self.calls = 0

    def canary_ok(self) -> bool:
        """Does the session still compute? (sum(2 * arange(10)) == 90)"""
        return float(self.ns.sum(self.canary * 2).to_numpy()) == 90.0


#: What the peers of :func:`hostile_peer` refuse beyond: a hostile size is refused at the call, never allocated.
HOSTILE_MAX_TENSOR = 32 << 20


@contextlib.contextmanager
def hostile_peer(transport: str) -> Iterator[Target]:
    """A :class:`Target` of ``ember.array_api``: two sessions (the second's arrays are "arrays of another
    device") on the embedded ``"local"`` peer or on a WebSocket peer on loopback, refusing tensors over
    :data:`HOSTILE_MAX_TENSOR`; all closed (and the local peer's limit restored) at the end."""
    import ember
    import ember.array_api as xp
    from .embedded import local_server
    from .server import Server
    srv = local_server() if transport == "local" else Server(["cpu"], max_tensor=HOSTILE_MAX_TENSOR)
    saved = srv.limits["max_tensor"]
    srv.limits["max_tensor"] = HOSTILE_MAX_TENSOR
    if transport == "local":
        address = "local"
    else:
        srv.listen_websocket("127.0.0.1", 0)
        srv.start_in_thread()
        address = srv.addresses[0]
    dev, other = ember.connect(address), ember.connect(address)
    try:
        yield Target(xp, dev, other)
    finally:
        dev.close()
        other.close()
        srv.limits["max_tensor"] = saved
        if transport != "local":
            srv.close()


def _is_func(f: Any) -> bool:
    return callable(f) and not isinstance(f, type) and type(f).__name__ != "DType"


def public_functions(ns: Any) -> list[tuple[str, Callable[..., Any]]]:
    """Every public function of the namespace ``ns``: its ``__all__`` and the extensions' (``linalg.svd``...),
    the array object's methods (``Array.__getitem__``: call them with an array first) and the inspection
    object's (``info.dtypes``)."""
    out: list[tuple[str, Callable[..., Any]]] = []
    for prefix, mod in (("", ns), ("linalg.", ns.linalg), ("fft.", ns.fft)):
        out += [(prefix + n, getattr(mod, n)) for n in mod.__all__ if _is_func(getattr(mod, n))]
    for n, f in sorted(vars(ns.Array).items()):
        if callable(f) and not isinstance(f, type) and (not n.startswith("_") or n.startswith("__")) \
                and n not in ("__init__", "__del__", "__init_subclass__", "__repr__"):
            out.append(("Array." + n, f))
    info = ns.__array_namespace_info__()
    out += [("info." + n, getattr(info, n)) for n in dir(info) if not n.startswith("_") and _is_func(getattr(info, n))]
    return out


# ---- drawing calls ------------------------------------------------------------------------------

_ARRAYS = {"x", "x1", "x2", "condition", "indices", "sorter", "prepend", "append", "self", "obj", "from_", "type",
           "repeats", "min", "max", "value", "other", "arrays", "arrays_and_dtypes"}
_DTYPES = {"dtype", "to", "from_", "type", "kind"}
_AXES = {"axis", "axes", "source", "destination"}
_SHAPES = {"shape", "shapes", "repetitions", "s", "outputs"}


def plausible(t: Target, p: inspect.Parameter) -> st.SearchStrategy[Any]:
    """A value that fits parameter ``p`` by its name and annotation (valid or nearly so)."""
    name, ann = p.name, str(p.annotation)
    small = st.integers(-3, 4)
    arrays = st.sampled_from(t.arrays)
    if name in _ARRAYS:
        scalars = st.one_of(small, st.sampled_from([0.5, -1.0, True, 1j]))
        if name in ("arrays", "arrays_and_dtypes"):
            return st.lists(arrays, min_size=1, max_size=3).map(tuple)
        return st.one_of(arrays, scalars) if name in ("x1", "x2", "min", "max", "value", "other", "repeats") \
            else arrays
    if name in _DTYPES:
        return st.sampled_from([t.ns.float64, t.ns.float32, t.ns.int64, t.ns.int8, t.ns.uint8, t.ns.bool,
                                t.ns.complex128, "float64", np.float32, None])
    if name == "device":
        return st.sampled_from([t.dev, t.other, None])
    if name in _AXES:
        return st.one_of(small, st.none(), st.lists(st.integers(-2, 2), max_size=3).map(tuple))
    if name in _SHAPES:
        return st.lists(st.integers(0, 3), max_size=3).map(tuple)
    if name == "key":
        return st.one_of(small, st.none(), st.just(Ellipsis), st.slices(4), st.sampled_from(t.arrays[2:5]),
                         st.tuples(small, st.slices(3)))
    if "bool" in ann and "int" not in ann:
        return st.booleans()
    if "str" in ann or name in ("ord", "norm", "side", "mode", "indexing", "api_version"):
        return st.sampled_from(OPTIONS[:13])
    if "float" in ann or name in ("correction", "d", "rtol", "ttl", "timeout"):
        return st.one_of(st.floats(-3, 3), small)
    return st.one_of(small, st.none())


@st.composite
def calls(draw: Any, t: Target, name: str, fn: Callable[..., Any],
          extra: list[Any] | None = None) -> tuple[list[Any], dict[str, Any]]:
    """``(args, kwargs)`` for ``fn``: plausible values, one or two replaced by hostile ones (an array
    method's own array, its first parameter, is always one of the target's arrays)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    bad = hostile((extra or []) + t.foreign + [t.other])
    first = 1 if name.startswith("Array.") else 0
    hostile_at = set(draw(st.lists(st.integers(first, len(params)), min_size=1, max_size=2), "hostile positions"))
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for i, p in enumerate(params):
        value = draw(st.sampled_from(t.arrays) if i < first else bad if i in hostile_at else plausible(t, p), p.name)
        if p.kind is p.VAR_POSITIONAL:
            if positional:
                args += draw(st.lists(bad if i in hostile_at else plausible(t, p), max_size=3), p.name + "*")
        elif p.kind is p.VAR_KEYWORD:
            if i in hostile_at:
                kwargs["bogus"] = value
        elif p.kind is p.POSITIONAL_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty):
            if positional and (p.default is p.empty or i in hostile_at or draw(st.booleans(), "pass " + p.name)):
                args.append(value)
            else:
                positional = False
        elif i in hostile_at or draw(st.booleans(), "pass " + p.name):
            kwargs[p.name] = value
    if len(params) in hostile_at:  # a keyword the function does not take
        kwargs["bogus_keyword"] = draw(bad, "bogus")
    return args, kwargs


# ---- running one call -----------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    """What one hostile call did: ``ok`` / ``raised`` (an expected exception) and what went wrong."""

    returned: bool = False
    raised: BaseException | None = None
    problem: str | None = None          # an unexpected exception type, an unsent message, a failed canary
    session_lost: bool = False


def _results(r: Any) -> list[Any]:
    if isinstance(r, (tuple, list)):
        return [a for v in r for a in _results(v)]
    return [r] if hasattr(r, "to_numpy") and hasattr(r, "_session") else []


def run_call(t: Target, name: str, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Outcome:
    """Call ``fn(*args, **kwargs)``; read small results; check the canary. Never raises for the call's
    own exceptions: the outcome says what happened."""
    out = Outcome()
    session = t.dev.session
    unsent = session.stats.get("unsendable", 0)
    t.calls += 1
    try:
        r = fn(*args, **kwargs)
        out.returned = True
        for a in _results(r):
            if a.size <= 4096 and a._session is session:
                try:
                    a.to_numpy(timeout=60.0)
                except SessionLost:
                    raise
                except (ProtocolError, LimitExceeded) as e:  # refused on this side: a check missed it
                    out.problem = f"{name}: a result was poisoned on the client ({type(e).__name__}: {e})"
                except EmberError:
                    pass  # the peer refused it: that result alone is poisoned
    except SessionLost as e:
        out.raised, out.session_lost = e, True
    except EXPECTED as e:
        out.raised = e
    except Exception as e:  # noqa: BLE001 - the point: nothing else may come out of a call
        out.raised = e
        out.problem = f"{name} raised {type(e).__name__}: {e}"
    try:
        if not t.canary_ok():
            out.problem = out.problem or f"after {name}: the canary op returned a wrong value"
    except SessionLost:
        out.session_lost = True
    except Exception as e:  # noqa: BLE001
        out.problem = out.problem or f"after {name}: the canary op raised {type(e).__name__}: {e}"
    if session.lost is not None:
        out.session_lost = True
    elif out.problem is None and session.stats.get("unsendable", 0) != unsent:
        out.problem = f"{name}: a message could not be encoded (the argument checks let a value through)"
    return out
