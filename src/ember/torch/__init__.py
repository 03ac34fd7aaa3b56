"""Unchanged PyTorch code on Ember devices: ``import ember.torch`` registers the ``"ember"`` device.

>>> import torch, ember, ember.torch                                  # doctest: +SKIP
>>> ember.set_default_device(ember.connect("ws://gpu-box:7000"))        # a peer with --device torch:cpu
>>> model = torch.nn.Linear(4, 2).to("ember")                          # real nn.Parameters on ember:0
>>> loss = model(torch.randn(8, 4).to("ember")).square().mean()
>>> loss.backward(); loss.item()                                      # one round trip

Every ATen op (forward and backward: autograd stays here) is recorded lazily and sent in
the session's batches; shapes, strides and dtypes come from torch's meta kernels, cached
per op and layout, so a training step costs no round trip. The peer holds *storages*;
views and in-place ops alias exactly as in torch. ``"ember"`` tensors live on the
current Ember device: the innermost ``with dev:`` or ``ember.set_default_device(dev)``,
else an embedded in-process ``torch:cpu`` peer. torch sees one device, ``ember:0``; which
Ember device a tensor lives on travels with its storage (:func:`device_of`), and
:func:`to_device` moves tensors between Ember devices.

Round trips happen only where torch needs a value: ``.item()``, ``bool(t)``, ``.cpu()``,
``print(t)``, ``.tolist()``, ``torch.save``, data-dependent shapes (``nonzero``, boolean
masks). ``torch.autocast("ember", dtype=...)`` applies CUDA's mixed-precision policy;
``torch.compile(m, backend="ember")`` records each compiled graph once and replays it.
Not supported: ``generator=`` arguments (seed with ``torch.manual_seed``, which reseeds the
peers too), quantized/nested tensors, sparse layouts but COO (a few COO ops: :mod:`._sparse`),
``ember:1`` (one torch device).
"""

from __future__ import annotations

from ._compat import UnsupportedTorch, check_torch

check_torch()  # before anything that touches torch's Python device API

from ._device import register  # noqa: E402

register()

from ._devices import NotATorchDevice, WrongDevice, current_device  # noqa: E402
from ._dispatch import counters  # noqa: E402
from ._transfer import device_of, from_array, to_array, to_device  # noqa: E402
from .mesh import Mesh, MeshError, MeshPeerLost, mesh  # noqa: E402
from .data_parallel import DataParallel  # noqa: E402
from ._capture import CaptureWarning, capture  # noqa: E402
from ._capture import stats as capture_stats  # noqa: E402
from ._optstep import capture_optimizer_steps, install as _install_optimizer_steps  # noqa: E402
from ._optstep import stats as optimizer_stats  # noqa: E402

_install_optimizer_steps()  # an optimizer whose parameters are all on Ember replays its step (see _optstep)


def compiler(gm: "torch.fx.GraphModule", example_inputs: list,  # type: ignore[name-defined]
             **options: object) -> "object":
    """The ``torch.compile`` backend (``backend="ember"``, or ``backend=ember.torch.compiler``):
    each compiled graph's ATen ops are recorded once per layout and replayed (:mod:`._compile`)."""
    from ._compile import compiler as compile_graph
    return compile_graph(gm, example_inputs, **options)

__all__ = ["capture", "CaptureWarning", "capture_stats", "capture_optimizer_steps", "optimizer_stats", "mesh", "Mesh", "MeshError", "MeshPeerLost", "DataParallel", "compiler", "to_device", "device_of", "from_array", "to_array", "current_device", "counters", "NotATorchDevice",
           "WrongDevice", "UnsupportedTorch", "register"]
