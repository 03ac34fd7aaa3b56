"""``ember.array_api``: the Python Array API standard (2024.12), executed on compute peers.

One module per family of the standard. Every function computes its result's shape
and dtype here, records an op on the device of its inputs (or ``device=`` / the
default device for creation) and returns at once; values travel only when read.
Functions whose output shape depends on data (``unique_*``, ``nonzero``, boolean
masks, ``repeat`` with array repeats) cost one round trip to learn the shape.

Where Ember departs from the letter of the standard, deliberately:

* DLPack goes through a host copy: ``__dlpack__`` exports a NumPy copy (device kDLCPU,
  ``copy=False`` raises BufferError); ``from_dlpack`` uploads a host copy.
* A device whose backend lacks a dtype (PyTorch: uint16/32/64) refuses, on the client and
  before anything is sent, every call whose result would have it, e.g. ``sum`` of uint8
  (the standard's result is uint64): pass ``dtype=``.
* Complex special values (inf/nan components, division by complex zero) are whatever the
  peer's backend computes; PyTorch and JAX differ from NumPy there. JAX flushes subnormals.
* ``unique_*`` return sorted values (the standard leaves the order unspecified).
* In-place operators and ``x[key] = v`` replace the remote value (the array object keeps
  its identity); arrays never alias on the peer, so writing to ``x`` leaves ``x[0:2]``
  taken earlier unchanged.
* More than the standard requires: NumPy-style indexing (integer arrays with slices or
  ``None``, several arrays, integer-array ``__setitem__``), NumPy scalars accepted where
  Python scalars are, and ``broadcast_shapes`` (from 2025.12).
* ``asarray(host_data, copy=False)`` raises ValueError: the data must travel to the peer.
"""

from __future__ import annotations

import sys
from math import e, inf, nan, pi

from . import _display, _transfer, fft, linalg  # noqa: F401  (they install repr(x), x.to_device)
from . import _array
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

__array_api_version__ = "2024.12"
newaxis = None
Array = RemoteArray
_array.NAMESPACE.append(sys.modules[__name__])

__all__ = (["__array_api_version__", "__array_namespace_info__", "Array", "e", "inf", "nan", "pi", "newaxis",
            "fft", "linalg", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float32", "float64", "complex64", "complex128"]
           + _creation_all + _data_types_all + _elementwise_all + _indexing_all + _linalg_all + _manipulation_all
           + _searching_all + _set_all + _sorting_all + _statistical_all + _utility_all)
