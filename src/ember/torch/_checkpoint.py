"""Checkpoints: ``torch.load(f, map_location="ember")``, and whole pickled models that come back on ember.

``torch.save`` writes an ember tensor as its CPU copy (``_patches``), so a checkpoint loads on a
machine without Ember. Two ways back onto the device, as CUDA has them:

* ``map_location="ember"`` (or ``"ember:0"``, ``torch.device("ember")``): the checkpoint is loaded
  on CPU, then each storage is uploaded once to the current Ember device and every tensor rebuilt
  on it in its layout (views stay views, ``nn.Parameter`` stays one, modules move with ``.to``).
  (torch's own storage-by-storage route reads a data pointer an ember storage does not have.)
* ``torch.save(model)`` of a module whose parameters live on ember records that in the module's
  pickled state (one extra key, ignored without Ember: it only lands in ``__dict__``, and is
  removed on load here), and ``torch.load`` without ``map_location`` moves the module back to
  ember, parameter objects (and so tied weights) kept.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any

import torch

_ON_EMBER = "_ember_on_device"
_loading = threading.local()  # keep: no map_location given, so a module saved on ember comes back there


def _is_ember(location: Any) -> bool:
    return isinstance(location, (str, torch.device)) and torch.device(location).type == "ember"


def _onto_ember(obj: Any, storages: dict[int, Any]) -> Any:
    """``obj`` with every CPU tensor in it on ember: containers rebuilt, modules moved."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
        st = obj.untyped_storage()
        if id(st) not in storages:
            storages[id(st)] = (st, torch.empty(0, dtype=torch.uint8, device="cpu").set_(st).to("ember").untyped_storage())
        t = torch.empty(0, dtype=obj.dtype, device="ember").set_(storages[id(st)][1], obj.storage_offset(),
                                                                  obj.shape, obj.stride())
        return torch.nn.Parameter(t, obj.requires_grad) if isinstance(obj, torch.nn.Parameter) else \
            t.requires_grad_(obj.requires_grad)
    if isinstance(obj, torch.nn.Module):
        return obj.to("ember")
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else dict()
        for k, v in obj.items():
            out[k] = _onto_ember(v, storages)
        return out
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_onto_ember(v, storages) for v in obj)
    return obj


def install() -> None:
    """Register the deserializer and the module pickling hooks (idempotent)."""
    if getattr(torch.nn.Module.__setstate__, "_ember", False):
        return
    load = torch.load

    @functools.wraps(load)
    def _load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _is_ember(map_location):
            return _onto_ember(load(f, "cpu", *args, **kwargs), {})
        _loading.keep, before = map_location is None, getattr(_loading, "keep", True)
        try:
            return load(f, map_location, *args, **kwargs)
        finally:
            _loading.keep = before

    torch.load = _load  # type: ignore[assignment]
    getstate, setstate = torch.nn.Module.__getstate__, torch.nn.Module.__setstate__

    def marked(get: Any) -> Any:
        @functools.wraps(get)
        def __getstate__(self: torch.nn.Module) -> Any:
            state = get(self)
            tensors = [*self._parameters.values(), *self._buffers.values()]
            if isinstance(state, dict) and any(t is not None and t.device.type == "ember" for t in tensors):
                state = {**state, _ON_EMBER: True}
            return state
        return __getstate__

    def __setstate__(self: torch.nn.Module, state: Any) -> None:
        setstate(self, state)
        if self.__dict__.pop(_ON_EMBER, False) and getattr(_loading, "keep", True):
            self._apply(lambda t: t.to("ember"), recurse=False)

    __setstate__._ember = True  # type: ignore[attr-defined]
    torch.nn.Module.__getstate__, torch.nn.Module.__setstate__ = marked(getstate), __setstate__  # type: ignore
    # modules with a __getstate__ of their own that does not call Module's (RNNs: their weights' references)
    torch.nn.RNNBase.__getstate__ = marked(torch.nn.RNNBase.__getstate__)  # type: ignore[method-assign]


__all__ = ["install"]
