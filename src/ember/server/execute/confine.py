"""What a client's op may make a peer hold: written memory only, of the device's announced dtypes only.

* No uninitialised memory reaches a client: ``empty`` / ``empty_like`` are ``zeros`` /
  ``zeros_like`` (a freed buffer of another session must never be read back), and the
  keyword arguments that let a backend skip writing its output (NumPy's ``where=``,
  ``out=``...) are refused.
* No object or string array can exist: positional scalars are numbers, ``None``, flat or
  nested lists of numbers, or a dtype name of the device; ``full``'s fill value is a number.
  (An object array is Python code run under the GIL: one ``pow`` on it froze every session.)

:func:`scalar_fault` runs only for ops with scalar arguments; :func:`kwargs_fault` only for
ops with keyword arguments; :func:`confine` installs the creation adapters once per device.
"""

from __future__ import annotations

from typing import Any, Callable

NUMBERS = (bool, int, float, complex)
_PLAIN = frozenset((bool, int, float, complex, type(None)))

#: Keyword arguments no op of the wire protocol uses, which would let a backend leave its output
#: unwritten (``where=``, ``out=``) or make arrays of its own choosing (``like=``, ``device=``...).
REFUSED_KWARGS = frozenset({"where", "out", "like", "device", "casting", "order", "subok", "signature",
                            "extobj", "initial_value", "buffer", "offset_bytes"})


def _plain_list(v: list[Any], depth: int = 0) -> bool:
    if depth > 32:
        return False
    for x in v:
        t = type(x)
        if t not in _PLAIN and not (t is list and _plain_list(x, depth + 1)):
            return False
    return True


def scalar_fault(args: list[Any], smask: int, dtypes: Any) -> str | None:
    """Why one of an op's literal scalars (bit i of ``smask``) may not be used, or None."""
    for a in args:  # tensor ids are ints: only arguments that are not numbers need their mask bit
        if type(a) not in _PLAIN:
            break
    else:
        return None
    for i, a in enumerate(args):
        if smask >> i & 1:
            t = type(a)
            if t not in _PLAIN and not (t is list and _plain_list(a)) and not (t is str and a in dtypes):
                return (f"scalar argument {i} is a {t.__name__}: scalars are numbers, None, lists of numbers "
                        "or a dtype name of this device")
    return None


def kwargs_fault(kwargs: dict[str, Any]) -> str | None:
    """Why an op's keyword arguments may not be used (a refused name), or None."""
    if REFUSED_KWARGS.isdisjoint(kwargs):
        return None
    bad = sorted(REFUSED_KWARGS.intersection(kwargs))
    return f"keyword argument(s) {bad} are not accepted by this peer"


def _fill(f: Callable[..., Any]) -> Callable[..., Any]:
    def full(*a: Any, fill_value: Any = None, **k: Any) -> Any:
        if type(fill_value) not in NUMBERS:
            raise TypeError(f"fill_value must be a bool, int, float or complex, not {type(fill_value).__name__}")
        return f(*a, fill_value=fill_value, **k)
    return full


def confine(table: dict[str, Callable[..., Any]]) -> None:
    """``empty*`` write zeros; ``full*`` take numbers only (in place, once per device table)."""
    for empty, zeros in (("empty", "zeros"), ("empty_like", "zeros_like")):
        if zeros in table:
            table[empty] = table[zeros]
    for name in ("full", "full_like"):
        if name in table:
            table[name] = _fill(table[name])


__all__ = ["confine", "scalar_fault", "kwargs_fault", "REFUSED_KWARGS"]
