"""Registering the ``ember`` device with torch: a pure-Python PrivateUse1 backend.

``register()`` renames torch's PrivateUse1 slot to ``ember`` and installs, through
``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, a device
module (``torch.ember``), hooks and a device guard; then one Python fallback kernel for
every ATen op on the PrivateUse1 key, plus the same kernel claimed explicitly for the
overloads that would otherwise reach the device decomposed (``CompositeExplicitAutograd-
NonFunctional`` kernels turn ``a + b`` into ``empty`` + ``add.out``; ``_foreach_*`` ops
would arrive one tensor at a time). No C++ is compiled.

The API is experimental in torch (``torch._C._acc``); it is feature-checked here and an
unsupported torch fails at import with the versions that work.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

import torch

from ..errors import EmberError

from . import _devices as Dv
from . import _dispatch as D

_registered = False
_lock = threading.Lock()
_libs: list[Any] = []  # torch.library registrations live as long as these objects


class EmberModule:
    """``torch.ember``: what torch asks of a device's module."""

    @staticmethod
    def is_available() -> bool:
        # torch.accelerator.is_available(): ember is the accelerator (pinning host memory is a no-op, _patches)
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def manual_seed(seed: int) -> None:
        Dv.manual_seed_all(seed)

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        Dv.manual_seed_all(seed)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        """Wait until every op recorded on the current Ember device has run."""
        Dv.current_device().sync()

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    @property
    def _initialized(self) -> bool:
        """``torch.utils.checkpoint`` saves a device's random state only when this is true (``_rng.py``)."""
        from . import _rng
        return _rng.available()

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        """The current Ember device's random state: an ember ``uint8`` tensor (``_rng.py``)."""
        from . import _rng
        return _rng.get_state()

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = None) -> None:
        from . import _rng
        _rng.set_state(new_state)

    @staticmethod
    def device(index: Any = None) -> Any:
        """``with torch.ember.device(0):`` -- ember has one torch device index: a no-op context."""
        return contextlib.nullcontext()

    # Streams: a session runs its ops in order, so an ember device has one stream. What asks for the
    # accelerator's streams (torch.distributed.checkpoint's writer and loader) gets it.
    @staticmethod
    def current_stream(device: Any = None) -> "Stream":
        return _STREAM

    default_stream = current_stream

    @staticmethod
    def stream(stream: Any = None) -> Any:
        """``with torch.ember.stream(s):`` -- the one stream: a no-op context."""
        return contextlib.nullcontext()

    @staticmethod
    def set_stream(stream: Any) -> None:
        return None


class Stream:
    """An ember device's one stream (``torch.ember.current_stream()``): ops run in the order recorded;
    ``synchronize()`` waits until every op recorded on the current Ember device has run."""

    device_type = "ember"
    device_index = 0

    def synchronize(self) -> None:
        Dv.current_device().sync()

    def wait_stream(self, stream: Any) -> None:
        return None  # (one stream: already in order)

    def query(self) -> bool:
        self.synchronize()
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return hash(Stream)

    def __repr__(self) -> str:
        return "<torch.ember.Stream device=ember:0 (the session's one stream)>"


_STREAM = Stream()


class _Hooks(torch._C._acc.PrivateUse1Hooks):  # type: ignore[misc,name-defined]
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATE_USE1 = torch._C._autograd.DeviceType.PrivateUse1


class _Guard(torch._C._acc.DeviceGuard):  # type: ignore[misc,name-defined]
    def type_(self) -> Any:  # (torch asks ~2 times per ATen call: one global read, not four attribute lookups)
        return _PRIVATE_USE1


def _claimed_overloads() -> list[str]:
    """Overloads that reach a backend decomposed (or not at all) unless it claims them.

    ``CompositeExplicitAutogradNonFunctional`` kernels (``a + b`` -> ``empty`` + ``add.out``) and
    ``_foreach_*`` composites (one op per tensor); and ``CompositeExplicitAutograd`` ops with a
    meta kernel: one message instead of their decomposition, and the only way for ops such as
    ``convolution``, whose composite routes an unknown device to ``convolution_overrideable``.
    """
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    out = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or name in _NOT_CLAIMED:
            continue
        if name in _ALWAYS_CLAIMED or has(name, "CompositeExplicitAutogradNonFunctional") or \
                has(name, "CompositeExplicitAutograd") and (name.startswith("aten::_foreach_") or has(name, "Meta")):
            out.append(name)
    return out


_ALWAYS_CLAIMED = frozenset({"aten::_conj", "aten::_neg_view",  # copies on ember (see _patches)
                            "aten::clone", "aten::_to_copy",  # their result stays on the operand's device
                            # a CPU kernel beside a composite for other devices, which rounds otherwise (Mish's
                            # gradient in half precision): one op, run by the peer's CPU kernel
                            "aten::mish_backward", "aten::native_channel_shuffle",
                            # one op laid out as the CPU kernel lays it (_meta._lstsq_meta), not empty + .out
                            "aten::linalg_lstsq"})
_NOT_CLAIMED = frozenset({"aten::_print", "aten::is_same_size", "aten::_assert_tensor_metadata",
                          "aten::_functional_sym_constrain_range"})


def _overload(qualname: str) -> Any:
    op, _, ov = qualname[len("aten::"):].partition(".")
    return getattr(getattr(torch.ops.aten, op), ov or "default")


def _sparse_refused(op: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"{op}: sparse tensors are not supported on ember (ember tensors are strided); "
                              f"use a dense tensor (.to_dense()) or run this op on CPU")


def register() -> None:
    """Make ``"ember"`` a torch device (idempotent)."""
    global _registered
    with _lock:
        if _registered:
            return
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", "ember"):
            raise EmberError(f"torch's PrivateUse1 device slot is already taken by {current!r}",
                             hint="ember.torch and another out-of-tree device cannot share one process")
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend("ember", backend_module=EmberModule(), hook=_Hooks(),
                                                device_guard=_Guard())
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(D.kernel, "PrivateUse1")
        for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):  # sparse ember tensors: a clear error, by op
            fallback.fallback(_sparse_refused, key)
        from . import _sparse
        claims = torch.library.Library("aten", "IMPL")
        for name in _claimed_overloads():
            if name[len("aten::"):] in _sparse.DENSE_KERNELS:
                continue
            try:
                op = _overload(name)
            except AttributeError:
                continue
            claims.impl(name[len("aten::"):], functools.partial(D.kernel, op), "PrivateUse1")
        _libs.extend([fallback, claims, _sparse.install()])
        from ._meta import install_meta
        _libs.append(install_meta())
        from . import _patches
        _libs.extend(_patches.install())
        from . import _decomposed
        _decomposed.install()
        from . import _autocast
        _libs.extend(_autocast.install())
        from ..server.execute import rnn_cells  # meta kernels torch lacks (the GRU cells: no round trip for nn.GRU),
        rnn_cells.install("Meta", replace=("_thnn_fused_lstm_cell",))  # and one that fails without biases
        from . import _rnn  # nn.LSTM on a CPU peer: CPU torch's oneDNN layer ops, not per-step cells
        _libs.append(_rnn.install())
        from . import _group_norm  # a channels-last input's GroupNorm gradient as CPU computes it
        _libs.append(_group_norm.install())
        import sys
        from ._compat import hide_from_dynamo  # ember's kernels run below torch.compile, never in it
        hide_from_dynamo([m for n, m in list(sys.modules.items()) if n.startswith("ember.torch._")
                          and n != "ember.torch._compile"])
        _registered = True


__all__ = ["register", "EmberModule", "Stream"]
