"""The few places torch needs telling how an ember tensor behaves, and the ops handled specially.

* Printing: torch formats a tensor element by element (about 40 remote ops and 38
  ``.item()`` round trips for one small tensor); an ember tensor is read once and the
  CPU copy formatted, with ``device='ember:0'`` in the suffix as CUDA shows it.
* ``torch.save``: an ember tensor pickles as its CPU copy, so a checkpoint loads on a
  machine without Ember (``weights_only=True`` included).
* ``torch.compile`` with the default backend: graphs on ember go to the ``ember`` backend (warned once).
* Pinning: ``ember`` is torch's accelerator; pinning a CPU tensor for it is a no-op.
* ``Module.to("ember")`` / ``.cpu()``: parameters keep their objects (tied weights stay tied,
  an optimizer made before the move trains them), swapped in place as torch swaps a subclass.
* Special ops: copies between ember and CPU (``copy_``, ``_copy_from``), ``.item()``,
  ``set_`` (client-side storage sharing), ``resize_`` (grows the peer's storage), pinning;
  ``conj()`` of a complex tensor is a copy (``conj_physical``), not torch's lazy conjugate view
  (whose fallback a Python device cannot serve).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch

from ..protocol import aten as A
from . import _devices as Dv
from . import _dispatch as D
from . import _known
from . import _sdpa
from . import _transfer as T
from ._schema import bound, info
from ._storage import StorageRef, layout_of, live_session, ref_of, ref_or_none, set_layout

aten = torch.ops.aten


def _set(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``set_`` only rebinds a tensor to a storage and layout: client-side, nothing to send."""
    i = info(op)
    values = bound(i, args, kwargs)
    for v in values[1:]:
        if isinstance(v, (torch.Tensor, torch.UntypedStorage)) and v.device.type != "ember":
            raise Dv.WrongDevice(f"{i.name}: cannot point an ember tensor at {v.device} memory")
    out = D.meta_call(i, values)
    st = values[0].untyped_storage()
    if getattr(st, "_ember", None) is None:  # set_() with no source: a fresh, empty storage
        dev = Dv.current_device()
        st._ember = StorageRef(next(dev.session.ids), dev.session, dev, pending=st.nbytes())
    return out


#: Ops that only change their operand's layout in place.
_INPLACE_VIEWS = ("as_strided_", "unsqueeze_", "squeeze_", "t_", "transpose_", "swapdims_", "swapaxes_")


def _inplace_view(op: Any, *args: Any, **kwargs: Any) -> Any:
    """An in-place view (``unsqueeze_``, ``as_strided_``...) of a tensor with no storage on a peer changes only its
    layout, here: torch.compile's functionalization fixes its wrappers' layouts so (``adaptive_avg_pool2d`` of a
    channels-last input runs ``mean(...).as_strided_(...)``; GroupNorm's backward ``unsqueeze_``). Any other call
    is an ordinary one."""
    if args and isinstance(args[0], torch.Tensor) and getattr(args[0].untyped_storage(), "_ember", None) is None:
        i = info(op)
        return D.meta_call(i, bound(i, args, kwargs))
    return D.kernel_generic(op, *args, **kwargs)


def _resize(op: Any, self: torch.Tensor, size: Any, memory_format: Any = None) -> Any:
    """``resize_``: relayout here; grow the peer's storage when the new layout needs more bytes."""
    r = ref_of(self)
    old, nbytes = layout_of(self), self.untyped_storage().nbytes()
    shaped = torch.empty(0, dtype=self.dtype, device="meta").resize_(size, memory_format=memory_format)
    off = self.storage_offset()
    need = (off + shaped.numel()) * self.element_size() if shaped.numel() else 0
    set_layout(self, self.untyped_storage(), off, shaped.shape, shaped.stride())
    if need > nbytes:
        if r.pending is not None:
            r.pending = need
        else:
            fmt = None if memory_format is None else str(memory_format)[6:]
            live_session(r).record([D._OP, "aten.resize_.default", [[], r.sid], 1, [],
                                    {"a": [0, list(shaped.shape), fmt], "l": [old], "o": []}])
    return self


def _on_its_device(op: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``clone``, ``_to_copy``: torch's own composite, with its ``empty_strided`` on the operand's
    Ember device (not the current one; on torch's autograd thread the current one is a guess)."""
    composite = torch._C.DispatchKey.CompositeExplicitAutograd
    if kwargs.get("non_blocking"):  # torch would pin a CPU destination: a copy from ember is one read and
        kwargs["non_blocking"] = False  # one to ember is ordered in the batch anyway, so it blocks no more
    if self.device.type != "ember":  # CPU -> ember: the target is the current device, as before
        if op is aten._to_copy.default and not args and _plain_upload(self, kwargs):
            dtype = kwargs.get("dtype")
            return T.upload(self if dtype in (None, self.dtype) else self.to(dtype), Dv.current_device())
        return op._op_dk(composite, self, *args, **kwargs)
    with ref_of(self).device:  # (the innermost `with dev:` is where factory ops run)
        res = op._op_dk(composite, self, *args, **kwargs)
    if type(res) is torch.Tensor and res.dtype in _known.EXACT:  # (a known mask cast or cloned stays known)
        _known.follow(op, (self, *args), kwargs, res)
    return res


def _plain_upload(self: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """``_to_copy`` of a CPU tensor to ember whose result torch makes contiguous, nothing else asked: one
    upload, as the composite's empty tensor + copy would send, without them (a training loop's batch,
    every step, often a slice: ``idx[:, :-1]``). Contiguous results: a contiguous tensor; any tensor under
    ``contiguous_format``; under ``preserve_format``, one that is not dense (torch keeps only a dense
    tensor's strides), below 4 dims (where torch might choose channels-last instead)."""
    fmt = kwargs.get("memory_format")
    return self.device.type == "cpu" and self.layout == torch.strided and \
        kwargs.get("layout") in (None, torch.strided) and not kwargs.get("pin_memory") and \
        set(kwargs) <= _UPLOAD_KWARGS and (
            self.is_contiguous() and fmt in (None, torch.preserve_format, torch.contiguous_format)
            or fmt is torch.contiguous_format
            or fmt in (None, torch.preserve_format) and self.dim() < 4 and not A.dense(self.shape, self.stride()))


_UPLOAD_KWARGS = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"})


def _pin(op: Any, self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("cannot pin an ember tensor: only dense CPU tensors can be pinned")


def _copy(op: Any, dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
    """``aten.copy_`` and ``aten._copy_from``: between ember and CPU tensors, or two Ember devices."""
    if op is torch.ops.aten._copy_from.default:  # _copy_from(self=src, dst)
        src, dst = dst, src
    if not isinstance(src, torch.Tensor):
        return D.kernel_generic(torch.ops.aten.copy_.default, dst, src, non_blocking)
    d_ember, s_ember = dst.device.type == "ember", src.device.type == "ember"
    if d_ember and not s_ember:
        if src.dim() == 0 and src.device.type == "cpu":
            return D.kernel_generic(torch.ops.aten.copy_.default, dst, T.upload(src, ref_of(dst).device))
        if src.device.type != "cpu":
            src = src.cpu()
        return T.copy_from_host(src, dst)
    if s_ember and not d_ember:
        return dst.copy_(T.read(src), non_blocking=non_blocking)
    if ref_of(src).device is not ref_of(dst).device:
        src = T.to_device(src, ref_of(dst).device)
    return D.kernel_generic(torch.ops.aten.copy_.default, dst, src, non_blocking)


def _foreach_copy_(op: Any, dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    """``torch._foreach_copy_``: one op when every tensor is on one Ember device; across devices (an EMA's CPU
    copies restored: diffusers' ``EMAModel.restore``) a ``copy_`` per pair, as torch's slow path does on CUDA."""
    refs = [ref_or_none(t) for t in (*dst, *src)]
    if refs and all(r is not None and r.device is refs[0].device for r in refs):
        return D.kernel_generic(op, dst, src, non_blocking)
    if len(dst) != len(src):
        raise RuntimeError(f"_foreach_copy_: tensor lists must have the same length, got {len(dst)} and {len(src)}")
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking)
    return None


class _Special:
    """``S[op] = handler`` files the handler under the overload's identity (see ``_dispatch.SPECIAL``)."""

    def __setitem__(self, op: Any, fn: Any) -> None:
        D.SPECIAL[id(op)] = fn


def _install_ops() -> None:
    S = _Special()
    for op in (aten.copy_.default, aten._copy_from.default):
        S[op] = _copy
    S[aten._foreach_copy_.default] = _foreach_copy_
    S[aten._copy_from_and_resize.default] = lambda op, src, dst: (
        dst.resize_(src.shape), _copy(aten.copy_.default, dst, src))[1]
    S[aten._local_scalar_dense.default] = T.local_scalar
    for name in ("default", "source_Storage", "source_Storage_storage_offset", "source_Tensor",
                 "source_Tensor_storage_offset"):
        ov = getattr(aten.set_, name, None)
        if ov is not None:
            S[ov] = _set
    S[aten.resize_.default] = _resize
    for packet in _INPLACE_VIEWS:
        for name in getattr(aten, packet).overloads():
            S[getattr(getattr(aten, packet), name)] = _inplace_view
    S[aten.resize_as_.default] = lambda op, self, other, memory_format=None: _resize(
        op, self, other.shape, memory_format)
    S[aten.is_pinned.default] = lambda op, self, device=None: False
    S[aten._pin_memory.default] = _pin
    S[aten.record_stream.default] = lambda op, *a, **k: None
    S[aten._fused_sdp_choice.default] = _sdpa.choice
    S[aten._native_multi_head_attention.default] = _sdpa.native_mha
    S[aten.clone.default] = S[aten._to_copy.default] = _on_its_device
    # ember tensors never carry torch's lazy conjugate/negative bits: conj() and _neg_view() copy
    S[aten._conj.default] = lambda op, x: D.kernel_generic(aten.conj_physical.default, x)
    S[aten._neg_view.default] = lambda op, x: D.kernel_generic(aten.neg.default, x)
    S[aten.addbmm_.default] = _addbmm_
    # nested tensors are not held: an eval-mode TransformerEncoder with a padding mask asks whether the mask suits
    # them (its "sparsity fast path"); "no" runs its dense path, the one enable_nested_tensor=False takes
    S[aten._nested_tensor_from_mask_left_aligned.default] = lambda op, *a, **k: False


def _addbmm_(op: Any, self: torch.Tensor, b1: torch.Tensor, b2: torch.Tensor, *, beta: Any = 1,
             alpha: Any = 1) -> torch.Tensor:
    """CPU's ``addbmm_`` runs as ``addbmm.out(self, out=self)``: a ``self`` that only broadcasts (one element) is
    resized to the result, as there."""
    if b1.dim() == 3 and b2.dim() == 3 and list(self.shape) != [b1.shape[1], b2.shape[2]]:
        r = D.kernel_generic(aten.addbmm.default, self, b1, b2, beta=beta, alpha=alpha)
        self.resize_(r.shape)
        return self.copy_(r)
    return D.kernel_generic(op, self, b1, b2, beta=beta, alpha=alpha)


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


_saving = threading.local()  # .storages: ember storage identity -> (its CPU copy, the storage), for one torch.save


def _install_save() -> None:
    """An ember tensor pickles as a CPU tensor: a checkpoint loads anywhere, ``weights_only=True`` too. Within one
    ``torch.save`` each ember storage is read once, whole, and every tensor on it saved as a view of that one CPU
    storage, as torch saves CPU and CUDA storages: a view saved beside its base stays its view when loaded, and the
    file holds the bytes once. (Pickled outside ``torch.save``, a tensor is its own copy.)"""
    original, original_save = torch.Tensor._reduce_ex_internal, torch.serialization.save
    if getattr(original, "_ember", False):
        return

    def _reduce_ex_internal(self: torch.Tensor, proto: int) -> Any:
        if self.device.type != "ember":
            return original(self, proto)
        storages = getattr(_saving, "storages", None)
        st = self.untyped_storage()
        if storages is None or getattr(st, "_ember", None) is None:
            host = T.read(self.detach())
        else:
            copy = storages.get(st.data_ptr())
            if copy is None:
                whole = D.new_tensor(torch.uint8, [st.nbytes()], [1], 0, storage=st)
                copy = storages[st.data_ptr()] = (T.read(whole).untyped_storage(), st)
            host = torch.empty(0, dtype=self.dtype, device="cpu").set_(copy[0], self.storage_offset(), self.shape,
                                                                       self.stride())
        return host.requires_grad_(self.requires_grad)._reduce_ex_internal(proto)

    @functools.wraps(original_save)
    def save(*args: Any, **kwargs: Any) -> Any:
        if getattr(_saving, "storages", None) is not None:
            return original_save(*args, **kwargs)
        _saving.storages = {}
        try:
            return original_save(*args, **kwargs)
        finally:
            _saving.storages = None

    _reduce_ex_internal._ember = True  # type: ignore[attr-defined]
    torch.Tensor._reduce_ex_internal = _reduce_ex_internal  # type: ignore[method-assign]
    torch.serialization.save = torch.save = save  # type: ignore[assignment]


#: the high bits of an ember storage's ``data_ptr``: an identity, never an address of this process
_STORAGE_ID = 0x7E00 << 48


def _install_storage_ids() -> None:
    """``UntypedStorage.data_ptr()`` of an ember storage is its identity: one value per storage (views and
    ``detach`` share it), unlike any other live storage's, in a range no allocation gets (not an address: the
    bytes are on a peer). Hugging Face's ``save_pretrained`` (and safetensors, accelerate) tell tied weights
    apart by ``(device, storage data_ptr)``; torch raised "invalid python storage" for a null-data storage."""
    original = torch.UntypedStorage.data_ptr
    if getattr(original, "_ember", False):
        return

    def data_ptr(self: Any) -> int:
        r = getattr(self, "_ember", None)
        return original(self) if r is None else _STORAGE_ID | (id(r) & ((1 << 48) - 1))
    data_ptr._ember = True  # type: ignore[attr-defined]
    torch.UntypedStorage.data_ptr = data_ptr  # type: ignore[method-assign]
    tensor_ptr = torch.Tensor.data_ptr

    def tensor_data_ptr(self: Any) -> int:
        """An ember tensor's ``data_ptr()``: its storage's identity plus its offset in bytes, as a CPU tensor's is
        its storage's address plus it (safetensors, and accelerate's ``save_state``, check one against the
        other; it was the offset alone)."""
        if self.device.type != "ember":
            return tensor_ptr(self)
        st = self.untyped_storage()
        if getattr(st, "_ember", None) is None:  # (a FakeTensor on ember, under torch.compile: torch's own answer)
            return tensor_ptr(self)
        return st.data_ptr() + self.storage_offset() * self.element_size()
    torch.Tensor.data_ptr = tensor_data_ptr  # type: ignore[method-assign]


def _install_storage_copies() -> None:
    """An ember storage made or copied as a storage: ``UntypedStorage(n, device="ember")`` (a zeroed storage of
    the current Ember device, allocated on first use) and ``storage.clone()``, which ``copy.deepcopy`` of a tensor
    uses (a ``state_dict``, a model's buffers, an EMA copy; views of one storage stay views of one copy). torch
    built both through its allocator, which a Python device does not have: the process died (SIGSEGV)."""
    base_new, base_clone = torch._C.StorageBase.__new__, torch.UntypedStorage.clone
    if getattr(base_clone, "_ember", False):
        return

    def new(cls: Any, *args: Any, device: Any = None, **kwargs: Any) -> Any:
        if device is None or torch.device(device).type != "ember":
            return base_new(cls, *args, **kwargs, **({} if device is None else {"device": device}))
        if cls is not torch.UntypedStorage or len(args) != 1 or type(args[0]) is not int or args[0] < 0 or kwargs:
            raise NotImplementedError("an ember storage is made as UntypedStorage(nbytes, device='ember') only")
        dev = Dv.current_device()
        s = dev.session
        return D.new_tensor(torch.uint8, [args[0]], [1], 0,
                            ref=StorageRef(next(s.ids), s, dev, pending=args[0])).untyped_storage()

    def clone(self: Any) -> Any:
        if getattr(self, "_ember", None) is None:
            return base_clone(self)
        return D.new_tensor(torch.uint8, [self.nbytes()], [1], 0, storage=self).clone().untyped_storage()
    clone._ember = True  # type: ignore[attr-defined]
    torch.UntypedStorage.__new__ = new  # type: ignore[method-assign]
    torch.UntypedStorage.clone = clone  # type: ignore[method-assign]


def _install_pinning() -> None:
    """``ember`` is torch's accelerator, so ``DataLoader(pin_memory=True)`` pins each batch for it:
    pinning a CPU tensor for ember is a no-op (the tensor itself is returned; a host-to-peer copy is
    serialized either way, so page-locked memory would gain nothing), pinning for another device is
    torch's own."""
    original_pin, original_is_pinned = torch.Tensor.pin_memory, torch.Tensor.is_pinned
    if getattr(original_pin, "_ember", False):
        return

    def for_ember(device: Any) -> bool:
        return torch.device(device).type == "ember" if device is not None else \
            torch._C._get_privateuse1_backend_name() == getattr(torch.accelerator.current_accelerator(), "type", None)

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        return self if self.device.type == "cpu" and for_ember(device) else original_pin(self, *(
            () if device is None else (device,)))

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        return False if self.device.type == "cpu" and for_ember(device) else original_is_pinned(self, *(
            () if device is None else (device,)))

    pin_memory._ember = True  # type: ignore[attr-defined]
    torch.Tensor.pin_memory, torch.Tensor.is_pinned = pin_memory, is_pinned  # type: ignore[method-assign]


def _install_accelerator_memory() -> None:
    """``torch.accelerator``'s memory functions with ember as the accelerator: this process holds no
    allocator for ember (a tensor's memory is its peer's, charged to the session's budget there), so
    they answer as torch does for an accelerator whose allocator was never initialized — ``empty_cache``
    and the ``reset_*`` calls do nothing, ``memory_stats`` is empty, ``memory_allocated`` 0 — instead of
    failing torch's internal assert (accelerate's ``free_memory`` calls them); ``get_memory_info`` raises
    ``NotImplementedError``. Other accelerators are untouched."""
    C = torch._C
    initialized, info = C._accelerator_isAllocatorInitialized, C._accelerator_getMemoryInfo
    if getattr(initialized, "_ember", False):
        return

    def is_ember() -> bool:
        return C._get_privateuse1_backend_name() == getattr(torch.accelerator.current_accelerator(), "type", None)

    def is_allocator_initialized() -> bool:
        return False if is_ember() else initialized()

    def get_memory_info(*args: Any) -> Any:
        if is_ember():
            raise NotImplementedError("torch.accelerator.get_memory_info: an ember tensor's memory is its peer's; "
                                      "this process holds no allocator for it (see `ember top` for a peer's memory)")
        return info(*args)

    is_allocator_initialized._ember = True  # type: ignore[attr-defined]
    C._accelerator_isAllocatorInitialized, C._accelerator_getMemoryInfo = is_allocator_initialized, get_memory_info


WARNED_COMPILE: list[bool] = []  # the default-backend warning was given


def _install_default_compile() -> None:
    """``torch.compile(model)`` with the default backend: inductor generates kernels for local devices
    and cannot build for ember, so a graph with ember inputs goes to the ``ember`` backend instead
    (bit-equal to eager), with a one-time warning; other graphs stay inductor's."""
    wrapper = torch._TorchCompileInductorWrapper
    original = wrapper.__call__
    if getattr(original, "_ember", False):
        return
    warned = WARNED_COMPILE

    def __call__(self: Any, model_: Any, inputs_: Any, **kwargs: Any) -> Any:
        if not any(getattr(getattr(t, "device", None), "type", None) == "ember" for t in inputs_):
            return original(self, model_, inputs_, **kwargs)
        if not warned:
            warned.append(True)
            import warnings
            warnings.warn("torch.compile: the default (inductor) backend cannot build kernels for ember tensors; "
                          "compiling them with backend=\"ember\" instead (pass it to say so and silence this)",
                          UserWarning, stacklevel=2)
        from ._compile import compiler
        return compiler(model_, inputs_)

    __call__._ember = True  # type: ignore[attr-defined]
    wrapper.__call__ = __call__  # type: ignore[method-assign]


_crossing = threading.local()  # the (param, applied) pair Module._apply is deciding about


def _install_module_apply() -> None:
    """``Module._apply`` keeps a parameter object (``param.data = applied``) only when torch deems the
    two tensor types shallow-copy compatible, which a CPU and a PrivateUse1 tensor never are (CPU and
    CUDA are): it would make a new Parameter, untying shared weights. For a move between ember and
    another device, the parameter is swapped in place instead (``torch.utils.swap_tensors``, torch's
    own path for tensor subclasses), when the swap can succeed."""
    import torch.nn.modules.module as mm
    compatible, is_wrapper = torch._has_compatible_shallow_copy_type, mm.is_traceable_wrapper_subclass
    if getattr(compatible, "_ember", False):
        return

    def _has_compatible_shallow_copy_type(input: torch.Tensor, from_: torch.Tensor) -> bool:  # noqa: A002
        ok = compatible(input, from_)  # (torch's own names: Dynamo checks the signature)
        _crossing.pair = None if ok or (input.device.type == "ember") == (from_.device.type == "ember") or \
            weakref.getweakrefs(input) or input._use_count() > 2 else (input, from_)
        return ok

    def is_traceable_wrapper_subclass(t: Any) -> bool:
        pair, _crossing.pair = getattr(_crossing, "pair", None), None
        return is_wrapper(t) or pair is not None and pair[1] is t and isinstance(pair[0], torch.nn.Parameter)

    _has_compatible_shallow_copy_type._ember = True  # type: ignore[attr-defined]
    torch._has_compatible_shallow_copy_type = _has_compatible_shallow_copy_type
    mm.is_traceable_wrapper_subclass = is_traceable_wrapper_subclass


def _install_threads() -> None:
    """``torch.set_num_threads`` on the main thread also sets the embedded peer's kernels' thread count
    (``server.execute.aten.THREADS``, first taken here, from the main thread that imports ``ember.torch``): the
    user's choice, never that of a helper thread such as a pin-memory ``DataLoader``'s, which sets 1
    process-wide. Every embedded peer follows it, the default device and ``ember.connect("local:torch")``
    alike: a GEMM split over another number of threads rounds otherwise (a float64 ``nn.GRU``'s input
    projection was 6e-17 off in one row of six)."""
    from ..server.execute import aten as peer_aten
    orig = torch.set_num_threads
    if peer_aten.THREADS[0] is None and threading.current_thread() is threading.main_thread():
        peer_aten.THREADS[0] = torch.get_num_threads()

    @functools.wraps(orig)
    def set_num_threads(n: int) -> None:
        orig(n)
        if threading.current_thread() is threading.main_thread() and peer_aten.THREADS[0] is not None:
            peer_aten.THREADS[0] = torch.get_num_threads()
    torch.set_num_threads = set_num_threads


def _install_backward_thread() -> None:
    """A backward pass from ember roots runs on the calling thread (torch's ``set_multithreading_enabled
    (False)`` for its duration), not on autograd's PrivateUse1 device thread: every ember kernel is Python,
    so each node there cost a GIL hand-off between two threads. The engine's graph and its order of
    nodes are unchanged (one thread runs them either way), and so are the results. Measured, eager over
    TCP against local CPU torch, alternating: 2-layer GPT 0.43 -> 0.71x, LSTM 0.45 -> 0.58x, MLP 0.52 ->
    0.56x on a loaded box; on a quiet one GPT and LSTM the same, MLP 0.49 -> 0.53x."""
    import torch.autograd as autograd
    run = autograd._engine_run_backward
    if getattr(run, "_ember", False):
        return
    is_on, set_on, Tensor = torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled, torch.Tensor

    @functools.wraps(run)
    def _engine_run_backward(t_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_on() or not any(isinstance(t, Tensor) and t.device.type == "ember" for t in t_outputs):
            return run(t_outputs, *args, **kwargs)
        set_on(False)
        try:
            return run(t_outputs, *args, **kwargs)
        finally:
            set_on(True)
    _engine_run_backward._ember = True  # type: ignore[attr-defined]
    autograd._engine_run_backward = _engine_run_backward


def install() -> list[Any]:
    """Install the patches; returns the torch.library registrations to keep alive."""
    lib = torch.library.Library("aten", "IMPL")
    _sdpa.register(lib)
    _install_ops()
    _install_accelerator_memory()
    _install_print()
    _install_save()
    _install_storage_ids()
    _install_storage_copies()
    _install_module_apply()
    _install_pinning()
    _install_default_compile()
    _install_threads()
    from . import _cpu_paths
    _cpu_paths.install()
    _install_backward_thread()
    from . import _across_peers, _checkpoint
    _checkpoint.install()
    _across_peers.install_clip_grad()
    return [lib]


__all__ = ["install"]
