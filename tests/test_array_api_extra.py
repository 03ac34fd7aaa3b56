"""Real consumers: array-api-extra functions over Ember arrays equal the same functions over NumPy."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import ember.array_api as xp

xpx = pytest.importorskip("array_api_extra")

A = np.arange(12.0).reshape(3, 4) - 5.0

CASES: dict[str, Callable[[Any, Any], Any]] = {
    "atleast_nd": lambda ns, a: xpx.atleast_nd(a[0], ndim=3, xp=ns),
    "cov": lambda ns, a: xpx.cov(a, xp=ns),
    "create_diagonal": lambda ns, a: xpx.create_diagonal(a[0], xp=ns),
    "kron": lambda ns, a: xpx.kron(a, a[:2, :2], xp=ns),
    "pad": lambda ns, a: xpx.pad(a, 1, xp=ns),
    "sinc": lambda ns, a: xpx.sinc(a / 3.0, xp=ns),
    "nunique": lambda ns, a: xpx.nunique(ns.floor(a / 3.0), xp=ns),
    "setdiff1d": lambda ns, a: xpx.setdiff1d(a[0], a[1] - 4.0, xp=ns),
    "isclose": lambda ns, a: xpx.isclose(a, a + 1e-12, xp=ns),
    "at_set": lambda ns, a: xpx.at(a)[1:, 0].set(-1.0, xp=ns),
    "at_add": lambda ns, a: xpx.at(a, (0, 1)).add(5.0, xp=ns),
    "apply_where": lambda ns, a: xpx.apply_where(a > 3, a, lambda v: v * 2, fill_value=0.0, xp=ns),
    "one_hot": lambda ns, a: xpx.one_hot(ns.astype(ns.abs(a[0]) % 3, ns.int64), 3, xp=ns),
    "nan_to_num": lambda ns, a: xpx.nan_to_num(a / 0.0, xp=ns),
    "partition": lambda ns, a: ns.sort(xpx.partition(a[2], 2, xp=ns)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_array_api_extra(dev: Any, name: str) -> None:
    import array_api_compat.numpy as npx
    with np.errstate(all="ignore"):
        expected = np.asarray(CASES[name](npx, A.copy()))
    got = CASES[name](xp, xp.asarray(A, device=dev))
    assert isinstance(got, xp.Array)
    np.testing.assert_allclose(got.to_numpy(), expected, rtol=1e-12, atol=1e-12)
