"""The layout CPU torch gives an elementwise op's output: ``TensorIterator``'s rule, ported.

The client infers an op's output layout by running its meta kernel. For elementwise ops many meta kernels are
Python decompositions (``torch._refs``: ``elu_backward``, ``copysign``, ``gelu``, ``add``...) whose rule,
``torch._prims_common.compute_elementwise_output_strides``, differs from CPU's ``TensorIterator`` in two places:
TensorIterator makes the output contiguous when every operand counts as contiguous (``NC11`` with the strides of a
channels-last tensor counts as both: the refs permute it), and it never looks past a first operand whose layout
settles the order. The peer computes in the layout the client names, so values are equal; but the next reduction
over the output adds in another order (a BatchNorm after a 1x1 feature map, an ELU network's bias gradient): last
bits. Here is TensorIterator's rule (``TensorIterator.cpp``: ``compute_shape``, ``compute_fast_setup_type``,
``compute_strides``, ``reorder_dimensions``, ``allocate_or_resize_outputs``), for inputs only (fresh outputs).
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import aten as A

#: Elementwise backward kernels with no ``pointwise`` tag whose CPU kernel iterates (grad, input) in that order.
BACKWARDS = frozenset({"elu_backward", "softplus_backward", "hardtanh_backward", "hardswish_backward",
                       "hardsigmoid_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
                       "logit_backward", "mish_backward", "softshrink_backward", "hardshrink_backward",
                       "leaky_relu_backward"})
#: Kernels that iterate their two tensor operands in the other order: (input, grad).
SWAPPED = frozenset({"threshold_backward", "leaky_relu_backward"})
#: Elementwise ops CPU runs into ``empty_like(self)``: the input's own layout when it is dense.
LIKE_SELF = frozenset({"hardtanh"})
#: Overloads whose CPU output is contiguous whatever the operands (a number to a tensor's power).
CONTIGUOUS = frozenset({"aten.pow.Scalar"})
#: Elementwise forward kernels with no ``pointwise`` tag.
FORWARDS = frozenset({"hardswish"})


def elementwise(op: Any, base: str) -> bool:
    """Whether overload ``op`` (named ``base``) runs a TensorIterator kernel on CPU, its output laid out by the rule."""
    if base in BACKWARDS or base in FORWARDS:
        return True
    return torch.Tag.pointwise in op.tags and not base.startswith("_foreach_") and not base.endswith("_") \
        and base not in ("clone", "_to_copy", "copy")


def wraps_scalar(overload: str, arg: str) -> bool:
    """Whether the Scalar argument ``arg`` of an overload named ``overload`` is an operand of the iterator (CPU
    wraps a binary op's ``other`` in a 0-d tensor: ``gt.Scalar``, ``add.Scalar``, ``fmod.Scalar``...), which sends
    the layout down the general path; other Scalars (``alpha``, ``min``, an exponent) are constants of the kernel."""
    return arg == "other" and overload in ("Scalar", "Scalar_mode")


def output_layout(name: str, base: str, operands: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> tuple[
        tuple[int, ...], tuple[int, ...]]:
    """(shape, strides) of the fresh output CPU gives overload ``name`` (base name ``base``) on ``operands``, in the
    order of its arguments (see :func:`output_strides`): the rule, with its exceptions (:data:`SWAPPED`,
    :data:`CONTIGUOUS`, :data:`LIKE_SELF`)."""
    if base in SWAPPED:
        operands = operands[::-1]
    shape, strides = output_strides(operands)
    if name in CONTIGUOUS:
        return shape, _contiguous_strides(shape)
    if base in LIKE_SELF and A.dense(*operands[0][:2]):  # (its own strides, size-1 dims' included)
        return operands[0][0], operands[0][1]
    return shape, strides


def output_strides(operands: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> tuple[tuple[int, ...],
                                                                                         tuple[int, ...]]:
    """(shape, strides) of a fresh output of an elementwise op on ``operands``: each (shape, strides, element size),
    a wrapped number as a 0-d operand ``((), (), size)``, in the order of the op's arguments."""
    shape: tuple[int, ...] = ()
    same, scalars, tensors = True, False, False
    for s, _st, _sz in operands:
        if not s:
            scalars = True
        else:
            tensors = True
        if scalars and tensors:
            same = False
        if not shape:
            shape = s
        elif s != shape:
            same = False
            shape = tuple(torch.broadcast_shapes(shape, s))
    ndim = len(shape)
    if same:  # compute_fast_setup_type
        if all(_contiguous(s, st) for s, st, _ in operands):
            return shape, _contiguous_strides(shape)
        if ndim == 4 and all(_channels_last(s, st) for s, st, _ in operands):
            return shape, _channels_last_strides(shape)
        if all(A.dense(s, st) for s, st, _ in operands) and all(st == operands[0][1] for _, st, _ in operands):
            return shape, operands[0][1]
    if ndim <= 1:
        return shape, _contiguous_strides(shape)
    stride_bytes = []  # compute_strides: a dim an operand broadcasts along has stride 0
    for s, st, size in operands:
        off = ndim - len(s)
        b = [0] * off + [0 if n == 1 and shape[off + k] != 1 else x * size for k, (n, x) in enumerate(zip(s, st))]
        stride_bytes.append(b)
    perm = list(range(ndim - 1, -1, -1))  # reorder_dimensions: fastest-moving first

    def should_swap(d0: int, d1: int) -> int:
        for b in stride_bytes:
            s0, s1 = b[d0], b[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            c = should_swap(perm[dim0], perm[dim1])
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break
    if perm == list(range(ndim - 1, -1, -1)):
        return shape, _contiguous_strides(shape)
    strides = [0] * ndim
    acc = 1
    for d in perm:  # allocate_or_resize_outputs: contiguous in the permuted order
        strides[d] = acc
        acc *= shape[d]
    return shape, tuple(strides)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _channels_last_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    n, c, h, w = shape
    return (h * w * c, 1, w * c, c) if c and h and w else _contiguous_strides(shape)


def _contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``is_contiguous()``: size-1 dims ignored, an empty tensor contiguous."""
    if 0 in shape:
        return True
    acc = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1:
            if s != acc:
                return False
            acc *= n
    return True


def _channels_last(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``is_contiguous(memory_format=torch.channels_last)`` of a 4-d layout."""
    if len(shape) != 4:
        return False
    if 0 in shape:
        return True
    acc = 1
    for d in (1, 3, 2, 0):
        if shape[d] != 1:
            if stride[d] != acc:
                return False
            acc *= shape[d]
    return True


__all__ = ["elementwise", "output_layout", "output_strides", "wraps_scalar", "BACKWARDS", "FORWARDS", "SWAPPED",
           "LIKE_SELF", "CONTIGUOUS"]
