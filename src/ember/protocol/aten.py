"""The ATen op stream of ``ember.torch``, sans-I/O: how one ATen call travels in an ``OP`` message.

The PyTorch frontend records every ATen call below autograd as an ordinary ``OP``
message, so batching, poisoning, drops, heartbeats and graph caching carry it
unchanged. The remote object is a *storage* (a flat byte buffer), never a tensor:
a tensor operand is a storage id plus a *layout* ``[size, stride, offset, dtype]``
(offset and strides in elements of ``dtype``). Views therefore cost no message.

``[OP, name, args, smask, outs, kwargs]`` for an ATen call:

* ``name``: ``"aten.<op>.<overload>"`` (``default`` for the default overload), or an
  internal name of :data:`INTERNAL`.
* ``args``: first the list of the values of the call's *scalar slots*, in schema order
  (``smask`` is 1: that list is the message's one literal), then the storage id of each
  tensor operand in schema order. Scalars that change from call to call (a learning
  rate, Adam's bias corrections) are thus graph scalars, not structure.
* ``outs``: a fresh storage id for each output the client classified *fresh*.
* ``kwargs``: ``{"a": template, "l": layouts, "o": out_specs}``:

  - ``a``: one entry per schema argument, in schema order (keyword-only ones too),
    read with the argument's :func:`category`: ``TENSOR``: ``0`` the next tensor
    operand, ``1`` the next scalar (a Python number in a Tensor slot), ``None``;
    ``TENSOR_LIST`` / ``OPT_TENSOR_LIST``: a list of such entries; ``SCALAR``: ``1`` the
    next scalar, or ``None``; ``SCALAR_LIST``: the number of scalars it takes, or
    ``None``; ``LITERAL``: the value (ints, bools and lists of them); ``STRING``: a str;
    ``DTYPE`` / ``MEMORY_FORMAT`` / ``LAYOUT``: a name of :data:`DTYPES` /
    :data:`MEMORY_FORMATS` / ``"strided"``; ``DEVICE``: ``None`` or ``1`` (the peer's own
    device); ``GENERATOR``: ``None`` (the peer uses the session's generator).
  - ``l``: the layout of each tensor operand, in the order of ``args``.
  - ``o``: ``[position, size, stride, offset, dtype, nbytes]`` per fresh output
    (``position`` in the op's flattened returns); the peer stores the result in that
    layout in a storage of ``nbytes`` bytes. ``None``: the client could not infer the
    outputs (data-dependent shapes): ``outs`` has one id per return plus one more; the
    peer stores each tensor output as a storage (a non-tensor result as a 0-d value)
    and under the last id an int64 vector describing them (per output ``-1`` undefined,
    ``-2`` a value, or ``ndim, *size, *stride, offset, index into DTYPES``), which the
    client reads: one round trip.

A complex scalar travels as ``[real, imag]``. Non-tensor results (``aten.equal``,
``aten._local_scalar_dense``...) are stored as 0-d values and read back.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources
from typing import Any

(TENSOR, TENSOR_LIST, SCALAR, SCALAR_LIST, LITERAL, STRING, DTYPE, MEMORY_FORMAT, LAYOUT, DEVICE,
 GENERATOR) = range(11)

#: Schema argument type (``str(argument.real_type)``) -> category. Anything else: the op is refused.
CATEGORY: dict[str, int] = {
    "Tensor": TENSOR, "Optional[Tensor]": TENSOR,
    "List[Tensor]": TENSOR_LIST, "List[Optional[Tensor]]": TENSOR_LIST,
    "number": SCALAR, "float": SCALAR, "Optional[number]": SCALAR, "Optional[float]": SCALAR,
    "complex": SCALAR, "Optional[complex]": SCALAR,
    "List[number]": SCALAR_LIST, "List[float]": SCALAR_LIST, "Optional[List[float]]": SCALAR_LIST,
    "int": LITERAL, "Optional[int]": LITERAL, "List[int]": LITERAL, "Optional[List[int]]": LITERAL,
    "bool": LITERAL, "Optional[bool]": LITERAL, "List[bool]": LITERAL,
    "str": STRING, "Optional[str]": STRING,
    "ScalarType": DTYPE, "Optional[ScalarType]": DTYPE,
    "MemoryFormat": MEMORY_FORMAT, "Optional[MemoryFormat]": MEMORY_FORMAT,
    "Layout": LAYOUT, "Optional[Layout]": LAYOUT,
    "Device": DEVICE, "Optional[Device]": DEVICE,
    "Optional[Generator]": GENERATOR,
}

#: Return types an op may have (tensors, or values read back).
RETURNS = frozenset({"Tensor", "List[Tensor]", "int", "bool", "float", "number"})

DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
          "bfloat16", "float32", "float64", "complex32", "complex64", "complex128")
MEMORY_FORMATS = ("contiguous_format", "preserve_format", "channels_last", "channels_last_3d")

INTERNAL = frozenset({"torch.alloc", "torch.seed", "torch.storage_of", "torch.array_of", "torch.rnn_layer",
                      "torch.rnn_layer_backward", "torch.sparse_mm", "torch.sparse_add", "torch.rng_state",
                      "torch.set_rng_state"})
"""Ember's own torch ops: ``alloc`` (a zeroed storage of ``kwargs["n"]`` bytes), ``seed``
(reseed the session's generator), ``storage_of`` (a storage holding a value's bytes, C order),
``array_of`` (a contiguous value, for ``ember.array_api``, from an operand's layout),
``rnn_layer`` and ``rnn_layer_backward`` (one ``gru`` / ``rnn_tanh`` / ``rnn_relu`` layer and its gradients,
with feature ``"rnn_layers"``: ``server/execute/rnn_recompute.py``), ``sparse_mm`` (a sparse COO matrix, as its
indices and values, times a dense one, with feature ``"sparse_mm"``: ``server/execute/sparse_mm.py``), ``sparse_add``
(a dense tensor plus a scaled sparse one, an optimizer's step on a sparse gradient, with feature ``"sparse_add"``: the
same file),
``rng_state`` / ``set_rng_state`` (the session's random stream saved into a storage and set from one, with
feature ``"rng_state"``: ``torch.utils.checkpoint`` replays a dropout's mask)."""

DENY = re.compile(r"from_file|unsafe|as_strided|^set_|pin_memory|is_pinned|record_stream|^empty|^new_empty|_obs_fq_|"
                  r"^_empty|_nested|sparse|mkldnn|quantiz|^q_|^_cufft|^_copy_from|^_to_cpu|^_print|^_debug|"
                  r"^_assert|^sym_|_efficientzerotensor|^_cudnn_init|^_fill_mem_eff|^lift|^_convert_indices_from|"
                  r"^_reshape_alias|^_cummax_helper|^_cummin_helper|nnpack|^_dyn_quant|int4pack|int8pack|"
                  r"^_new_zeros_with_same_feature_meta")
"""Ops (the name between ``aten.`` and the overload) a peer never runs, whatever their arguments:
files, memory left uninitialised or mapped, unchecked access, pinned/sparse/quantized/nested
tensors (``_fused_moving_avg_obs_fq_helper``: a fake-quantize observer), and ops only the client performs (copies
across devices, metadata). Internal kernels that trust their arguments and that no client sends are refused too: views
in disguise (``_reshape_alias``: ``as_strided`` by another name), ``_cummax_helper`` / ``_cummin_helper`` (write
``self``'s length into the outputs as given), NNPACK's convolution (a stride of 0 divides by zero), the int4 / int8
weight-packing kernels and ``_new_zeros_with_same_feature_meta`` (unchecked dims). Each crashed a peer with one
message."""

DENY_EXCEPT = frozenset({"aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default"})
"""Overloads :data:`DENY`'s name patterns would refuse that a peer runs: oneDNN's LSTM layer and its backward,
the kernels CPU torch itself runs for ``nn.LSTM``, take and return plain strided tensors; the peer checks
their operands' sizes against each other first (``server/execute/rnn_layer.py``)."""

INTERNAL_OPS_FILE = "aten_internal_ops.txt"


@lru_cache(maxsize=1)
def internal_ops() -> frozenset[str]:
    """The internal ATen ops (named ``_...``) a peer runs, any overload: those torch's public Python API sends a
    device's kernel, forward and backward, and those ember.torch itself sends, as listed in
    :data:`INTERNAL_OPS_FILE` beside this module (``bench/list_aten_ops.py`` makes it). An allowlist: ATen has some
    700 internal kernels, many written for one caller that checked their arguments first (``_cummax_helper``
    writes its input's length into the outputs as given); one not listed is refused by name, whatever
    :data:`DENY` misses. Public ops are refused by :data:`DENY` and checked by the peer (``server/execute``)."""
    text = resources.files(__package__).joinpath(INTERNAL_OPS_FILE).read_text()
    return frozenset(w for w in (line.split("#")[0].strip() for line in text.splitlines()) if w)


UNMARKED_WRITES = {"aten.native_batch_norm.default": frozenset({"running_mean", "running_var"})}
"""Overloads that write arguments their schema does not mark (by argument name): ``native_batch_norm`` updates
its running statistics in place. Client and peer count them written: a read of them never overtakes the call
(``server/read_ahead.py``), a value the client knew is forgotten, a failed call poisons them."""

MAX_DIMS = 64
MAX_ELEMENTS = 1 << 36
"""Most elements a layout may describe (a stride-0 view of 2^62 elements on one byte passed the extent check, and a
``sum`` over it never ended): 6.9e10, more than any one device holds materialised."""
MAX_LIST = 1 << 16
INT64 = (-(1 << 63), (1 << 63) - 1)


def category(real_type: str) -> int | None:
    """The category of a schema argument type, or None when ops taking it are refused."""
    return CATEGORY.get(real_type)


def refusal(name: str, arg_types: list[tuple[str, str]], return_types: list[str]) -> str | None:
    """Why the overload ``name`` (``aten.<op>.<overload>``) may not run on a peer, or None.

    ``arg_types``: ``(argument name, str(real_type))`` per schema argument; ``return_types``: the
    returns' types. The peer applies this to every call; the client to every op it records, so a
    refused op fails at the call, where the user looks.
    """
    op = name.split(".")[1]
    if "sparse" in op:
        return (f"ATen op {name} makes or takes sparse tensors, which Ember peers do not hold "
                "(ember tensors are strided)")
    if "_nested" in op:
        return (f"ATen op {name} makes or takes nested tensors, which Ember peers do not hold (ember tensors are "
                "strided; nn.TransformerEncoder(enable_nested_tensor=False) keeps its padding mask dense)")
    if ("quantiz" in op or "_obs_fq_" in op) and name not in DENY_EXCEPT:
        return (f"ATen op {name} quantizes, which Ember peers do not hold (neither quantized tensors nor the fake-"
                "quantize kernels of quantization-aware training); observers run, and a model calibrated on ember "
                "converts on CPU")
    if DENY.search(op) and name not in DENY_EXCEPT:
        return f"ATen op {name} is refused on Ember peers (files, raw memory or unchecked access)"
    if op[:1] == "_" and op[1:2] != "_" and op not in internal_ops():
        return (f"ATen op {name} is refused on Ember peers: an internal kernel that neither torch's public API nor "
                f"ember.torch sends a device (those run: ember/protocol/{INTERNAL_OPS_FILE}), and one named directly "
                "may trust its arguments")
    for arg, t in arg_types:
        if category(t) is None:
            return f"ATen op {name} takes a {t} ({arg}), which Ember peers do not accept"
    for t in return_types:
        if t not in RETURNS:
            return f"ATen op {name} returns a {t}, which Ember peers do not send back"
    return None


def layout_extent(layout: Any, itemsizes: dict[str, int]) -> int:
    """Bytes a layout ``[size, stride, offset, dtype]`` reaches into its storage (0 if empty).

    Raises ``ValueError`` naming what is malformed: a client's layout is checked against its
    storage with this before the peer touches memory through it.
    """
    if not isinstance(layout, list) or len(layout) != 4:
        raise ValueError(f"a layout is [size, stride, offset, dtype], got {str(layout)[:80]}")
    size, stride, offset, dtype = layout
    if dtype not in itemsizes:
        raise ValueError(f"unknown dtype {str(dtype)[:40]!r} in a layout")
    if not isinstance(size, list) or not isinstance(stride, list) or len(size) != len(stride) \
            or len(size) > MAX_DIMS:
        raise ValueError("a layout's size and stride must be lists of equal length (at most "
                         f"{MAX_DIMS} dims)")
    if type(offset) is not int or not 0 <= offset <= INT64[1]:
        raise ValueError(f"a layout's offset must be a non-negative int, got {offset!r}")
    last, count = offset, 1
    for n, s in zip(size, stride):
        if type(n) is not int or type(s) is not int or n < 0 or s < 0 or n > INT64[1] or s > INT64[1]:
            raise ValueError(f"a layout's sizes and strides must be non-negative ints, got {size} / {stride}")
        if n == 0:
            return 0
        last += (n - 1) * s
        count *= n
    if count > MAX_ELEMENTS:
        raise ValueError(f"a layout of {size} describes {count} elements, over the {MAX_ELEMENTS} a peer accepts")
    return (last + 1) * itemsizes[dtype]


def dense(size: Any, stride: Any) -> bool:
    """Whether a layout's elements fill a block of memory exactly once: torch's ``is_non_overlapping_and_dense``
    (c10's rule: in some order of its dims, each stride the product of the sizes of the dims inside it; dims of
    size 0 or 1 ignored)."""
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(size, stride) if n >= 2):
        if s != expected:
            return False
        expected *= n
    return True


def broadcast_numel(layouts: Any) -> int:
    """Elements of the broadcast of the layouts' sizes (as torch broadcasts: aligned from the last dim, each dim
    the largest), 0 if any is empty; an upper bound for incompatible sizes. Well-formed layouts only."""
    dims: list[int] = []
    for lay in layouts:
        size = lay[0]
        for k in range(1, len(size) + 1):
            if k > len(dims):
                dims.append(size[-k])
            elif size[-k] == 0 or dims[k - 1] == 0:
                dims[k - 1] = 0
            else:
                dims[k - 1] = max(dims[k - 1], size[-k])
    n = 1
    for d in dims:
        n *= d
    return n


__all__ = ["broadcast_numel", "dense", "MAX_ELEMENTS", "CATEGORY", "RETURNS", "DTYPES", "MEMORY_FORMATS", "INTERNAL",
           "DENY", "INTERNAL_OPS_FILE", "internal_ops", "UNMARKED_WRITES", "category", "refusal", "layout_extent",
           "TENSOR", "TENSOR_LIST", "SCALAR", "SCALAR_LIST", "LITERAL", "STRING", "DTYPE", "MEMORY_FORMAT",
           "LAYOUT", "DEVICE", "GENERATOR"]
