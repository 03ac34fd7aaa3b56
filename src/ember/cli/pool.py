"""``ember pool serve|status|stop``: the pool's broker (a detached named Ray actor, ``ember-pool``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..errors import EmberError


def add_options(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="pool_command", metavar="{serve,status,stop}", required=True)
    for name, text in (("serve", "start the broker on a Ray cluster (detached: it outlives this command)"),
                       ("status", "the broker's leases"),
                       ("stop", "release every lease (actors killed, placement groups removed), end the broker")):
        s = sub.add_parser(name, help=text)
        s.add_argument("--address", default=None,
                       help="the Ray cluster (ray://head:10001, or host:port of its GCS; default: RAY_ADDRESS, "
                            "else a running local cluster)")
        if name == "status":
            s.add_argument("--json", action="store_true", help="print the figures as JSON")


def _connect(address: str | None) -> Any:
    from ..pool._pool import _ray
    ray = _ray()
    try:
        ray.init(address=address or "auto", namespace="ember", log_to_driver=False)
    except ConnectionError as e:
        raise EmberError(f"no Ray cluster to reach: {e}",
                         hint="start one (`ray start --head`) or pass --address ray://head:10001") from None
    return ray


def run(args: argparse.Namespace) -> int:
    from ..pool import BROKER_NAME, get_broker
    ray = _connect(args.address)
    try:
        if args.pool_command == "serve":
            b = get_broker(ray, detached=True)
            st = ray.get(b.status.remote(), timeout=120)
            print(f"ember pool: broker {BROKER_NAME!r} runs on the Ray cluster ({len(st['leases'])} leases); "
                  "`ember pool stop` ends it", flush=True)
            return 0
        b = get_broker(ray, start=False)
        if args.pool_command == "status":
            st = ray.get(b.status.remote(), timeout=30)
            if args.json:
                print(json.dumps(st))
                return 0
            print(f"broker {st['broker']}: up {st['up_s']:g} s, {st['granted']} leases granted, "
                  f"{len(st['leases'])} held")
            for lease in st["leases"]:
                print(f"  {lease['id']}  {lease['state']:8s} {lease['device']} x{lease['n']}  "
                      f"{' '.join(lease['addresses'])}  client {lease['client'][:16]}  {lease['age_s']:g} s")
            return 0
        n = ray.get(b.stop.remote(), timeout=120)
        ray.kill(b)
        print(f"ember pool: broker stopped, {n} lease{'s' if n != 1 else ''} released")
        return 0
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
        raise EmberError(f"the broker did not answer: {type(e).__name__}",
                         hint="`ember pool serve` starts it again") from None
    finally:
        ray.shutdown()
