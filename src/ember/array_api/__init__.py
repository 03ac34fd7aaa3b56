"""``ember.array_api``: the Python Array API standard, executed on compute peers.

One module per family of the standard. Every function records an op on the
device of its inputs (or ``device=`` / the default device for creation) and
returns at once; values travel only when read.
"""

from __future__ import annotations

from math import e, inf, nan, pi

from ._array import RemoteArray
from ._creation import *  # noqa: F401,F403
from ._creation import __all__ as _creation_all
from ._data_types import *  # noqa: F401,F403
from ._data_types import __all__ as _data_types_all
from ._dtypes import (bool, complex64, complex128, float32, float64, int8, int16, int32, int64,  # noqa: A004
                      uint8, uint16, uint32, uint64)
from ._elementwise import *  # noqa: F401,F403
from ._elementwise import __all__ as _elementwise_all
from ._linalg import matmul
from ._manipulation import *  # noqa: F401,F403
from ._manipulation import __all__ as _manipulation_all
from ._searching import where
from ._statistical import all, any, max, mean, min, prod, std, sum, var  # noqa: A004

__array_api_version__ = "2024.12"
newaxis = None
Array = RemoteArray

__all__ = (["__array_api_version__", "Array", "e", "inf", "nan", "pi", "newaxis", "matmul", "where",
            "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
            "float64", "complex64", "complex128", "all", "any", "max", "mean", "min", "prod", "std", "sum", "var"]
           + _creation_all + _data_types_all + _elementwise_all + _manipulation_all)
