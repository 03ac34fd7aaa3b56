"""``ember run [--peer ADDR] script.py args…``: an unchanged PyTorch script on an Ember peer (like torchrun).

Imports :mod:`ember.torch` (``"ember"`` becomes a torch device), connects to ``--peer`` (else
``$EMBER_PEER``, else the embedded in-process peer), then runs the script as ``__main__`` with
its own argv, so ``--device=ember`` or ``torch.device("ember")`` in it lands on that peer. It also sets
``ACCELERATE_TORCH_DEVICE=ember`` unless set: accelerate's switch for a device it does not know by name,
through which ``transformers.Trainer`` trains on ember. (Not set by ``import ember.torch``: accelerate
lets the variable override ``cpu=True``, so ``TrainingArguments(use_cpu=True)`` would train on ember.)
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", default=None, metavar="ADDR",
                   help="the peer: an iroh ticket, ws://HOST:PORT or tcp://HOST:PORT (default: $EMBER_PEER, "
                        "else an embedded torch:cpu peer)")
    p.add_argument("script", help="the Python script to run as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    if args.peer:
        os.environ["EMBER_PEER"] = args.peer  # (the script's subprocesses, DataLoader workers, see it too)
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "ember")  # accelerate's (so transformers.Trainer's) device
    if not os.path.isfile(args.script):
        print(f"ember run: error: no script at {args.script!r}", file=sys.stderr)
        return 2
    import ember.torch as et
    from ember.torch import _devices
    if args.peer:
        _devices.PEER = args.peer
    et.current_device()  # connect now: a wrong address fails here, not at the script's first tensor
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        raise
    return 0


__all__ = ["add_options", "run"]
