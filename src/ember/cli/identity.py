"""``ember keygen`` and ``ember doctor``, and the iroh options ``ember serve`` shares with them."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def iroh_settings(args: argparse.Namespace) -> tuple[bool, Any, list[str] | None]:
    """(offline, relay, bind) from the command line, falling back to the environment.

    ``EMBER_OFFLINE=1`` turns offline on; ``EMBER_BIND`` holds comma-separated
    ``HOST:PORT`` bind addresses.
    """
    offline = args.offline if args.offline is not None else _env_flag("EMBER_OFFLINE")
    relay = args.relay if args.relay is not None else "default"
    bind = args.bind
    if bind is None and os.environ.get("EMBER_BIND", "").strip():
        bind = [b.strip() for b in os.environ["EMBER_BIND"].split(",") if b.strip()]
    if offline and args.relay not in (None, "disabled"):
        print("ember: note: --offline uses no relays; --relay is ignored", file=sys.stderr)
    return offline, relay, bind


def keygen(args: argparse.Namespace) -> int:
    """Write a new key; print its peer id on stdout (and where it went on stderr)."""
    from ..keys import generate_key, peer_id_of

    try:
        key = generate_key(args.path, force=args.force)
    except FileExistsError as e:
        print(f"ember keygen: error: {e}", file=sys.stderr)
        print("  hint: choose another path, or pass --force to replace the key", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"ember keygen: error: cannot write {args.path}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"ember keygen: wrote a new secret key to {args.path} (mode 0600); its peer id:",
          file=sys.stderr)
    print(peer_id_of(key), flush=True)
    return 0


def doctor(args: argparse.Namespace) -> int:
    """Run the checks of :mod:`ember.doctor`, print verdicts, return 0 when serving is possible."""
    from ..doctor import print_checks, run_checks

    offline, relay, bind = iroh_settings(args)
    print(f"ember doctor: checking iroh serving ({'offline' if offline else f'relay {relay}'})", flush=True)
    checks = run_checks(key_path=args.key, relay=relay, offline=offline, bind=bind, timeout=args.timeout)
    return print_checks(checks)
