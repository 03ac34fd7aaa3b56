"""The namespace as the 2024.12 standard: ``x.__array_namespace__(api_version="2024.12")``.

2025.12 returns tuples instead of lists from ``meshgrid``, ``broadcast_arrays`` and
``__array_namespace_info__().devices()``, lets ``searchsorted`` take a scalar ``x2`` and adds
``isin``, ``broadcast_shapes``, ``linalg.eig`` and ``linalg.eigvals``. The 2024.12 namespace is the
2025.12 one with exactly those undone; every other function (and every array) is shared.
"""

from __future__ import annotations

import types
from typing import Any

from ._array import RemoteArray
from ._info import Info

VERSION = "2024.12"
ADDED = frozenset({"isin", "broadcast_shapes"})
ADDED_LINALG = frozenset({"eig", "eigvals"})


class Info2024(Info):
    """``__array_namespace_info__()`` of 2024.12: ``devices()`` is a list."""

    def devices(self) -> list[Any]:  # type: ignore[override]
        return list(super().devices())


_INFO = Info2024()


def _module(name: str, src: types.ModuleType, names: list[str]) -> types.ModuleType:
    mod = types.ModuleType(name, src.__doc__)
    mod.__dict__.update({n: getattr(src, n) for n in names})
    mod.__all__ = names  # type: ignore[attr-defined]
    return mod


def namespace_2024(ns: types.ModuleType) -> types.ModuleType:
    """The 2024.12 form of ``ns`` (``ember.array_api``)."""
    names = [n for n in ns.__all__ if n not in ADDED]
    v = _module(ns.__name__ + ".v2024_12", ns, names)

    def meshgrid(*arrays: RemoteArray, indexing: str = "xy") -> list[RemoteArray]:
        return list(ns.meshgrid(*arrays, indexing=indexing))

    def broadcast_arrays(*arrays: RemoteArray) -> list[RemoteArray]:
        return list(ns.broadcast_arrays(*arrays))

    def searchsorted(x1: RemoteArray, x2: RemoteArray, /, *, side: str = "left",
                     sorter: RemoteArray | None = None) -> RemoteArray:
        if type(x2) is not RemoteArray:
            raise TypeError(f"searchsorted: x2 must be an array in 2024.12 (a {type(x2).__name__} needs 2025.12)")
        return ns.searchsorted(x1, x2, side=side, sorter=sorter)

    v.__dict__.update({
        "__array_api_version__": VERSION,
        "__array_namespace_info__": lambda: _INFO,
        "meshgrid": meshgrid, "broadcast_arrays": broadcast_arrays, "searchsorted": searchsorted,
        "linalg": _module(ns.linalg.__name__ + ".v2024_12", ns.linalg,
                          [n for n in ns.linalg.__all__ if n not in ADDED_LINALG]),
    })
    return v
