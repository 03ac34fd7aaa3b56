"""Devices a compute peer hosts: an Array API namespace (via array-api-compat) plus a device.

Device specs: ``cpu`` (NumPy), ``torch:cpu``, ``torch:cuda:N``, ``cupy:N``,
``jax:cpu``, ``jax:gpu:N``. Heavy packages are imported only when a device
that needs them is created.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import EmberError

ALL_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float32", "float64", "complex64", "complex128")

_EXTRAS = {"torch": "torch", "cupy": "cupy", "jax": "jax"}


class UnknownOp(LookupError):
    """A name that is neither a whitelisted function nor a registered custom op (``str()`` says why)."""


class BackendUnavailable(EmberError):
    """A device spec names a backend whose package is not installed or has no such device."""


@dataclass
class Backend:
    """One device of a compute peer."""

    spec: str
    kind: str                      # numpy | torch | cupy | jax
    xp: Any                        # array-api-compat namespace
    device: Any                    # backend device object passed as device=
    name: str
    dtypes: tuple[str, ...]
    memory: int | None = None      # bytes, where known
    dtype_objs: dict[str, Any] = field(default_factory=dict)

    def info(self, index: int) -> dict[str, Any]:
        return {"index": index, "spec": self.spec, "backend": self.kind, "name": self.name,
                "dtypes": list(self.dtypes), "memory": self.memory}

    def dtype(self, name: str) -> Any:
        try:
            return self.dtype_objs[name]
        except (KeyError, TypeError):  # TypeError: not even a name (a map would make a structured dtype)
            raise TypeError(f"device {self.spec} ({self.kind}) has no dtype {str(name)[:40]!r}") from None

    def from_host(self, arr: np.ndarray) -> Any:
        """Host NumPy array -> array on this device."""
        if self.kind == "numpy":
            return arr
        if self.kind == "torch":
            import torch
            return torch.tensor(arr, device=self.device)  # one copy, into torch's own (resizable) memory
        return self.xp.asarray(arr, device=self.device)

    def small_bytes(self, limit: int) -> Any:
        """For a torch CPU device: ``f(x)``, ``(dtype name, shape, bytes)`` of a stored value of at most ``limit``
        bytes whose memory is its own in order (contiguous, no conjugate or negative bit: a storage value, a
        loss, an Array API result), copied (a copy of a few bytes costs less than a NumPy view of them); None for
        anything else (read through :meth:`to_host`). None on other devices."""
        if self.kind != "torch" or getattr(self.device, "type", None) != "cpu":
            return None
        import ctypes

        import torch
        tensor, copy = torch.Tensor, ctypes.string_at
        names = {getattr(torch, n): n for n in ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32",
                                                 "uint64", "float16", "float32", "float64", "complex64",
                                                 "complex128", "bool") if hasattr(torch, n)}

        def f(x: Any) -> tuple[str, list[int], bytes] | None:
            if type(x) is tensor and x.is_cpu and not x.requires_grad and x.is_contiguous():
                dt = names.get(x.dtype)
                if dt is not None and not x.is_conj() and not x.is_neg():
                    n = x.numel() * x.element_size()
                    if n <= limit:
                        return dt, list(x.shape), copy(x.data_ptr(), n) if n else b""  # (its own n bytes, in order)
            return None
        return f

    def to_host(self, x: Any) -> np.ndarray:
        """Array on this device -> C-contiguous host NumPy array."""
        if self.kind == "numpy":
            return np.asarray(x, order="C")
        if self.kind == "torch":
            return np.asarray(x.detach().cpu().resolve_conj().resolve_neg().numpy(), order="C")
        if self.kind == "cupy":
            return np.asarray(x.get(), order="C")
        return np.asarray(x, order="C")


def _import(kind: str) -> Any:
    try:
        return importlib.import_module(kind)
    except ImportError:
        raise BackendUnavailable(
            f"device backend {kind!r} is not installed",
            hint=f"pip install 'ember[{_EXTRAS.get(kind, kind)}]'") from None


def _dtype_table(xp: Any) -> dict[str, Any]:
    return {n: getattr(xp, n) for n in ALL_DTYPES if hasattr(xp, n)}


def _numpy() -> Backend:
    import array_api_compat.numpy as xp
    return Backend("cpu", "numpy", xp, "cpu", "cpu (numpy %s)" % np.__version__, ALL_DTYPES,
                   dtype_objs=_dtype_table(xp))


def _torch(rest: str) -> Backend:
    torch = _import("torch")
    import array_api_compat.torch as xp
    dev = torch.device(rest or "cpu")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise BackendUnavailable(f"torch device {rest!r} is not available on this host",
                                 hint="list GPUs with nvidia-smi, or use --device torch:cpu")
    table = _dtype_table(xp)
    names = tuple(n for n in ALL_DTYPES if n in table and n not in ("uint16", "uint32", "uint64"))
    mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    return Backend(f"torch:{rest or 'cpu'}", "torch", xp, dev, f"torch {torch.__version__} {dev}",
                   names, mem, {n: table[n] for n in names})


def _cupy(rest: str) -> Backend:
    cp = _import("cupy")
    import array_api_compat.cupy as xp
    idx = int(rest or 0)
    dev = cp.cuda.Device(idx)
    return Backend(f"cupy:{idx}", "cupy", xp, dev, f"cupy {cp.__version__} gpu {idx}", ALL_DTYPES,
                   dev.mem_info[1], _dtype_table(xp))


def _jax(rest: str) -> Backend:
    jax = _import("jax")
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as xp
    platform, _, idx = (rest or "cpu").partition(":")
    try:
        dev = jax.devices(platform)[int(idx or 0)]
    except Exception as e:
        raise BackendUnavailable(f"jax device {rest!r} is not available: {e}",
                                 hint="use --device jax:cpu") from None
    return Backend(f"jax:{rest or 'cpu'}", "jax", xp, dev, f"jax {jax.__version__} {dev}", ALL_DTYPES,
                   dtype_objs=_dtype_table(xp))


def make_backend(spec: str) -> Backend:
    """Build a device from its spec string; raise BackendUnavailable with an install hint."""
    kind, _, rest = spec.partition(":")
    if kind in ("cpu", "numpy"):
        return _numpy()
    makers = {"torch": _torch, "cupy": _cupy, "jax": _jax}
    if kind not in makers:
        raise BackendUnavailable(f"unknown device spec {spec!r}",
                                 hint="use cpu, torch:cpu, torch:cuda:N, cupy:N, jax:cpu or jax:gpu:N")
    return makers[kind](rest)
