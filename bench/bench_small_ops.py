"""Pipelined small-op throughput and op+read latency (the issue-2 benchmark).

* a chain of 10,000 elementwise ops on 16-element arrays with one read at the
  end, over the in-memory link and WebSocket (and iroh with ``--transports``),
  next to the same chain in local NumPy in the same run (ops/s);
* op + read round trip of a 1-element array, p50 and p99 (µs), next to raw
  asyncio TCP, a websockets echo and an asyncio thread hop.

The server runs in its own process (pinned to core 1, the client to core 0).
This is ``ember bench --only pipelined,latency --transports memory,websocket``;
extra arguments are passed on (e.g. ``--quick``, ``--repeat 9``, ``--transports
memory,websocket,iroh``).
"""

import sys

from ember.bench import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a.startswith("--only") for a in args):
        args += ["--only", "pipelined,latency"]
    if not any(a.startswith("--transports") for a in args):
        args += ["--transports", "memory,websocket"]
    sys.exit(main(args))
