"""``ember.array_api``: the Python Array API standard (2025.12), executed on compute peers.

One module per family of the standard. Every function computes its result's shape
and dtype here, records an op on the device of its inputs (or ``device=`` / the
default device for creation) and returns at once; values travel only when read.
Functions whose output shape depends on data (``unique_*``, ``nonzero``, boolean
masks, ``repeat`` with array repeats) cost one round trip to learn the shape.
``x.__array_namespace__(api_version="2024.12")`` (or an earlier version) gives the
namespace as 2024.12 defines it: lists from ``meshgrid``, ``broadcast_arrays`` and
``info.devices()``, no ``isin`` / ``broadcast_shapes`` / ``linalg.eig`` / ``linalg.eigvals``,
no scalar ``x2`` in ``searchsorted``.

Where Ember departs from the letter of the standard, deliberately:

* DLPack goes through a host copy (the value lives on a peer; no local memory to share):
  ``__dlpack__`` exports a NumPy copy on kDLCPU (a DLPack 1.x capsule flagged IS_COPIED
  when the consumer passes ``max_version``); ``copy=False``, any other ``dl_device`` and a
  ``stream`` raise BufferError. ``from_dlpack`` uploads a host copy to ``device=`` or the
  default device (the standard would keep the producer's device, which is not an ember one).
* A device whose backend lacks a dtype (PyTorch: uint16/32/64) refuses, on the client and
  before anything is sent, every call whose result would have it, e.g. ``sum`` of uint8
  (the standard's result is uint64): pass ``dtype=``.
* Special values: the cases the standard lists for ``floor_divide`` / ``//`` and for complex
  ``expm1``, ``tanh`` and ``sqrt`` hold on every backend (the peer's adapters fix NumPy's and
  PyTorch's; where the standard allows NaN or -1.0 "to match Python", Ember gives ±infinity
  and -0). Other complex special values (inf/nan components in exp, log, the trigonometric
  functions, division by complex zero) are whatever the peer's backend computes; PyTorch and
  JAX differ from NumPy there. JAX flushes subnormals.
* ``unique_*`` return sorted values (the standard leaves the order unspecified).
* In-place operators and ``x[key] = v`` replace the remote value (the array object keeps
  its identity); arrays never alias on the peer, so writing to ``x`` leaves ``x[0:2]``
  taken earlier unchanged.
* ``isin`` takes integer arrays as the standard says and real floating-point ones too (as
  NumPy), but refuses bool and complex ones (PyTorch has no isin for them).
* ``__array_namespace_info__().default_device()`` is always a device, never None: the
  default is known (the innermost ``with dev:``, else ``set_default_device``, else ``local``).
* More than the standard requires: NumPy-style indexing (integer arrays with slices or
  ``None``, several arrays, integer-array ``__setitem__``), NumPy scalars accepted where
  Python scalars are, ``expand_dims`` defaulting to ``axis=0``; the 2024.12 namespace
  also takes 2025.12's tuple ``expand_dims`` axes and negative ``permute_dims`` axes.
* ``asarray(host_data, copy=False)`` raises ValueError: the data must travel to the peer.
"""

from __future__ import annotations

import sys
from math import e, inf, nan, pi

from . import _display, _transfer, fft, linalg  # noqa: F401  (they install repr(x), x.to_device)
from . import _array, _versions
from ._array import RemoteArray
from ._creation import *  # noqa: F401,F403
from ._creation import __all__ as _creation_all
from ._data_types import *  # noqa: F401,F403
from ._data_types import __all__ as _data_types_all
from ._dtypes import (bool, complex64, complex128, float32, float64, int8, int16, int32, int64,  # noqa: A004
                      uint8, uint16, uint32, uint64)
from ._elementwise import *  # noqa: F401,F403
from ._elementwise import __all__ as _elementwise_all
from ._indexing import *  # noqa: F401,F403
from ._indexing import __all__ as _indexing_all
from ._info import __array_namespace_info__
from ._linalg import *  # noqa: F401,F403
from ._linalg import __all__ as _linalg_all
from ._manipulation import *  # noqa: F401,F403
from ._manipulation import __all__ as _manipulation_all
from ._searching import *  # noqa: F401,F403
from ._searching import __all__ as _searching_all
from ._set import *  # noqa: F401,F403
from ._set import __all__ as _set_all
from ._sorting import *  # noqa: F401,F403
from ._sorting import __all__ as _sorting_all
from ._statistical import *  # noqa: F401,F403
from ._statistical import __all__ as _statistical_all
from ._utility import *  # noqa: F401,F403
from ._utility import __all__ as _utility_all

__array_api_version__ = "2025.12"
newaxis = None
Array = RemoteArray

__all__ = (["__array_api_version__", "__array_namespace_info__", "Array", "e", "inf", "nan", "pi", "newaxis",
            "fft", "linalg", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float32", "float64", "complex64", "complex128"]
           + _creation_all + _data_types_all + _elementwise_all + _indexing_all + _linalg_all + _manipulation_all
           + _searching_all + _set_all + _sorting_all + _statistical_all + _utility_all)

_this = sys.modules[__name__]
_array.NAMESPACES.update({None: _this, "2025.12": _this})
_array.NAMESPACES.update(dict.fromkeys(("2021.12", "2022.12", "2023.12", "2024.12"), _versions.namespace_2024(_this)))
