"""The few places torch needs telling how an ember tensor behaves, and the ops handled specially.

* Printing: torch formats a tensor element by element (about 40 remote ops and 38
  ``.item()`` round trips for one small tensor); an ember tensor is read once and the
  CPU copy formatted, with ``device='ember:0'`` in the suffix as CUDA shows it.
* ``torch.save``: an ember tensor pickles as its CPU copy, so a checkpoint loads on a
  machine without Ember (``weights_only=True`` included).
* Special ops: copies between ember and CPU (``copy_``, ``_copy_from``), ``.item()``,
  ``set_`` (client-side storage sharing), ``resize_`` (grows the peer's storage), pinning.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _dispatch as D
from . import _transfer as T
from ._schema import bound, info
from ._storage import StorageRef, layout_of, ref_of

aten = torch.ops.aten


def _set(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``set_`` only rebinds a tensor to a storage and layout: client-side, nothing to send."""
    i = info(op)
    values = bound(i, args, kwargs)
    for v in values[1:]:
        if isinstance(v, (torch.Tensor, torch.UntypedStorage)) and v.device.type != "ember":
            raise D.WrongDevice(f"{i.name}: cannot point an ember tensor at {v.device} memory")
    out = D.meta_call(i, values)
    st = values[0].untyped_storage()
    if getattr(st, "_ember", None) is None:  # set_() with no source: a fresh, empty storage
        dev = D.current_device()
        st._ember = StorageRef(next(dev.session.ids), dev.session, dev, pending=st.nbytes())
    return out


def _resize(op: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``resize_`` / ``resize_as_``: relayout here; grow the peer's storage when it needs more bytes."""
    i = info(op)
    r = ref_of(self)
    old, nbytes = layout_of(self), self.untyped_storage().nbytes()
    D.meta_call(i, bound(i, (self, *args), kwargs))
    grown = self.untyped_storage().nbytes()
    if grown > nbytes:
        if r.pending is not None:
            r.pending = grown
        else:
            s = D.live_session(r)
            s.record([D._OP, "aten.resize_.default", [r.sid], 0, [],
                      {"a": [0, list(self.shape), None], "l": [old], "o": []}])
    return self


def _pin(op: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("cannot pin an ember tensor: only dense CPU tensors can be pinned")


def _install_ops() -> None:
    S = D.SPECIAL
    for op in (aten.copy_.default, aten._copy_from.default):
        S[op] = T.copy_
    S[aten._copy_from_and_resize.default] = lambda op, src, dst: (
        dst.resize_(src.shape), T.copy_(aten.copy_.default, dst, src))[1]
    S[aten._local_scalar_dense.default] = T.local_scalar
    for name in ("default", "source_Storage", "source_Storage_storage_offset", "source_Tensor",
                 "source_Tensor_storage_offset"):
        ov = getattr(aten.set_, name, None)
        if ov is not None:
            S[ov] = _set
    S[aten.resize_.default] = _resize
    S[aten.resize_as_.default] = lambda op, self, other, **k: _resize(aten.resize_.default, self, other.shape)
    S[aten.is_pinned.default] = lambda op, self, device=None: False
    S[aten._pin_memory.default] = _pin
    S[aten.record_stream.default] = lambda op, *a, **k: None


def _install_print() -> None:
    import torch._tensor_str as ts
    original = ts._tensor_str
    if getattr(original, "_ember", False):
        return

    def _tensor_str(self: torch.Tensor, indent: int) -> str:
        if self.device.type == "ember":
            self = T.read(self)  # one read; the suffix still says device='ember:0'
        return original(self, indent)

    _tensor_str._ember = True  # type: ignore[attr-defined]
    ts._tensor_str = _tensor_str


def _install_save() -> None:
    original = torch.Tensor._reduce_ex_internal
    if getattr(original, "_ember", False):
        return

    def _reduce_ex_internal(self: torch.Tensor, proto: int) -> Any:
        if self.device.type == "ember":  # saved as CPU tensors: loads anywhere, weights_only=True too
            host = T.read(self.detach())
            return host.requires_grad_(self.requires_grad)._reduce_ex_internal(proto)
        return original(self, proto)

    _reduce_ex_internal._ember = True  # type: ignore[attr-defined]
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal  # type: ignore[method-assign]


def install() -> None:
    _install_ops()
    _install_print()
    _install_save()


__all__ = ["install"]
