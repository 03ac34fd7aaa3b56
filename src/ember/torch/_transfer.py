"""Where values cross the link: uploads, reads, data-dependent shapes, moves between Ember devices.

These are the only places ``ember.torch`` waits for a peer, and each is a point where
torch itself needs a value: ``.item()``, ``.cpu()``/printing, ``bool(t)``, a shape that
depends on data (``nonzero``, boolean masks). A CPU tensor copied to ``ember`` is
snapshotted when the copy is recorded, so changing it afterwards changes nothing.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import torch

from ..client.device import Device
from ..client.progress import choose
from ..protocol import aten as A
from ..protocol import messages as m
from . import _devices as D
from . import _known
from ._schema import OpInfo, info
from ._storage import StorageRef, dtype_name, live_session, new_tensor, ref_of

_OP = m.OP
_DTYPES = {dtype_name(d): d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                      torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                      torch.complex64, torch.complex128, torch.uint16, torch.uint32,
                                      torch.uint64)}


def _bytes_of(host: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 array (no copy)."""
    if host.dim() and host.numel() > 1:  # (one torch view and numpy's reshape: the cheap way, a batch's path)
        if host.stride(-1) != 1:  # contiguous, its last dim of size 1 with another stride (a channels-last 1x1 weight)
            host = host.reshape(-1)
        return host.view(torch.uint8).numpy().reshape(-1)
    flat = host.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # one element, any stride: still "contiguous" to torch
        flat = flat.clone(memory_format=torch.contiguous_format)
    return (flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device="cpu")).numpy()


def upload(src: torch.Tensor, dev: Device) -> torch.Tensor:
    """A CPU tensor's value as a new ember tensor on ``dev`` (contiguous, a storage of its own)."""
    D.check_torch(dev)
    host = src
    if src.requires_grad or src.is_conj() or src.is_neg() or not src.is_contiguous():
        host = src.detach().resolve_conj().resolve_neg().contiguous()
    s = dev.session
    nbytes = host.numel() * host.element_size()  # (an upload that rides in the batch shows no progress)
    data = _bytes_of(host)
    sid = s.upload(data, None if nbytes <= m.INLINE_DATA else choose(None, nbytes))
    r = StorageRef(sid, s, dev)
    if host.dtype in _known.EXACT or host.dtype in _known.FLOATS:
        _known.uploaded(r, data)
    return new_tensor(host.dtype, host.shape, host.stride(), 0, ref=r)


def _covers_storage(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.storage_offset() == 0 and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def copy_from_host(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(cpu_tensor)``: upload, straight into ``dst``'s storage when it covers all of it."""
    host = src.detach().resolve_conj().resolve_neg().to(dtype=dst.dtype).expand(dst.shape).contiguous()
    r = ref_of(dst)
    s = live_session(r)
    if _covers_storage(dst):
        data = _bytes_of(host)
        new = StorageRef(s.upload(data, choose(None, host.numel() * host.element_size())), s, r.device)
        if host.dtype in _known.EXACT or host.dtype in _known.FLOATS:
            _known.uploaded(new, data)
        dst.untyped_storage()._ember = new  # the old id (if it ever existed) is dropped with its ref
        return dst
    tmp = upload(host, r.device)
    torch.ops.aten.copy_.default(dst, tmp)
    return dst


def read(t: torch.Tensor, timeout: float | None = None) -> torch.Tensor:
    """The value of an ember tensor as a CPU tensor (one round trip)."""
    r = ref_of(t)
    if r.pending is not None:  # never written: the peer would allocate it zeroed
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu")
    v = _known.value(t, r) if getattr(r.session, "known", None) else None
    if v is not None:  # the client holds its bytes (_known.py): no round trip
        return v.clone()
    st = t.untyped_storage()
    need = t.numel() * t.element_size()
    src = t
    if not _covers_storage(t) and st.nbytes() > 2 * need + 4096:  # a small view of a big storage
        src = torch.ops.aten.clone.default(t, memory_format=torch.contiguous_format)
        r = ref_of(src)
    s = live_session(r)
    nbytes = src.untyped_storage().nbytes()
    _dt, _shape, _off, data, _total = s.request(m.READ, r.sid, timeout=timeout, progress=choose(None, nbytes),
                                                nbytes=nbytes)
    s.stats["reads"] += 1
    if isinstance(data, np.ndarray):  # assembled in place from data frames
        flat = torch.from_numpy(data.reshape(-1).view(np.uint8))
    else:
        flat = torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data), dtype=torch.uint8) \
            if len(data) else torch.empty(0, dtype=torch.uint8, device="cpu")
    typed = flat.view(t.dtype) if flat.numel() else torch.empty(0, dtype=t.dtype, device="cpu")
    out = torch.as_strided(typed, src.shape, src.stride(), src.storage_offset())
    return out if src is not t or _covers_storage(t) else out.clone()


#: torch dtype -> the ``struct`` format of one element (native order, as the peer sends its bytes).
_SCALAR_FORMATS = {torch.float32: "=f", torch.float64: "=d", torch.float16: "=e", torch.int64: "=q",
                   torch.int32: "=i", torch.int16: "=h", torch.int8: "=b", torch.uint8: "=B", torch.bool: "=?"}


def local_scalar(op: Any, t: torch.Tensor) -> Any:
    """``.item()``, ``bool(t)``, ``int(t)``: one read; the number is taken straight from the answer's bytes
    (no CPU tensor in between) for a one-element tensor of a small storage."""
    fmt = _SCALAR_FORMATS.get(t.dtype)
    r = ref_of(t)
    if getattr(r.session, "known", None):
        v = _known.value(t, r)
        if v is not None:  # the client holds its bytes (_known.py): no round trip
            return v.item()
    if fmt is None or r.pending is not None or t.numel() != 1 or t.untyped_storage().nbytes() > 4096:
        return read(t).item()
    s = live_session(r)
    data = s.request(m.READ, r.sid)[3]
    s.stats["reads"] += 1
    return struct.unpack_from(fmt, data, t.storage_offset() * t.element_size())[0]


def run_dynamic(i: OpInfo, operands: list[torch.Tensor], scalars: list[Any], template: list[Any],
                layouts: list[Any], values: list[Any]) -> Any:
    """An op whose output shapes depend on data: run it, then read its outputs' layouts (one round trip)."""
    if i.refused is not None:
        raise NotImplementedError(i.refused)
    if any(t == "List[Tensor]" for t in i.returns):
        raise NotImplementedError(f"{i.name}: a data-dependent list of outputs is not supported on ember tensors")
    refs = [ref_of(t) for t in operands]
    dev = D.device_of(refs, i)
    s = live_session(refs[0]) if refs else dev.session
    if i.seeded:
        D.apply_seed(s)
    for r in refs:
        if r.pending is not None:
            D.materialize(r)
    outs = [next(s.ids) for _ in range(len(i.returns) + 1)]
    s.record([_OP, i.name, [scalars, *[r.sid for r in refs]], 1, outs, {"a": template, "l": layouts, "o": None}])
    desc = _value(s, outs[-1]).reshape(-1).tolist()
    results: list[Any] = []
    k = 0
    for rtype, tid in zip(i.returns, outs):
        n = desc[k]
        k += 1
        if n == -1:
            s.release(tid)
            results.append(None)
        elif n == -2:
            v = _value(s, tid).reshape(()).item()
            results.append(bool(v) if rtype == "bool" else int(v) if rtype == "int" else v)
        else:
            size, stride, off, dt = desc[k:k + n], desc[k + n:k + 2 * n], desc[k + 2 * n], desc[k + 2 * n + 1]
            k += 2 * n + 2
            results.append(new_tensor(_DTYPES[A.DTYPES[dt]], size, stride, off, ref=StorageRef(tid, s, dev)))
    for k, j in _written_returns(i).items():  # out=: the result lands in the caller's tensor, resized
        out, res = values[j], results[k]
        if isinstance(out, torch.Tensor) and isinstance(res, torch.Tensor):
            torch.ops.aten.resize_.default(out, res.shape)
            torch.ops.aten.copy_.default(out, res)
            results[k] = out
    return results[0] if len(results) == 1 else tuple(results)


_written: dict[int, dict[int, int]] = {}


def _written_returns(i: OpInfo) -> dict[int, int]:
    """Return position -> schema argument position, for the returns that are written arguments (out=)."""
    w = _written.get(id(i.op))
    if w is None:
        schema = i.op._schema
        sets = {next(iter(a.alias_info.before_set)): n for n, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write and a.alias_info.before_set}
        w = _written[id(i.op)] = {k: sets[next(iter(r.alias_info.before_set))] for k, r in enumerate(schema.returns)
                                  if r.alias_info is not None and r.alias_info.before_set
                                  and next(iter(r.alias_info.before_set)) in sets}
    return w


def _value(s: Any, tid: int) -> np.ndarray:
    """Read a value the peer stored under ``tid`` (then drop it)."""
    dt, shape, _off, data, _total = s.request(m.READ, tid)
    s.release(tid)
    return np.frombuffer(bytes(data), dtype=np.dtype(dt)).reshape(shape)


def _contiguous(shape: list[int]) -> list[int]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return stride[::-1]


# ---- Ember devices and ember.array_api ---------------------------------------------------

def to_array(t: torch.Tensor) -> Any:
    """The tensor as an ``ember.array_api`` array on its device, sharing memory when contiguous."""
    from ..array_api import _dtypes
    from ..array_api._array import RemoteArray
    r = ref_of(t)
    s = live_session(r)
    if r.pending is not None:
        D.materialize(r)
    aid = next(s.ids)
    s.record([_OP, "torch.array_of", [r.sid], 0, [aid], {"l": [[list(t.shape), list(t.stride()),
                                                                t.storage_offset(), dtype_name(t.dtype)]]}])
    return RemoteArray(aid, tuple(t.shape), _dtypes.to_dtype(dtype_name(t.dtype)), r.device, s)


def from_array(a: Any) -> torch.Tensor:
    """An ``ember.array_api`` array on a torch device as an ember tensor (no data moves)."""
    from ..array_api._array import RemoteArray
    if not isinstance(a, RemoteArray):
        raise TypeError(f"from_array takes an ember.array_api array, got {type(a).__name__}")
    dev = a.device
    D.check_torch(dev)
    s = a._session
    sid = next(s.ids)
    s.record([_OP, "torch.storage_of", [a._id], 0, [sid], None])
    shape = list(a.shape)
    return new_tensor(_DTYPES[a.dtype.name], shape, _contiguous(shape), 0, ref=StorageRef(sid, s, dev))


def _move(t: torch.Tensor, dev: Device, **options: Any) -> torch.Tensor:
    """The tensor's storage bytes moved to ``dev`` the cheapest way the transfer layer knows."""
    D.check_torch(dev)
    if not _covers_storage(t):
        t = torch.ops.aten.clone.default(t, memory_format=torch.contiguous_format)
    flat = torch.ops.aten.view.dtype(t.reshape(-1), torch.uint8) if t.numel() else t
    moved = to_array(flat).to_device(dev, **options)
    out = from_array(moved)
    return new_tensor(t.dtype, t.shape, t.stride(), 0, storage=out.untyped_storage()) if t.numel() else \
        new_tensor(t.dtype, t.shape, t.stride(), 0, ref=StorageRef(next(dev.session.ids), dev.session, dev,
                                                                   pending=0))


class _ToDevice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, dev: Device, options: dict[str, Any]) -> torch.Tensor:
        ctx.src = ref_of(t).device
        return _move(t, dev, **options)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _move(grad, ctx.src), None, None


def to_device(t: torch.Tensor, dev: Device, **options: Any) -> torch.Tensor:
    """``t`` on Ember device ``dev`` (differentiable: gradients flow back to the source device).

    Same peer: an in-process hand-over; another peer: a direct peer-to-peer download; the
    embedded peer or ``via_client=True``: through this client. Options as for
    ``ember.array_api``'s ``to_device`` (``via_client``, ``downloads``, ``ttl``, ``timeout``).
    """
    if not isinstance(t, torch.Tensor) or t.device.type != "ember":
        raise TypeError("to_device moves ember tensors; use t.to('ember') for CPU tensors")
    if not isinstance(dev, Device):
        raise TypeError(f"to_device needs an ember Device (from ember.connect), got {type(dev).__name__}")
    if ref_of(t).device is dev:
        return t
    return _ToDevice.apply(t, dev, options)


def device_of(t: torch.Tensor) -> Device:
    """The Ember device (peer and index) an ember tensor lives on."""
    return ref_of(t).device


__all__ = ["upload", "read", "copy_from_host", "local_scalar", "run_dynamic", "to_array", "from_array", "to_device",
           "device_of", "info"]
