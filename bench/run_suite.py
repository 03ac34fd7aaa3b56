"""The whole benchmark suite: ``python bench/run_suite.py [--quick] [...]`` (same as ``ember bench``).

Every figure over the in-memory link, WebSocket and iroh, next to baselines
measured in the same run (local NumPy, raw asyncio TCP, a websockets echo, an
asyncio thread hop, rpyc where installed); medians of repeated runs, printed
as a table and written to ``bench/results/`` as JSON (and PNG with matplotlib).
See ``ember.bench`` for what each figure measures.
"""

import sys

from ember.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
