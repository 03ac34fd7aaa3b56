"""Real consumers: scikit-learn estimators with ``array_api_dispatch`` fitted on Ember arrays
give the results they give on NumPy arrays (on a NumPy peer and a torch:cpu peer)."""

from __future__ import annotations

import os

os.environ.setdefault("SCIPY_ARRAY_API", "1")  # before SciPy is imported: sklearn's dispatch needs it

from typing import Any, Iterator  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

sklearn = pytest.importorskip("sklearn")

import ember  # noqa: E402
import ember.array_api as xp  # noqa: E402
from ember.server import Server  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

rng = np.random.default_rng(42)
X = rng.standard_normal((60, 6))
X[:, 1] += 2 * X[:, 0]
Y_CLASS = np.where(X[:, 0] + 0.3 * rng.standard_normal(60) > 0, 1, 0) + (X[:, 2] > 1)
Y_REG = X @ np.linspace(-1, 1, 6) + 0.5 + 0.01 * rng.standard_normal(60)


@pytest.fixture(scope="module", params=["cpu", "torch:cpu"] + (["jax:cpu"] if os.environ.get("EMBER_TEST_JAX") else []))
def dev(request: pytest.FixtureRequest) -> Iterator[ember.Device]:
    if request.param != "cpu":
        pytest.importorskip(request.param.split(":")[0])
    srv = Server([request.param])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    d = ember.connect(srv.addresses[0])
    yield d
    d.close()
    srv.close()


def fit_both(make: Any, dev: ember.Device, y: np.ndarray | None, dtype: Any = np.float64) -> tuple[Any, Any]:
    """The same estimator fitted on NumPy and (with array_api_dispatch) on Ember arrays."""
    ref = make().fit(X.astype(dtype), y)
    xe = xp.asarray(X.astype(dtype), device=dev)
    ye = None if y is None else xp.asarray(y, device=dev)
    with sklearn.config_context(array_api_dispatch=True):
        est = make().fit(xe, ye)
    return ref, est


def close(remote: Any, local: Any, tol: float = 1e-7) -> None:
    assert isinstance(remote, xp.Array), f"expected an ember array, got {type(remote).__name__}"
    np.testing.assert_allclose(remote.to_numpy(), np.asarray(local), rtol=tol, atol=tol)


def test_pca(dev: ember.Device) -> None:
    from sklearn.decomposition import PCA
    for solver in ("full", "covariance_eigh"):
        ref, est = fit_both(lambda: PCA(n_components=3, svd_solver=solver), dev, None)
        close(est.explained_variance_, ref.explained_variance_)
        close(est.mean_, ref.mean_)
        signs = np.sign(np.sum(est.components_.to_numpy() * ref.components_, axis=1))  # components up to sign
        close(est.components_ * xp.asarray(signs[:, None], device=dev), ref.components_, 1e-6)
        with sklearn.config_context(array_api_dispatch=True):
            t = est.transform(xp.asarray(X, device=dev))
        close(t * xp.asarray(signs, device=dev), ref.transform(X), 1e-6)


def test_linear_discriminant_analysis(dev: ember.Device) -> None:
    from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
    ref, est = fit_both(lambda: LinearDiscriminantAnalysis(), dev, Y_CLASS)
    close(est.coef_, ref.coef_, 1e-6)
    close(est.intercept_, ref.intercept_, 1e-6)
    with sklearn.config_context(array_api_dispatch=True):
        pred = est.predict(xp.asarray(X, device=dev))
        proba = est.predict_proba(xp.asarray(X, device=dev))
    np.testing.assert_array_equal(pred.to_numpy(), ref.predict(X))
    close(proba, ref.predict_proba(X), 1e-6)


def test_ridge(dev: ember.Device) -> None:
    from sklearn.linear_model import Ridge
    ref, est = fit_both(lambda: Ridge(alpha=0.5, solver="svd"), dev, Y_REG)
    close(est.coef_, ref.coef_)
    close(est.intercept_, ref.intercept_)
    with sklearn.config_context(array_api_dispatch=True):
        close(est.predict(xp.asarray(X, device=dev)), ref.predict(X))


def test_preprocessing(dev: ember.Device) -> None:
    from sklearn.preprocessing import MinMaxScaler, StandardScaler
    for make in (StandardScaler, MinMaxScaler):
        ref, est = fit_both(make, dev, None)
        with sklearn.config_context(array_api_dispatch=True):
            close(est.transform(xp.asarray(X, device=dev)), ref.transform(X))


def test_float32(dev: ember.Device) -> None:
    from sklearn.decomposition import PCA
    ref, est = fit_both(lambda: PCA(n_components=2, svd_solver="full"), dev, None, np.float32)
    assert est.explained_variance_.dtype == xp.float32
    close(est.explained_variance_, ref.explained_variance_, 1e-4)
